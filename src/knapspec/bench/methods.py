"""Benchmark methods: a name plus a decoder config, so that ablations are just more configs.

Every engine method is a :class:`~knapspec.decoding.decoder.SpeculativeDecoder`
built from the run's base :class:`~knapspec.config.DecoderConfig` with the method's
overrides merged in (:func:`method_config`). ``generate`` is ``model.generate`` called as
users call it; ``hf-prompt-lookup`` is ``model.generate(prompt_lookup_num_tokens=10)``,
transformers' prompt lookup at its documented default length (its greedy output is checked
against plain decoding like every greedy method's). ``ar`` (planner ``autoregressive``:
plain decoding through our own engine) is the reference every other method is paired with.

``lookup-k3`` / ``lookup-k10`` are the fixed-length prompt-lookup baseline on our engine
(planner ``lookup``: k tokens whenever the context's suffix matches, else a plain step);
``knapspec-no-lookup`` is the knapsack planner with the lookup family left out of its
search. Methods whose components this installation lacks are left out of the menu
(:func:`available`).

The ``static`` baseline is a fixed mask and γ. It is found once per scenario, before any
timed call, by the knapsack planner (with the γ = 0 fallback off, so that it speculates)
on a set-up prompt outside the measured set, and then frozen (``freeze_plan``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import torch

from knapspec.config import COMPONENT_REGISTRIES, DecoderConfig
from knapspec.decoding.decoder import GenerationResult, SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.planners.static import StaticPlanner
from knapspec.sampling import SamplingParams

MethodKind = Literal["engine", "generate"]
REFERENCE = "ar"
GENERATE = "generate"


def forget_earlier_calls(decoder: object) -> None:
    """Before a timed call: drop what earlier calls left to draft from (a decoder with
    lookup history would otherwise draft a repeated prompt's earlier answer), so that every
    call is measured as a first call."""
    clear = getattr(decoder, "clear_history", None)
    if callable(clear):
        clear()


class SupportsGenerate(Protocol):
    """What the harness times: :meth:`SpeculativeDecoder.generate`'s signature."""

    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int = ...,
        eos_token_id: int | Sequence[int] | None = ...,
        sampling: SamplingParams | None = ...,
    ) -> GenerationResult: ...


#: Builds the object a method times from the shared engine and its merged config.
DecoderFactory = Callable[[SublayerEngine, DecoderConfig], SupportsGenerate]


def _default_factory(engine: SublayerEngine, config: DecoderConfig) -> SupportsGenerate:
    return SpeculativeDecoder.from_config(engine, config)


@attrs.frozen
class MethodSpec:
    """One benchmarked method.

    Attributes:
        name: identifier in results and on the command line.
        config: :class:`DecoderConfig` dict-form overrides merged into the run's base config
            (a component section naming the same component as the base is merged field by
            field; naming another component replaces it).
        kind: ``"engine"`` (a decoder built by ``factory``) or ``"generate"``
            (``model.generate``; ``config`` is ignored).
        freeze_plan: build the decoder, run it once on the scenario's set-up prompt, and
            replace its planner by a :class:`StaticPlanner` holding its first speculative
            plan (the static baseline).
        description: one line for the report.
        factory: builds the timed object (default: ``SpeculativeDecoder.from_config``);
            tests use it to inject a broken decoder.
        generate_kwargs: extra keyword arguments of ``model.generate`` (``"generate"``
            methods only), e.g. ``{"prompt_lookup_num_tokens": 10}``.
    """

    name: str
    config: Mapping[str, Any] = attrs.field(factory=dict, eq=False)
    kind: MethodKind = "engine"
    freeze_plan: bool = False
    description: str = ""
    factory: DecoderFactory = attrs.field(default=_default_factory, eq=False, repr=False)
    generate_kwargs: Mapping[str, Any] = attrs.field(factory=dict, eq=False)


