"""Planners: choose the draft sub-network and draft length each round.

Built-ins are imported here so that their registrations happen eagerly.
"""

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.static import AutoregressivePlanner, EarlyExitPlanner, StaticPlanner

__all__ = [
    "PLANNERS",
    "AutoregressivePlanner",
    "EarlyExitPlanner",
    "Planner",
    "PlanningContext",
    "StaticPlanner",
]
