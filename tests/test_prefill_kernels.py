"""A cold prefill's many-row kernels: the faster of the measured and the row-invariant ones,
timed per prompt length (:mod:`knapspec.model.tuning.prefill`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knapspec.model.cachefiles import CacheWarning
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.table import KERNELS, PLAIN_KERNEL, Kernel, KernelTable, Shape
from knapspec.model.tuning.prefill import (
    CANDIDATES,
    RowSwitch,
    describe,
    prefill_dispatch,
    switch_rows,
    time_prefills,
)
from knapspec.paths import cache_root
from knapspec.testing.models import tiny_model

MEASURED, INVARIANT = CANDIDATES
LENGTHS = (64, 256, 1024)


def _timings(pairs: list[tuple[float, float]]) -> dict[tuple[str, int], float]:
    timings = {}
    for length, (measured, invariant) in zip(LENGTHS, pairs, strict=True):
        timings[(MEASURED, length)] = measured
        timings[(INVARIANT, length)] = invariant
    return timings


seconds = st.floats(min_value=0.01, max_value=1.0)


@given(st.lists(st.tuples(seconds, seconds), min_size=3, max_size=3))
def test_the_switch_is_the_longest_length_below_which_the_invariant_kernels_always_won(
    pairs: list[tuple[float, float]],
) -> None:
    timings = _timings(pairs)
    margin = 0.03
    won = [invariant < (1 - margin) * measured for measured, invariant in pairs]
    # Oracle: every threshold, checked against the definition.
    if all(won):
        expected = None
    else:
        expected = max([0, *(n for i, n in enumerate(LENGTHS) if all(won[: i + 1]))])
    assert switch_rows(timings, LENGTHS, margin=margin) == expected


def test_a_row_switch_runs_the_small_kernel_up_to_its_rows_and_the_large_beyond() -> None:
    seen: list[str] = []

    def named(name: str) -> Kernel:
        def kernel(
            x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
        ) -> torch.Tensor:
            seen.append(name)
            return torch.nn.functional.linear(x, weight, bias)

        return kernel

    switch = RowSwitch(named("small"), named("large"), up_to_rows=64)
    weight = torch.randn(8, 4)
    for rows in (17, 64, 65, 300):
        out = switch(torch.randn(1, rows, 4), weight, None)
        assert out.shape == (1, rows, 8)
    assert seen == ["small", "small", "large", "large"]


def test_time_prefills_interleaves_the_candidates_and_keeps_each_ones_best() -> None:
    calls: list[tuple[str, int]] = []
    clock = iter([9.0, 9.0, 3.0, 2.0, 5.0, 1.5, 4.0, 2.5, 6.0, 2.0])

    def timer(dispatch: dict[tuple[int, ...], Kernel], length: int) -> float:
        calls.append((MEASURED if dispatch.get((1, 1)) else INVARIANT, length))
        return next(clock)

    candidates = {MEASURED: {(1, 1): KERNELS[PLAIN_KERNEL]}, INVARIANT: {}}
    timings = time_prefills(candidates, [20, 10], timer, repeats=2)
    assert calls[:2] == [(MEASURED, 10), (INVARIANT, 10)]  # the warm-up, not scored
    assert (
        calls[2:] == [(MEASURED, 10), (INVARIANT, 10)] * 2 + [(MEASURED, 20), (INVARIANT, 20)] * 2
    )
    assert timings == {
        (MEASURED, 10): 3.0,
        (INVARIANT, 10): 1.5,
        (MEASURED, 20): 4.0,
        (INVARIANT, 20): 2.0,
    }


def test_longer_prompts_are_not_timed_once_the_row_invariant_kernels_lost() -> None:
    calls: list[int] = []

    def timer(dispatch: dict[tuple[int, ...], Kernel], length: int) -> float:
        calls.append(length)
        return 1.0 if dispatch else 2.0  # the row-invariant candidate ({} here) is slower

    candidates = {MEASURED: {(1, 1): KERNELS[PLAIN_KERNEL]}, INVARIANT: {}}
    timings = time_prefills(candidates, [64, 512, 2048], timer, repeats=2)
    assert set(calls) == {64}
    assert switch_rows(timings, [64, 512, 2048]) == 0


@pytest.fixture
def engine() -> SublayerEngine:
    return SublayerEngine(tiny_model("llama"), exact=False)


def _linear_shapes(engine: SublayerEngine) -> list[Shape]:
    shapes = {tuple(engine.lm_head.weight.shape)}
    for layer in engine.layers:
        for module in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(module, torch.nn.Linear):
                shapes.add(tuple(module.weight.shape))
    return sorted(shapes)  # type: ignore[arg-type]


def _exact_table(engine: SublayerEngine) -> KernelTable:
    shapes = _linear_shapes(engine)
    return KernelTable.uniform(shapes, "rowwise", fuse=False).with_large(
        dict.fromkeys(shapes, "rowwise")
    )


@pytest.mark.parametrize(
    ("invariant_seconds", "expected"),
    [
        ((0.5, 0.5, 0.5), "invariant"),  # faster at every length: always
        ((2.0, 2.0, 2.0), "measured"),  # slower at the shortest: never
        ((0.5, 2.0, 2.0), "switch"),  # faster for short prompts only
    ],
)
def test_the_dispatch_follows_the_timings(
    engine: SublayerEngine,
    invariant_seconds: tuple[float, float, float],
    expected: str,
) -> None:
    exact = _exact_table(engine)
    lengths = (16, 32, 64)
    by_length = dict(zip(lengths, invariant_seconds, strict=True))

    def timer(dispatch: dict[Shape, Kernel], length: int) -> float:
        return by_length[length] if dispatch else 1.0  # the measured candidate: {}

    dispatch = prefill_dispatch(
        engine, KernelTable.plain(), exact, timer, lengths=lengths, use_cache=False
    )
    shapes = set(_linear_shapes(engine))
    if expected == "invariant":
        assert dispatch == dict.fromkeys(shapes, KERNELS["rowwise"])
    elif expected == "measured":
        assert dispatch == {}
    else:
        assert set(dispatch) == shapes
        for kernel in dispatch.values():
            assert isinstance(kernel, RowSwitch)
            assert kernel.small is KERNELS["rowwise"]
            assert kernel.large is KERNELS[PLAIN_KERNEL]
            assert kernel.up_to_rows == lengths[0]
        assert "rowwise up to 16 rows, then f.linear" in describe(dispatch).values()


def test_equal_tables_are_not_timed(engine: SublayerEngine) -> None:
    def timer(dispatch: dict[Shape, Kernel], length: int) -> float:
        raise AssertionError("nothing to choose between; nothing should be timed")

    exact = _exact_table(engine)
    assert prefill_dispatch(engine, exact, exact, timer) == exact.large_dispatch()


def test_the_timings_are_cached_and_a_bad_cache_file_is_measured_again(
    engine: SublayerEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    exact = _exact_table(engine)
    calls: list[int] = []

    def timer(dispatch: dict[Shape, Kernel], length: int) -> float:
        calls.append(length)
        return 0.5 if dispatch else 1.0

    first = prefill_dispatch(engine, KernelTable.plain(), exact, timer)
    assert calls and first == exact.large_dispatch()
    calls.clear()
    assert prefill_dispatch(engine, KernelTable.plain(), exact, timer) == first
    assert calls == []  # read from the cache
    (cached,) = (cache_root() / "prefill").glob("*.json")
    cached.write_text("{not json")
    with pytest.warns(CacheWarning, match="unreadable"):
        assert prefill_dispatch(engine, KernelTable.plain(), exact, timer) == first
    assert calls  # measured again


def test_an_exact_engine_prefills_through_the_chosen_kernels_and_keeps_its_answers() -> None:
    """The engine's own timer runs real cold prefills; whatever it chose, a prefill is the
    same for plain and speculative decoding, and verifications keep the row-invariant
    kernels."""
    model = tiny_model("llama").to(torch.bfloat16)
    engine = SublayerEngine(model)
    own = engine._prefill_large
    seconds = engine._time_cold_prefill(own, 40)
    assert seconds > 0
    assert engine._prefill_large is own  # the timer leaves the engine as it was
    tokens = torch.randint(0, engine.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    first = engine.forward(tokens, 0, engine.new_cache(64), all_logits=False).logits
    again = engine.forward(tokens, 0, engine.new_cache(64), all_logits=False).logits
    assert torch.equal(first, again)