def method_config(base: DecoderConfig, overrides: Mapping[str, Any]) -> DecoderConfig:
    """``base`` with a method's dict-form ``overrides`` merged in.

    Raises:
        ConfigError / UnknownComponentError: the merged config is invalid.
    """
    data = base.to_dict()
    for key, value in overrides.items():
        current = data.get(key)
        if key in COMPONENT_REGISTRIES and isinstance(value, Mapping):
            same = (
                isinstance(current, Mapping)
                and value.get("name", current["name"]) == current["name"]
            )
            data[key] = {**current, **value} if same and isinstance(current, Mapping) else value
        elif key == "sampling" and isinstance(value, Mapping) and isinstance(current, Mapping):
            data[key] = {**current, **value}
        else:
            data[key] = value
    return DecoderConfig.from_dict(data)


def freeze_first_plan(decoder: SpeculativeDecoder, result: GenerationResult) -> StaticPlanner:
    """A static planner holding the first layer-skip plan ``decoder`` used in ``result``
    (lookup plans have no mask to freeze).

    Raises:
        RuntimeError: the call never drafted with a sub-network (no such plan to freeze).
    """
    engine = decoder.engine
    for record in result.stats.plans:
        if record.draft_length > 0 and record.drafter == "subnetwork":
            planner = StaticPlanner.from_config(
                StaticPlanner.config_class(
                    skipped_items=record.skipped_items, draft_length=record.draft_length
                ),
                engine,
            )
            return planner
    raise RuntimeError(
        "the static baseline could not be frozen: the knapsack planner never speculated on the "
        "set-up prompt (plans: " + ", ".join(str(p) for p in result.stats.plans) + ")"
    )


HF_PROMPT_LOOKUP = "hf-prompt-lookup"
#: transformers' default ``prompt_lookup_num_tokens`` in its docs and examples.
HF_PROMPT_LOOKUP_TOKENS = 10


def available(method: MethodSpec) -> bool:
    """Whether this installation can build ``method`` (its config overrides are valid)."""
    if method.kind != "engine":
        return True
    try:
        method_config(DecoderConfig(), method.config)
    except (ValueError, KeyError, TypeError):  # ConfigError, UnknownComponentError
        return False
    return True


