"""The planner contract, checked for every registered planner (one suite, parametrized).

Every module of ``knapspec.planners`` is imported first, so a planner added later is
picked up here without editing this file. Each planner is built the way the registry
builds it, ``cls.from_config(cls.config_class(), engine)``, and run on a tiny random Llama
whose reference window comes from a real engine forward with ``capture_points=True``.

The contract:

* ``plan`` returns a :class:`DraftPlan` whose mask has ``2L`` items and whose γ is in
  ``[0, max_draft_length]``, with or without a reference window (the first round has none);
* planning never writes the KV cache (every buffer and length is bitwise unchanged);
* two fresh instances fed the same rounds propose the same plans, whatever the global
  torch / numpy RNG state (a planner's randomness comes from its config's seed);
* ``update(StepOutcome(...))`` and ``reset()`` are accepted, and plans stay valid after.

The builders below (tiny engine, context, cost-model double) are reused by
``test_baselines.py``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import knapspec.planners
from knapspec.costmodels.base import CostModel
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.proxies.base import AcceptanceEstimate, ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.types import DraftPlan, StepOutcome
from knapspec.window import ReferenceWindow

for _module in pkgutil.iter_modules(knapspec.planners.__path__):
    importlib.import_module(f"{knapspec.planners.__name__}.{_module.name}")

PLANNER_NAMES = PLANNERS.names()

#: Eight layers: the default configs of every built-in (e.g. early exit at layer 8) apply.
NUM_LAYERS = 8
VOCAB = 96
TOKEN_STREAM_SEED = 1234


# ------------------------------------------------------------------------------ builders
def tiny_llama_engine(num_layers: int = NUM_LAYERS, seed: int = 0) -> SublayerEngine:
    """A random Llama (hidden 32, 4 query / 2 KV heads) wrapped in the sublayer engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    return SublayerEngine(model)


def token_stream(length: int, seed: int = TOKEN_STREAM_SEED) -> torch.Tensor:
    """``(length,)`` random token ids; prefixes of one stream share their tokens."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator)


def filled_cache(
    engine: SublayerEngine, token_ids: torch.Tensor, window_size: int
) -> tuple[KVCache, ReferenceWindow]:
    """A cache holding ``token_ids`` (full model) and the window of its last tokens."""
    cache = engine.new_cache(token_ids.numel() + 8)
    out = engine.forward(token_ids, 0, cache, capture_points=True, capture_last=window_size)
    assert out.points is not None
    length = token_ids.numel()
    window = ReferenceWindow(
        points=out.points,
        token_ids=token_ids[-window_size:],
        target_tokens=out.logits[-window_size:].argmax(dim=-1),
        start=length - window_size,
    )
    return cache, window


@attrs.frozen
class AnalyticCostModelConfig:
    """The test double has no hyper-parameters."""


class AnalyticCostModel(CostModel):
    """Closed-form latencies shaped like the CPU measurements in models.md (seconds)."""

    config_class = AnalyticCostModelConfig

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return 4.0e-4 + 2.5e-7 * context_length

    def t_mlp(self, layer: int | None = None) -> float:
        return 4.8e-4

    def overhead(self, context_length: int) -> float:
        return 6.0e-3

    def verify_cost(self, tokens: int, context_length: int) -> float:
        one = self.num_layers * (self.t_attn(context_length) + self.t_mlp())
        return self.overhead(context_length) + one * (1.0 + 0.1 * (tokens - 1))


@attrs.frozen
class TopOneProxyConfig:
    """The fallback proxy has no hyper-parameters."""


class TopOneProxy(ValueProxy):
    """Fallback proxy: mean cosine as the value, teacher-forced top-1 agreement as α."""

    config_class = TopOneProxyConfig

    def score(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(candidate, reference.unsqueeze(0), dim=-1).mean(dim=-1)

    def estimate_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> list[AcceptanceEstimate]:
        with torch.inference_mode():
            agree = engine.logits(candidate_final).argmax(-1) == window.target_tokens
        rates = agree.float().mean(dim=1).tolist()
        return [AcceptanceEstimate(a, a, a, window.size) for a in rates]


def make_proxy(engine: SublayerEngine) -> ValueProxy:
    """The library's cosine proxy when it exists, else the test-local fallback."""
    try:
        from knapspec.proxies.cosine import CosineProxy
    except ImportError:
        return TopOneProxy()
    proxy: ValueProxy = CosineProxy.from_config(CosineProxy.config_class(), engine)
    return proxy


def build_context(
    engine: SublayerEngine,
    *,
    context_length: int = 40,
    window_size: int = 12,
    with_window: bool = True,
    max_draft_length: int = 10,
    round_index: int = 0,
) -> PlanningContext:
    """A planning context over a cache holding the first ``context_length`` stream tokens."""
    cache, window = filled_cache(engine, token_stream(context_length), window_size)
    return PlanningContext(
        engine=engine,
        cache=cache,
        context_length=context_length,
        window=window if with_window else None,
        cost_model=AnalyticCostModel(engine.num_layers),
        proxy=make_proxy(engine),
        max_draft_length=max_draft_length,
        sampling=SamplingParams(),
        round_index=round_index,
    )


