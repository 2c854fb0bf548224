"""knapspec: training-free self-speculative decoding with knapsack-chosen draft layers.

The draft model is a subset of the target model's own attention and MLP sublayers, chosen
per context length as a 0/1 knapsack (KnapSpec, ICML 2026); verification keeps the output
exactly the target model's.

    >>> from knapspec import SpeculativeDecoder  # doctest: +SKIP
    >>> decoder = SpeculativeDecoder(model)      # doctest: +SKIP
    >>> result = decoder.generate(input_ids, max_new_tokens=128)  # doctest: +SKIP
"""

from knapspec.components import Component
from knapspec.config import ComponentConfig, ConfigError, DecoderConfig, load_config, save_config
from knapspec.costmodels import (
    COST_MODELS,
    CostModel,
    FittedLinearCostModel,
    LatencyObservation,
    LatencyProfile,
    OnlineCalibratedCostModel,
    ProfileError,
    ProfileMismatchError,
    profile_engine,
)
from knapspec.decoding.decoder import GenerationResult, SpeculativeDecoder
from knapspec.decoding.stats import GenerationStats, PlanRecord
from knapspec.decoding.verify import NonFiniteLogitsError
from knapspec.drafters import DRAFTERS, Draft, Drafter, LookupDrafter, SubnetworkDrafter
from knapspec.model import ContextLengthError, KVCache, SublayerEngine, UnsupportedModelError
from knapspec.model.provision import ProvisioningError, load_model_and_tokenizer
from knapspec.planners import (
    PLANNERS,
    AutoregressivePlanner,
    BayesianPlanner,
    CLaSpPlanner,
    DELPlanner,
    EarlyExitPlanner,
    KnapsackPlanner,
    LookupPlanner,
    Planner,
    PlanningContext,
    StaticPlanner,
)
from knapspec.proxies import (
    PROXIES,
    AcceptanceEstimate,
    CosineProxy,
    MonteCarloAcceptanceProxy,
    ValueProxy,
)
from knapspec.registry import Registry, UnknownComponentError
from knapspec.sampling import SamplingParams
from knapspec.types import DraftPlan, StepOutcome, SublayerMask
from knapspec.window import ReferenceWindow

__version__ = "0.1.0"

__all__ = [
    "COST_MODELS",
    "DRAFTERS",
    "PLANNERS",
    "PROXIES",
    "AcceptanceEstimate",
    "AutoregressivePlanner",
    "BayesianPlanner",
    "CLaSpPlanner",
    "Component",
    "ComponentConfig",
    "ConfigError",
    "ContextLengthError",
    "CosineProxy",
    "CostModel",
    "DELPlanner",
    "DecoderConfig",
    "Draft",
    "DraftPlan",
    "Drafter",
    "EarlyExitPlanner",
    "FittedLinearCostModel",
    "GenerationResult",
    "GenerationStats",
    "KVCache",
    "KnapsackPlanner",
    "LatencyObservation",
    "LatencyProfile",
    "LookupDrafter",
    "LookupPlanner",
    "MonteCarloAcceptanceProxy",
    "NonFiniteLogitsError",
    "OnlineCalibratedCostModel",
    "PlanRecord",
    "Planner",
    "PlanningContext",
    "ProfileError",
    "ProfileMismatchError",
    "ProvisioningError",
    "ReferenceWindow",
    "Registry",
    "SamplingParams",
    "SpeculativeDecoder",
    "StaticPlanner",
    "StepOutcome",
    "SublayerEngine",
    "SublayerMask",
    "SubnetworkDrafter",
    "UnknownComponentError",
    "UnsupportedModelError",
    "ValueProxy",
    "load_config",
    "load_model_and_tokenizer",
    "profile_engine",
    "save_config",
]