def lookup_methods() -> tuple[MethodSpec, ...]:
    """The prompt-lookup baselines (those this installation can build)."""
    methods = (
        MethodSpec(
            "lookup-k3",
            {"planner": {"name": "lookup", "draft_length": 3}},
            description="fixed-length prompt lookup on our engine, k = 3",
        ),
        MethodSpec(
            "lookup-k10",
            {"planner": {"name": "lookup", "draft_length": 10}},
            description="fixed-length prompt lookup on our engine, k = 10",
        ),
        MethodSpec(
            HF_PROMPT_LOOKUP,
            kind="generate",
            generate_kwargs={"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS},
            description=(
                f"model.generate(prompt_lookup_num_tokens={HF_PROMPT_LOOKUP_TOKENS}): "
                "transformers' prompt lookup at its default length"
            ),
        ),
        MethodSpec(
            "knapspec-no-lookup",
            {"planner": {"name": "knapsack", "drafters": ["subnetwork"]}},
            description="KnapSpec with the lookup family left out of its search",
        ),
    )
    return tuple(method for method in methods if available(method))


def default_methods() -> tuple[MethodSpec, ...]:
    """``model.generate``, AR through our engine, the baselines, KnapSpec and the
    prompt-lookup baselines."""
    return (
        MethodSpec(GENERATE, kind="generate", description="model.generate, default settings"),
        MethodSpec(
            REFERENCE,
            {"planner": {"name": "autoregressive"}},
            description="plain decoding through the knapspec engine (the paired reference)",
        ),
        MethodSpec(
            "static",
            {
                "planner": {
                    "name": "knapsack",
                    "allow_no_speculation": False,
                    "search_gate": "always",
                }
            },
            freeze_plan=True,
            description="the knapsack planner's first plan on a set-up prompt, frozen",
        ),
        MethodSpec("swift", {"planner": {"name": "swift"}}, description="SWIFT-style Bayesian"),
        MethodSpec("clasp", {"planner": {"name": "clasp"}}, description="CLaSp layer-skip DP"),
        MethodSpec("del", {"planner": {"name": "del"}}, description="DEL dynamic early exit"),
        MethodSpec("knapspec", {"planner": {"name": "knapsack"}}, description="KnapSpec, defaults"),
        *lookup_methods(),
    )


def ablation_methods(profile_path: Path | None) -> tuple[MethodSpec, ...]:
    """KnapSpec with one design choice changed each (``knapspec`` is the other arm).

    Args:
        profile_path: latency profile for the fitted ("linear") cost model arm; that arm is
            left out when None.
    """
    knapsack = "knapsack"
    methods = [
        MethodSpec(
            "knapspec-tied",
            {"planner": {"name": knapsack, "decoupled": False}},
            description="attention and MLP of a layer tied into one item",
        ),
        MethodSpec(
            "knapspec-tpl",
            {"planner": {"name": knapsack, "objective": "tpl"}},
            description="DEL's tokens-per-layer objective instead of TPT",
        ),
        MethodSpec(
            "knapspec-plan-once",
            {
                "planner": {
                    "name": knapsack,
                    "context_growth": None,
                    "acceptance_drift": None,
                    "every_rounds": None,
                }
            },
            description="planned once per call, never re-planned",
        ),
        MethodSpec(
            "knapspec-cosine",
            {"proxy": {"name": "cosine"}},
            description="cosine proxy (top-1 agreement, Lemma 4.1 floor) instead of Monte-Carlo",
        ),
        MethodSpec(
            "knapspec-gate-off",
            {"planner": {"name": knapsack, "search_gate": "always"}},
            description="searches whenever the policy triggers, not only on copied output",
        ),
        MethodSpec(
            "knapspec-raw-alpha",
            {
                "planner": {
                    "name": knapsack,
                    "acceptance_pseudo_counts": 0.0,
                    "min_predicted_speedup": 1.0,
                }
            },
            description="raw α of the DP window, no small-sample prior, no 5 % margin",
        ),
        MethodSpec(
            "knapspec-no-fallback",
            {"planner": {"name": knapsack, "allow_no_speculation": False, "search_gate": "always"}},
            description="without the γ = 0 fallback (and without the search gate)",
        ),
    ]
    if profile_path is not None:
        methods.append(
            MethodSpec(
                "knapspec-linear",
                {"cost_model": {"name": "linear", "profile": str(profile_path)}},
                description="fitted linear cost model (fixed profile) instead of online",
            )
        )
    return tuple(methods)


def select_methods(
    available: Sequence[MethodSpec], names: Sequence[str] | None
) -> tuple[MethodSpec, ...]:
    """The methods named in ``names`` (all when None); the AR reference is always included.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    by_name = {method.name: method for method in available}
    if not names:
        chosen = list(available)
    else:
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(by_name)}")
        chosen = [by_name[name] for name in dict.fromkeys(names)]
    if all(method.name != REFERENCE for method in chosen):
        reference = by_name.get(REFERENCE) or next(
            m for m in default_methods() if m.name == REFERENCE
        )
        chosen.insert(0, reference)
    return tuple(chosen)


__all__ = [
    "GENERATE",
    "HF_PROMPT_LOOKUP",
    "HF_PROMPT_LOOKUP_TOKENS",
    "REFERENCE",
    "DecoderFactory",
    "MethodKind",
    "MethodSpec",
    "SupportsGenerate",
    "ablation_methods",
    "available",
    "default_methods",
    "forget_earlier_calls",
    "freeze_first_plan",
    "lookup_methods",
    "method_config",
    "select_methods",
]
