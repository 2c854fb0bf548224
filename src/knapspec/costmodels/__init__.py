"""Cost models: predicted sublayer latencies that weigh knapsack items and price TPT.

Importing this package registers the built-in cost models eagerly: ``"linear"``
(:class:`FittedLinearCostModel`) and ``"online"`` (:class:`OnlineCalibratedCostModel`).
"""

from knapspec.costmodels.base import COST_MODELS, CostModel, LatencyObservation, knapsack_weights
from knapspec.costmodels.defaults import default_cost_model, load_profile_for
from knapspec.costmodels.linear import (
    FittedLinearCostModel,
    FittedLinearCostModelConfig,
    LinearCoefficients,
)
from knapspec.costmodels.online import (
    OnlineCalibratedCostModel,
    OnlineCalibratedCostModelConfig,
)
from knapspec.costmodels.profile import (
    SCHEMA_VERSION,
    LatencyProfile,
    ProfileError,
    ProfileKey,
    ProfileMismatchError,
    VerifyTiming,
)
from knapspec.costmodels.profiler import profile_engine
from knapspec.costmodels.rls import RecursiveLeastSquares
from knapspec.costmodels.store import PROFILE_ENV, default_profile_path, load_or_measure_profile

__all__ = [
    "COST_MODELS",
    "PROFILE_ENV",
    "SCHEMA_VERSION",
    "CostModel",
    "FittedLinearCostModel",
    "FittedLinearCostModelConfig",
    "LatencyObservation",
    "LatencyProfile",
    "LinearCoefficients",
    "OnlineCalibratedCostModel",
    "OnlineCalibratedCostModelConfig",
    "ProfileError",
    "ProfileKey",
    "ProfileMismatchError",
    "RecursiveLeastSquares",
    "VerifyTiming",
    "default_cost_model",
    "default_profile_path",
    "knapsack_weights",
    "load_or_measure_profile",
    "load_profile_for",
    "profile_engine",
]
