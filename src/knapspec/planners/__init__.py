"""Planners: choose the draft sub-network and draft length each round.

Built-ins are imported here so that their registrations happen eagerly.
"""

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.bayesian import BayesianPlanner
from knapspec.planners.clasp import CLaSpPlanner
from knapspec.planners.del_ import DELPlanner
from knapspec.planners.knapsack import KnapsackPlanner
from knapspec.planners.lookup import LookupPlanner
from knapspec.planners.static import AutoregressivePlanner, EarlyExitPlanner, StaticPlanner

__all__ = [
    "PLANNERS",
    "AutoregressivePlanner",
    "BayesianPlanner",
    "CLaSpPlanner",
    "DELPlanner",
    "EarlyExitPlanner",
    "KnapsackPlanner",
    "LookupPlanner",
    "Planner",
    "PlanningContext",
    "StaticPlanner",
]
