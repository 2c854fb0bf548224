"""knapspec: training-free self-speculative decoding with knapsack-chosen draft layers.

The draft model is a subset of the target model's own attention and MLP sublayers, chosen
per context length as a 0/1 knapsack (KnapSpec, ICML 2026); verification keeps the output
exactly the target model's.

    >>> from knapspec import SpeculativeDecoder  # doctest: +SKIP
    >>> decoder = SpeculativeDecoder(model)      # doctest: +SKIP
    >>> result = decoder.generate(input_ids, max_new_tokens=128)  # doctest: +SKIP

The public names are imported on first use (PEP 562), so that ``import knapspec`` and the
``knapspec`` command start without loading torch and transformers: a Ctrl-C during those
imports then reaches the command's handler and prints one line, and ``knapspec --help``
answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from knapspec.components import Component
    from knapspec.config import (
        ComponentConfig,
        ConfigError,
        DecoderConfig,
        load_config,
        save_config,
    )
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
    from knapspec.decoding.batch import BatchGenerationResult
    from knapspec.decoding.conversation import (
        Conversation,
        ConversationBusyError,
        ConversationError,
        ConversationTurn,
    )
    from knapspec.decoding.decoder import GenerationResult, SpeculativeDecoder
    from knapspec.decoding.stats import GenerationStats, PlanRecord
    from knapspec.drafters import (
        DRAFTERS,
        BatchDraftRequest,
        Draft,
        Drafter,
        DraftRequest,
        DraftTarget,
        LookupDrafter,
        SubnetworkDrafter,
    )
    from knapspec.errors import NonFiniteLogitsError
    from knapspec.model import ContextLengthError, KVCache, SublayerEngine, UnsupportedModelError
    from knapspec.model.loading.provision import ProvisioningError, load_model_and_tokenizer
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
    from knapspec.planners.batch.policy import (
        BatchDraftPolicy,
        BatchSubnetwork,
        CostModelBatchPolicy,
        FixedLookupBatchPolicy,
        FixedSubnetworkBatchPolicy,
        PlainBatchPolicy,
        RoundPlan,
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

#: Public name -> the module that defines it.
_EXPORTS = {
    "AcceptanceEstimate": "knapspec.proxies",
    "AutoregressivePlanner": "knapspec.planners",
    "BayesianPlanner": "knapspec.planners",
    "CLaSpPlanner": "knapspec.planners",
    "COST_MODELS": "knapspec.costmodels",
    "DRAFTERS": "knapspec.drafters",
    "BatchDraftRequest": "knapspec.drafters",
    "Draft": "knapspec.drafters",
    "DraftRequest": "knapspec.drafters",
    "DraftTarget": "knapspec.drafters",
    "Drafter": "knapspec.drafters",
    "LookupDrafter": "knapspec.drafters",
    "LookupPlanner": "knapspec.planners",
    "SubnetworkDrafter": "knapspec.drafters",
    "Component": "knapspec.components",
    "ComponentConfig": "knapspec.config",
    "ConfigError": "knapspec.config",
    "ContextLengthError": "knapspec.model",
    "Conversation": "knapspec.decoding.conversation",
    "ConversationBusyError": "knapspec.decoding.conversation",
    "ConversationError": "knapspec.decoding.conversation",
    "ConversationTurn": "knapspec.decoding.conversation",
    "CosineProxy": "knapspec.proxies",
    "CostModel": "knapspec.costmodels",
    "DELPlanner": "knapspec.planners",
    "DecoderConfig": "knapspec.config",
    "DraftPlan": "knapspec.types",
    "EarlyExitPlanner": "knapspec.planners",
    "FittedLinearCostModel": "knapspec.costmodels",
    "GenerationResult": "knapspec.decoding.decoder",
    "BatchGenerationResult": "knapspec.decoding.batch",
    "BatchDraftPolicy": "knapspec.planners.batch.policy",
    "CostModelBatchPolicy": "knapspec.planners.batch.policy",
    "FixedLookupBatchPolicy": "knapspec.planners.batch.policy",
    "FixedSubnetworkBatchPolicy": "knapspec.planners.batch.policy",
    "BatchSubnetwork": "knapspec.planners.batch.policy",
    "RoundPlan": "knapspec.planners.batch.policy",
    "PlainBatchPolicy": "knapspec.planners.batch.policy",
    "GenerationStats": "knapspec.decoding.stats",
    "KVCache": "knapspec.model",
    "KnapsackPlanner": "knapspec.planners",
    "LatencyObservation": "knapspec.costmodels",
    "LatencyProfile": "knapspec.costmodels",
    "MonteCarloAcceptanceProxy": "knapspec.proxies",
    "NonFiniteLogitsError": "knapspec.errors",
    "OnlineCalibratedCostModel": "knapspec.costmodels",
    "PLANNERS": "knapspec.planners",
    "PROXIES": "knapspec.proxies",
    "PlanRecord": "knapspec.decoding.stats",
    "Planner": "knapspec.planners",
    "PlanningContext": "knapspec.planners",
    "ProfileError": "knapspec.costmodels",
    "ProfileMismatchError": "knapspec.costmodels",
    "ProvisioningError": "knapspec.model.loading.provision",
    "ReferenceWindow": "knapspec.window",
    "Registry": "knapspec.registry",
    "SamplingParams": "knapspec.sampling",
    "SpeculativeDecoder": "knapspec.decoding.decoder",
    "StaticPlanner": "knapspec.planners",
    "StepOutcome": "knapspec.types",
    "SublayerEngine": "knapspec.model",
    "SublayerMask": "knapspec.types",
    "UnknownComponentError": "knapspec.registry",
    "UnsupportedModelError": "knapspec.model",
    "ValueProxy": "knapspec.proxies",
    "load_config": "knapspec.config",
    "load_model_and_tokenizer": "knapspec.model.loading.provision",
    "profile_engine": "knapspec.costmodels",
    "save_config": "knapspec.config",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'knapspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__version__ = "0.1.0"

__all__ = [
    "COST_MODELS",
    "DRAFTERS",
    "PLANNERS",
    "PROXIES",
    "AcceptanceEstimate",
    "AutoregressivePlanner",
    "BatchDraftPolicy",
    "BatchDraftRequest",
    "BatchGenerationResult",
    "BatchSubnetwork",
    "BayesianPlanner",
    "CLaSpPlanner",
    "Component",
    "ComponentConfig",
    "ConfigError",
    "ContextLengthError",
    "Conversation",
    "ConversationBusyError",
    "ConversationError",
    "ConversationTurn",
    "CosineProxy",
    "CostModel",
    "CostModelBatchPolicy",
    "DELPlanner",
    "DecoderConfig",
    "Draft",
    "DraftPlan",
    "DraftRequest",
    "DraftTarget",
    "Drafter",
    "EarlyExitPlanner",
    "FittedLinearCostModel",
    "FixedLookupBatchPolicy",
    "FixedSubnetworkBatchPolicy",
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
    "PlainBatchPolicy",
    "PlanRecord",
    "Planner",
    "PlanningContext",
    "ProfileError",
    "ProfileMismatchError",
    "ProvisioningError",
    "ReferenceWindow",
    "Registry",
    "RoundPlan",
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
