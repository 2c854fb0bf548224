"""What bounds an engine's first use on a 1-8B model: the probe runs fastest first and
stops at the first kernel that keeps the contract, a timing pass streams a big model's
first layers only, the whole-step checks, the cold-prefill timing and the quick latency
profile stop within their budgets. Exactness is untouched: whatever runs was probed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from knapspec.costmodels.profiler import profile_engine
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.table import ROWWISE_KERNEL, KernelTable
from knapspec.model.tuning import invariance
from knapspec.model.tuning.autotune import validate_table
from knapspec.model.tuning.checks import _check_order
from knapspec.model.tuning.prefill import PREFILL_BUDGET, timed_lengths
from knapspec.model.tuning.timing import STREAM_BYTES, LinearRole, linear_roles, streamed_subset
from knapspec.testing.models import tiny_model
from knapspec.testing.shapes import random_model


def _role(shape: tuple[int, int] = (8, 8)) -> LinearRole:
    return LinearRole("q", shape, ((torch.zeros(shape), None),))


def _fake_probe(
    monkeypatch: pytest.MonkeyPatch, scores: dict[str, float], broken: dict[str, int]
) -> list[str]:
    """Scores and verdicts by name (``broken``: the row count a kernel breaks at; a blocked
    name breaks like its base at its height or more); returns the names probed, in order."""
    probed: list[str] = []

    def first_violation(kernel: Any, weight: Any, bias: Any) -> int | None:
        name = names[kernel]
        probed.append(name)
        base, _, height = name.partition("/")
        if base not in broken:
            return None
        at = broken[base]
        return None if height and int(height) < at else at

    def score(kernel: Any, weight: Any, bias: Any) -> float:
        name = names[kernel]
        base, _, height = name.partition("/")
        return scores[base] + (0.5 if height else 0.0)  # blocks cost a little more

    names = {kernel: name for name, kernel in invariance.KERNELS.items()}
    monkeypatch.setattr(invariance, "first_violation", first_violation)
    monkeypatch.setattr(
        invariance, "is_row_invariant", lambda k, w, b: first_violation(k, w, b) is None
    )
    monkeypatch.setattr(invariance, "_score_seconds", score)
    return probed


def test_the_probe_stops_at_the_fastest_kernel_that_keeps_the_contract(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scores = {"f.linear": 3.0, "transposed": 1.0, "transposed-padded": 2.0, "onednn": 4.0}
    probed = _fake_probe(monkeypatch, scores, broken={"transposed": 2})
    candidates = ["f.linear", "transposed", "transposed-padded", "onednn"]
    chosen, failed, timed = invariance._choose(_role(), candidates)
    # The table's own choice first (the report says whether it keeps the contract), then
    # the fastest: it broke at 2 rows (no block below 2), then the next fastest passed.
    assert probed == ["f.linear", "transposed", "transposed-padded"]
    assert chosen == "transposed-padded" and failed == ("transposed",)
    assert set(timed) == set(candidates)
    assert chosen in probed  # what runs was probed


def test_a_failing_kernels_blocks_compete_on_their_own_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scores = {"f.linear": 3.0, "transposed": 1.0, "onednn": 4.0}
    probed = _fake_probe(monkeypatch, scores, broken={"transposed": 17})
    chosen, failed, timed = invariance._choose(_role(), ["f.linear", "transposed", "onednn"])
    assert chosen == "transposed/16" and failed == ("transposed",)
    assert timed["transposed/16"] == 1.5 and "onednn" not in probed


def test_where_nothing_keeps_the_contract_each_row_runs_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scores = {"f.linear": 1.0, "transposed": 2.0}
    _fake_probe(monkeypatch, scores, broken={"f.linear": 2, "transposed": 2})
    chosen, failed, _ = invariance._choose(_role(), ["f.linear", "transposed"])
    assert chosen == ROWWISE_KERNEL and set(failed) == {"f.linear", "transposed"}


def test_an_exact_engine_at_a_real_width_runs_only_probed_kernels() -> None:
    """End to end on Qwen3-0.6B's widths (one layer): every kernel the exact table runs
    passes the real probe here."""
    model = random_model("Qwen3-0.6B", layers=1, vocab=128, dtype=torch.bfloat16)
    engine = SublayerEngine(model, progress=False)
    assert engine.invariance is not None
    weights = {role.shape: role.tensors[0] for role in linear_roles(engine)[0]}
    for shape, name in engine.invariance.kernels.items():
        rows, cols = (int(n) for n in shape.split("x"))
        if (rows, cols) in weights and name != ROWWISE_KERNEL:
            weight, bias = weights[(rows, cols)]
            assert invariance.is_row_invariant(invariance.KERNELS[name], weight, bias), shape


def test_a_timing_pass_streams_a_big_models_first_layers_and_the_head() -> None:
    small = SublayerEngine(tiny_model("llama", num_layers=3), kernels="f.linear", exact=False)
    separate, fused = linear_roles(small)
    assert streamed_subset(separate, fused) == (separate, fused)  # small: every layer
    layer_bytes = sum(r.tensors[0][0].numel() * 4 for r in separate if r.name != "lm_head")
    cut, _ = streamed_subset(separate, fused, min_bytes=layer_bytes + 1)
    assert {r.name: len(r.tensors) for r in cut} == {
        **{r.name: 2 for r in separate if r.name != "lm_head"},
        "lm_head": 1,
    }
    assert STREAM_BYTES >= 256 * 2**20  # far beyond any CPU cache


def test_the_whole_step_checks_go_by_use_and_stop_at_the_budget() -> None:
    assert _check_order(range(1, 12)) == [1, 2, 4, 8, 11, 3, 5, 6, 7, 9, 10]
    engine = SublayerEngine(tiny_model("llama"), kernels="f.linear", exact=False)
    shapes = sorted({role.shape for role in linear_roles(engine)[0]})
    candidates = {"measured": KernelTable.uniform(shapes, "transposed", fuse=False)}
    _, every = validate_table(engine, candidates, range(1, 6), repeats=1, budget_seconds=None)
    _, first = validate_table(engine, candidates, range(1, 6), repeats=1, budget_seconds=0.0)
    assert [c.rows for c in every] == [1, 2, 4, 5, 3] and [c.rows for c in first] == [1]


def test_long_prefills_are_timed_on_small_models_only() -> None:
    engine = SublayerEngine(tiny_model("llama"), kernels="f.linear", exact=False)
    assert timed_lengths(engine, (2048, 64, 512)) == [64]  # tiny: the context is 256
    assert timed_lengths(engine, (64, 128, 200), budget=0) == [64]  # the shortest always
    elements = sum(w.numel() for r in linear_roles(engine)[0] for w, _ in r.tensors)
    assert timed_lengths(engine, (64, 128, 200), budget=elements * 128) == [64, 128]
    assert 0.7e9 * 2048 <= PREFILL_BUDGET < 1e9 * 2048  # 2,048 tokens up to 0.75B


def test_a_quick_profile_keeps_to_its_budget() -> None:
    engine = SublayerEngine(tiny_model("llama"), kernels="f.linear", exact=False)
    full = profile_engine(engine, quick=True, max_tokens=2, progress=False, budget_seconds=1e9)
    tight = profile_engine(engine, quick=True, max_tokens=2, progress=False, budget_seconds=0.0)
    assert full.repeats == 3 and tight.repeats == 1
    assert {(v.tokens, v.context_length) for v in tight.verify} == {
        (v.tokens, v.context_length) for v in full.verify
    }
