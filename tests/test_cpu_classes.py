"""What each CPU class we measure on decides, checked on whatever CPU runs the suite: a
claim of its flags (``$KNAPSPEC_CPU_FLAGS``, as ``nox -s amx / zen4 / avx2`` set it) must
make the dtype choice, the bf16 product kernels offered and chosen, and the bf16 attention
path those of that class, as far as this CPU has the units (a claim never adds any)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import row_attention, row_linear
from knapspec.model.kernels.table import AMX_KERNEL, PACKED_KERNEL
from knapspec.model.loading.dtypes import choose_dtype
from knapspec.model.machine import CPU_CLASSES, CPU_FLAGS_ENV
from knapspec.testing.models import tiny_model

NOXFILE = Path(__file__).resolve().parents[1] / "noxfile.py"


def _native() -> dict[str, bool]:
    """The units this CPU (its OS, the compiled kernels) offers, asked without a claim."""
    library = row_linear.LIBRARY.load()
    attention = row_attention.load_library()
    return {
        "amx": library is not None and bool(library.knapspec_amx_available()),
        "packed": library is not None and bool(library.knapspec_packed_available()),
        "tiles": attention is not None and attention.knapspec_attention_amx_available() == 1,
        "dpbf16": attention is not None and attention.knapspec_attention_dpbf16_available() == 1,
    }


@pytest.fixture
def claim(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # type: ignore[no-untyped-def]
    """Claim a class's flags for one test: the per-process decisions are asked again."""

    def claim_flags(flags: str) -> None:
        monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
        monkeypatch.setenv(CPU_FLAGS_ENV, flags)
        monkeypatch.delenv("KNAPSPEC_ATTENTION_UNIT", raising=False)
        monkeypatch.delenv("KNAPSPEC_AMX_ATTENTION", raising=False)
        monkeypatch.setattr(row_linear, "_packed_here", None)
        monkeypatch.setattr(row_attention, "_bf16_unit", None)

    monkeypatch.delenv(CPU_FLAGS_ENV, raising=False)
    native = _native()
    yield claim_flags, native
    monkeypatch.setattr(row_linear, "_packed_here", None)  # the claim's answer, dropped
    monkeypatch.setattr(row_attention, "_bf16_unit", None)


@pytest.mark.parametrize("cpu", sorted(CPU_CLASSES))
def test_each_cpu_class_decides_as_it_would(cpu: str, claim) -> None:  # type: ignore[no-untyped-def]
    claim_flags, native = claim
    flags = set(CPU_CLASSES[cpu].split())
    claim_flags(CPU_CLASSES[cpu])
    has_amx = {"amx_tile", "amx_bf16"} <= flags
    has_bf16 = "avx512_bf16" in flags

    # The dtype: float32 with its reason where the class has no bf16 units, else measured.
    choice = choose_dtype("auto", None)
    if has_amx or has_bf16:
        assert choice.reason == "auto: no model to measure"
    else:
        assert choice.dtype == torch.float32 and "no bf16 units" in choice.reason

    # The bf16 products offered: the class's units, where this CPU has them too.
    assert row_linear.amx_available() == (has_amx and native["amx"])
    assert row_linear.packed_available() == (has_bf16 and native["packed"])

    # The bf16 attention path: the fastest unit both have.
    expected = (
        "amx-tiles"
        if has_amx and native["tiles"]
        else "avx512-bf16"
        if has_bf16 and native["dpbf16"]
        else "vector"
    )
    assert row_attention.attention_path(torch.bfloat16, 64) == expected

    # The kernel table an exact bf16 engine measures uses no unit the class lacks.
    engine = SublayerEngine(tiny_model("llama").to(torch.bfloat16), progress=False)
    chosen = {name for names in engine.kernels.choices.values() for name in names}
    chosen |= set(engine.kernels.large.values())
    if not (has_amx and native["amx"]):
        assert AMX_KERNEL not in chosen
    if not (has_bf16 and native["packed"]):
        assert PACKED_KERNEL not in chosen
    assert engine.exact_attention_path == expected


def test_the_noxfile_claims_the_same_classes() -> None:
    """``nox -s amx / zen4 / avx2`` claim the flags :data:`CPU_CLASSES` lists."""
    text = NOXFILE.read_text()
    for name, cpu in (
        ("AMX_FLAGS", "xeon-amx"),
        ("ZEN4_FLAGS", "zen4"),
        ("AVX2_FLAGS", "zen3-avx2"),
    ):
        found = re.search(rf'^{name} = "([^"]*)"', text, re.MULTILINE)
        assert found is not None, name
        assert found.group(1) == CPU_CLASSES[cpu]