def build_planner(name: str, engine: SublayerEngine) -> Planner:
    """``cls.from_config(cls.config_class(), engine)``: the registry's construction path."""
    cls = PLANNERS.get(name)
    return cls.from_config(cls.config_class(), engine)


def outcome_for(plan: DraftPlan, context_length: int) -> StepOutcome:
    """A plausible round result for ``plan``: half its drafts accepted."""
    return StepOutcome(
        plan=plan,
        context_length=context_length,
        drafted=plan.draft_length,
        accepted=plan.draft_length // 2,
        draft_time_s=1e-3 * plan.draft_length,
        verify_time_s=2e-2,
    )


def assert_valid_plan(plan: object, engine: SublayerEngine, max_draft_length: int) -> None:
    assert isinstance(plan, DraftPlan), f"plan() returned {type(plan).__name__}"
    assert plan.mask.num_items == engine.num_items
    assert 0 <= plan.draft_length <= max_draft_length


def cache_snapshot(cache: KVCache) -> tuple[list[int], int, list[torch.Tensor]]:
    """Lengths, capacity and every K/V buffer *bitwise* (whole capacity, NaN-safe)."""
    buffers = []
    for layer in range(cache.num_layers):
        for tensor in (cache.keys(layer, cache.capacity), cache.values(layer, cache.capacity)):
            buffers.append(tensor.contiguous().view(torch.uint8).clone())
    return list(cache.lengths), cache.capacity, buffers


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny matrices: one thread avoids spin contention on the shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(single_thread: None) -> SublayerEngine:
    return tiny_llama_engine()


@pytest.fixture(scope="module")
def rounds(engine: SublayerEngine) -> list[PlanningContext]:
    """Three successive rounds of one generation: the context grows, the window slides."""
    return [
        build_context(engine, context_length=n, window_size=w, round_index=i)
        for i, (n, w) in enumerate([(32, 10), (35, 12), (39, 13)])
    ]


@pytest.fixture(params=PLANNER_NAMES)
def name(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


# --------------------------------------------------------------------------------- tests
def test_the_suite_sees_every_builtin() -> None:
    for expected in ("static", "early-exit", "autoregressive", "swift", "clasp", "del"):
        assert expected in PLANNER_NAMES


def test_registration_contract(name: str, engine: SublayerEngine) -> None:
    cls = PLANNERS.get(name)
    assert issubclass(cls, Planner)
    assert cls.registered_name == name
    config = cls.config_class()
    assert attrs.has(type(config)), f"{name}.config_class is not an attrs class"
    fields = attrs.fields(type(config))
    if fields:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(config, fields[0].name, getattr(config, fields[0].name))
    assert isinstance(cls.from_config(config, engine), cls)


@pytest.mark.parametrize("max_draft_length", [1, 4, 10])
def test_plan_is_valid(name: str, engine: SublayerEngine, max_draft_length: int) -> None:
    context = attrs.evolve(build_context(engine), max_draft_length=max_draft_length)
    planner = build_planner(name, engine)
    assert_valid_plan(planner.plan(context), engine, max_draft_length)


def test_first_round_without_window(name: str, engine: SublayerEngine) -> None:
    context = build_context(engine, with_window=False)
    planner = build_planner(name, engine)
    assert_valid_plan(planner.plan(context), engine, context.max_draft_length)


def test_plan_does_not_touch_the_cache(name: str, engine: SublayerEngine) -> None:
    context = build_context(engine)
    planner = build_planner(name, engine)
    before = cache_snapshot(context.cache)
    for _ in range(3):
        planner.plan(context)
    after = cache_snapshot(context.cache)
    assert after[0] == before[0], "cache lengths changed"
    assert after[1] == before[1], "cache capacity changed"
    for index, (old, new) in enumerate(zip(before[2], after[2], strict=True)):
        layer, kind = divmod(index, 2)
        assert torch.equal(old, new), f"layer {layer} {('keys', 'values')[kind]} were written"


def _run_rounds(planner: Planner, contexts: list[PlanningContext]) -> list[tuple[Any, int]]:
    proposals = []
    for context in contexts:
        plan = planner.plan(context)
        proposals.append((plan.mask, plan.draft_length))
        planner.update(outcome_for(plan, context.context_length))
    return proposals


def test_deterministic_under_its_seed(
    name: str, engine: SublayerEngine, rounds: list[PlanningContext]
) -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    first = _run_rounds(build_planner(name, engine), rounds)
    # A different global RNG state must not matter: randomness belongs to the config seed.
    torch.manual_seed(2)
    np.random.seed(2)
    second = _run_rounds(build_planner(name, engine), rounds)
    assert first == second


def test_update_and_reset(name: str, engine: SublayerEngine, rounds: list[PlanningContext]) -> None:
    planner = build_planner(name, engine)
    for context in rounds:
        plan = planner.plan(context)
        assert_valid_plan(plan, engine, context.max_draft_length)
        planner.update(outcome_for(plan, context.context_length))
    planner.reset()
    no_window = attrs.evolve(rounds[0], window=None)
    assert_valid_plan(planner.plan(no_window), engine, no_window.max_draft_length)
    assert_valid_plan(planner.plan(rounds[-1]), engine, rounds[-1].max_draft_length)
