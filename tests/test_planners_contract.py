"""The planner contract, checked for every registered planner (one suite, parametrized).

Every built-in component module is imported first (``load_builtin_components``), so a
planner added later is picked up here without editing this file. Each planner is built
the way the registry builds it, ``cls.from_config(cls.config_class(), engine)``, and run
on a tiny random Llama whose reference window comes from a real engine forward with
``capture_points=True``.

The contract:

* ``plan`` returns a :class:`DraftPlan` whose mask has ``2L`` items and whose γ is in
  ``[0, max_draft_length]``, with or without a reference window (the first round has none);
* planning never writes the KV cache (every buffer and length is bitwise unchanged);
* two fresh instances fed the same rounds propose the same plans, whatever the global
  torch / numpy RNG state (a planner's randomness comes from its config's seed);
* ``update(StepOutcome(...))`` and ``reset()`` are accepted, and plans stay valid after.

The builders below (on :mod:`knapspec.testing`'s tiny engine, planning context and
cost-model double) are reused by ``test_baselines.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from knapspec.config import load_builtin_components
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.proxies.cosine import CosineProxy
from knapspec.testing import check_registration, planning_context, random_tokens, tiny_engine
from knapspec.types import DraftPlan, StepOutcome

load_builtin_components()

PLANNER_NAMES = PLANNERS.names()

#: Eight layers: the default configs of every built-in (e.g. early exit at layer 8) apply.
NUM_LAYERS = 8
VOCAB = 96
TOKEN_STREAM_SEED = 1234


# ------------------------------------------------------------------------------ builders
def tiny_llama_engine(num_layers: int = NUM_LAYERS, seed: int = 0) -> SublayerEngine:
    """A random Llama (hidden 32, vocab 96, 4 query / 2 KV heads) in the sublayer engine."""
    return tiny_engine(num_layers, seed=seed)


def token_stream(length: int, seed: int = TOKEN_STREAM_SEED) -> torch.Tensor:
    """``(length,)`` random token ids; prefixes of one stream share their tokens."""
    return random_tokens(VOCAB, length, seed)


def build_context(engine: SublayerEngine, **settings: Any) -> PlanningContext:
    """:func:`knapspec.testing.planning_context` over the token stream, with the library's
    cosine proxy (``settings``: its keyword arguments)."""
    proxy = CosineProxy.from_config(CosineProxy.config_class(), engine)
    return planning_context(engine, proxy=proxy, seed=TOKEN_STREAM_SEED, **settings)


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
@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
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
    check_registration(PLANNERS, name, Planner, engine)


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
