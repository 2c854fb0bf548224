"""``benchmarks/scale.py`` at a tiny shape: every record's fields, the first-use stages on
an empty cache, and the token comparison (a decoder that leaves ``generate``'s tokens is
reported, not hidden)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from benchmarks.scale import (
    _first_mismatch,
    compare_generate,
    run_shape,
    stream_bandwidth,
)

from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.planners import AutoregressivePlanner
from knapspec.testing.shapes import SHAPES, random_model

#: Qwen3-0.6B's layout (q/k norms, tied head) at widths a test runs in seconds.
TINY = attrs.evolve(
    SHAPES["Qwen3-0.6B"],
    name="test/tiny-qwen3",
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    head_dim=16,
    layers=2,
    vocab=256,
)


def test_the_bandwidth_is_measured() -> None:
    bandwidth = stream_bandwidth(mib=8, repeats=2)
    assert bandwidth["triad_gbps"] > 0 and bandwidth["copy_gbps"] > 0


def test_the_first_mismatch_is_found() -> None:
    a = torch.tensor([1, 2, 3, 4])
    assert _first_mismatch(a, a.clone()) is None
    assert _first_mismatch(a, torch.tensor([1, 2, 9, 4])) == 2
    assert _first_mismatch(a, a[:3]) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_tiny_run_writes_every_record(dtype: torch.dtype) -> None:
    lines = run_shape(
        TINY,
        dtype,
        bandwidth={"triad_gbps": 10.0, "copy_gbps": 10.0},
        prompt_tokens=24,
        new_tokens=6,
        pairs=2,
        prefill_lengths=(32, 64),
        widths=(1, 4, 16),
        repeats=1,
        threads=1,
    )
    kinds = [line["kind"] for line in lines]
    assert kinds == ["first-use", "steps", "generate", "generate", "memory"]
    for line in lines:
        assert line["shape"] == "test/tiny-qwen3" and line["dtype"] == str(dtype)[6:]
        assert line["layers"] == 2 and line["vocab"] == 256
        for field in ("host_cpu", "cpu_flags", "torch", "commit", "kernel_table", "floor_ms"):
            assert field in line, field
        assert line["weight_bytes"] == TINY.parameters() * dtype.itemsize
        assert line["floor_ms"] == pytest.approx(line["weight_bytes"] / 1e10 * 1e3, rel=1e-3)
    first, steps, *runs, memory = lines
    for stage in ("invariance_probe_s", "prefill_timing_s", "kernel_table_s", "profile_s"):
        assert first[stage] >= 0, stage
    assert first["first_use_s"] >= first["engine_first_use_s"] > 0
    assert set(steps["step_ms"]) == {"1", "4", "16"} and steps["v"]["1"] == 1.0
    assert set(steps["prefill_ms"]) == {"32", "64"}
    for run in runs:
        assert run["tokens_equal"] and run["methods_agree"], run["first_mismatch_vs_generate"]
        assert run["new_tokens"] == {"generate": 6, "plain": 6, "default": 6}
        assert set(run["speedup_vs_generate"]) == {"plain", "default"}
    assert memory["rss_bytes"] > memory["weight_bytes"]
    assert memory["rss_over_weights_kv"] > 0 and memory["rss_before_model_bytes"] > 0


class _OffByOne(SpeculativeDecoder):
    """A broken decoder: its last token is another one."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        result = super().generate(*args, **kwargs)
        tokens = result.tokens.clone()
        tokens[-1] = (tokens[-1] + 1) % self.engine.vocab_size
        return attrs.evolve(result, tokens=tokens)


def test_a_decoder_that_leaves_generate_is_reported() -> None:
    model = random_model(TINY, dtype=torch.float32)
    engine = SublayerEngine(model)
    decoders = {
        "plain": SpeculativeDecoder(engine, planner=AutoregressivePlanner()),
        "broken": _OffByOne(engine, planner=AutoregressivePlanner()),
    }
    (line,) = compare_generate(model, decoders, prompt_tokens=16, new_tokens=5, pairs=1)
    assert line["first_mismatch_vs_generate"] == {"plain": None, "broken": 4}
    assert line["tokens_equal"] is False and line["methods_agree"] is False
