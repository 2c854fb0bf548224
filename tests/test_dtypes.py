"""``--dtype`` / :func:`choose_dtype`: what ``auto`` means, measured only where it can pay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from knapspec.model.engine import SublayerEngine
from knapspec.model.loading import dtypes
from knapspec.model.loading.dtypes import bf16_units, choose_dtype, parse_dtype
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


# ------------------------------------------- a CPU that reports bf16 units (claimed here)
AMX_FLAGS = "avx2 avx512f avx512_bf16 amx_tile amx_bf16"


def test_the_probe_context_fits_the_model() -> None:
    assert dtypes.probe_context(8192) == dtypes.PROBE_CONTEXT
    assert dtypes.probe_context(256) == 256 - dtypes.PROBE_VERIFY - 1
    assert dtypes.probe_context(dtypes.MIN_PROBE_CONTEXT + dtypes.PROBE_VERIFY + 1) == 16
    assert dtypes.probe_context(dtypes.MIN_PROBE_CONTEXT + dtypes.PROBE_VERIFY) is None


def test_claimed_cpu_flags_take_the_bf16_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KNAPSPEC_CPU_FLAGS", AMX_FLAGS)
    assert bf16_units() == ("amx_bf16", "avx512_bf16")
    monkeypatch.setenv("KNAPSPEC_CPU_FLAGS", "avx2,fma")
    assert bf16_units() == ()


def test_auto_times_a_short_context_model_within_its_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (AMX Xeon): ``auto`` timed a 512-token context on a 256-token model and
    the load failed with an error blaming the user's prompt."""
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("KNAPSPEC_CPU_FLAGS", AMX_FLAGS)
    model = tiny_model("llama")
    assert model.config.max_position_embeddings == 256
    choice = choose_dtype("auto", model)  # real timing, real engines
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert "after a 244-token context" in choice.reason, choice.reason


def test_auto_falls_back_to_float32_when_the_context_is_too_short_to_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    model = tiny_model("llama")
    model.config.max_position_embeddings = 20
    with caplog.at_level("INFO", logger="knapspec.model.loading.dtypes"):
        choice = choose_dtype("auto", model, flags=AMX_FLAGS)
    assert choice.dtype == torch.float32
    assert "context (20 tokens) is too short" in choice.reason
    assert choice.reason in caplog.text


def test_auto_falls_back_to_float32_when_an_engine_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))

    def broken(model: torch.nn.Module) -> SublayerEngine:
        raise RuntimeError("no kernel for this dtype here")

    choice = choose_dtype("auto", tiny_model("llama"), flags=AMX_FLAGS, engine_factory=broken)
    assert choice.dtype == torch.float32
    assert "could not time the two dtypes (no kernel for this dtype here)" in choice.reason
