"""``--dtype`` / :func:`choose_dtype`: what ``auto`` means, measured only where it can pay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from knapspec.model import dtypes
from knapspec.model.dtypes import bf16_units, choose_dtype, parse_dtype
from knapspec.model.engine import SublayerEngine
from knapspec.testing.models import tiny_model


def test_explicit_dtypes_are_taken_as_asked() -> None:
    assert choose_dtype("bfloat16").dtype == torch.bfloat16
    assert choose_dtype("float32").dtype == torch.float32


def test_an_unknown_dtype_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="auto, float32, bfloat16"):
        parse_dtype("float16")


def test_auto_keeps_float32_without_bf16_units_and_measures_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_timing(*args: object, **kwargs: object) -> tuple[float, float]:
        raise AssertionError("nothing to measure without bf16 units")

    monkeypatch.setattr(dtypes, "_step_seconds", no_timing)
    choice = choose_dtype("auto", tiny_model("llama"), flags="fpu sse avx2 fma")
    assert choice.dtype == torch.float32
    assert "no bf16 units" in choice.reason


def test_bf16_units_are_read_from_the_flags() -> None:
    assert bf16_units("avx2 avx512f avx512_bf16 amx_tile amx_bf16") == ("amx_bf16", "avx512_bf16")
    assert bf16_units("avx2 fma") == ()


@pytest.mark.parametrize("bf16_faster", [True, False])
def test_auto_measures_both_where_the_cpu_has_bf16_units_and_caches_the_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bf16_faster: bool
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    timed: list[torch.dtype] = []

    def timing(engine: SublayerEngine, **kwargs: object) -> tuple[float, float]:
        timed.append(engine.dtype)
        slow = engine.dtype == (torch.float32 if bf16_faster else torch.bfloat16)
        return (2.0, 3.0) if slow else (1.0, 1.5)

    monkeypatch.setattr(dtypes, "_step_seconds", timing)
    model = tiny_model("llama")
    choice = choose_dtype("auto", model, flags="avx512_bf16")
    assert timed == [torch.float32, torch.bfloat16]
    assert choice.dtype == (torch.bfloat16 if bf16_faster else torch.float32)
    assert "measured" in choice.reason
    again = choose_dtype("auto", model, flags="avx512_bf16")  # the cache, no timing
    assert again == choice and len(timed) == 2


def test_the_step_timer_runs_a_real_engine() -> None:
    step, verify = dtypes._step_seconds(SublayerEngine(tiny_model("llama")), context=16)
    assert step > 0 and verify > 0
