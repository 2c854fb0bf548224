"""The compiled layer operations (:mod:`knapspec.model.kernels.layer_ops`): rotary and the K/V copy
bitwise PyTorch's, RMSNorm within an ulp of the model's and row-invariant, each refusing a
layout or a module it does not compute; an exact engine uses them on every path, keeps the
exactness contract, and keeps PyTorch's operations where they cannot be built."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import layer_ops
from knapspec.model.kernels.layer_ops import (
    apply_norm,
    available,
    rms_norm,
    rotary_,
    scatter_,
    serves_norms,
    serves_rotary,
)
from knapspec.testing.exactness import verification_mismatches
from knapspec.testing.models import tiny_model

DTYPES = (torch.float32, torch.bfloat16)
FAMILIES = ("llama", "qwen3", "gemma3")
CONTEXT, DRAFTED = torch.tensor([5, 17, 3, 88, 41]), torch.tensor([9, 60, 2, 33, 71, 12])


def _apply_rotary(family: str):  # type: ignore[no-untyped-def]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return module.apply_rotary_pos_emb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_operations_build_here(dtype: torch.dtype) -> None:
    """CI machines have a C compiler; without one the engine keeps PyTorch's (below)."""
    assert available(dtype)
    assert not available(torch.float16)


@given(
    family=st.sampled_from(FAMILIES),
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 4),
    q_len=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    groups=st.integers(1, 3),
    half=st.sampled_from([1, 4, 32]),
    fused=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rotary_is_bitwise_the_models_own(
    family: str,
    dtype: torch.dtype,
    batch: int,
    q_len: int,
    kv_heads: int,
    groups: int,
    half: int,
    fused: bool,
    seed: int,
) -> None:
    """In place on the query and key parts of one fused product (or on separate tensors),
    every element equals HF's ``apply_rotary_pos_emb`` bit for bit; the values part of the
    product is untouched."""
    generator = torch.Generator().manual_seed(seed)
    heads, head_dim = kv_heads * groups, 2 * half

    def sample(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 3).to(dtype)

    cos, sin = sample(batch, q_len, head_dim), sample(batch, q_len, head_dim)
    if fused:
        product = sample(batch, q_len, heads + 2 * kv_heads, head_dim)
        query, key = product[:, :, :heads], product[:, :, heads : heads + kv_heads]
    else:
        query, key = sample(batch, q_len, heads, head_dim), sample(batch, q_len, kv_heads, head_dim)
    expected_query, expected_key = _apply_rotary(family)(
        query.transpose(1, 2), key.transpose(1, 2), cos, sin
    )
    values_before = product[:, :, heads + kv_heads :].clone() if fused else None
    assert rotary_(query, key, cos, sin)
    assert torch.equal(query.transpose(1, 2), expected_query)
    assert torch.equal(key.transpose(1, 2), expected_key)
    if fused:
        assert torch.equal(product[:, :, heads + kv_heads :], values_before)


def test_rotary_refuses_a_layout_it_cannot_rotate_in_place_and_changes_nothing() -> None:
    """Heads that are not side by side (a transposed view), or cos rows that do not match
    the tokens: False, both tensors as they were."""
    query = torch.randn(1, 3, 2, 8)
    key = torch.randn(1, 2, 3, 8).transpose(1, 2)  # (1, 3, 2, 8): heads 24 apart
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    before = query.clone(), key.clone()
    assert not rotary_(query, key, cos, sin)
    assert torch.equal(query, before[0]) and torch.equal(key, before[1])
    key = torch.randn(1, 3, 2, 8)
    assert not rotary_(query, key, cos[:, :2], sin[:, :2])
    assert torch.equal(query, before[0])


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 9),
    width=st.integers(1, 80),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_rms_norm_is_row_invariant_and_within_an_ulp_of_the_models(
    dtype: torch.dtype, rows: int, width: int, scale: float, seed: int
) -> None:
    """Each row of a many-row call is bitwise the row normalised alone (rows share no
    arithmetic), and matches HF's ``LlamaRMSNorm`` to the dtype's last place."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(width, generator=generator).to(dtype)
    x = (torch.randn(rows, width, generator=generator) * scale).to(dtype)
    together = rms_norm(x, norm.weight, norm.variance_epsilon)
    for row in range(rows):
        assert torch.equal(together[row], rms_norm(x[row : row + 1], norm.weight, 1e-6)[0])
    with torch.inference_mode():
        expected = norm(x)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(together, expected, rtol=2 * ulp, atol=2 * ulp * scale)


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 9),
    width=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_gemmas_norm_is_row_invariant_and_within_an_ulp_of_the_models(
    dtype: torch.dtype, rows: int, width: int, scale: float, seed: int
) -> None:
    """Gemma's form (``1 + weight`` in float32, one cast at the end): each row of a
    many-row call bitwise the row alone, and HF's ``Gemma3RMSNorm`` to the last place."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    generator = torch.Generator().manual_seed(seed)
    norm = Gemma3RMSNorm(width, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(width, generator=generator).to(dtype)
    x = (torch.randn(rows, width, generator=generator) * scale).to(dtype)
    assert serves_norms([norm], dtype)
    together = apply_norm(norm, x)
    for row in range(rows):
        assert torch.equal(together[row], apply_norm(norm, x[row : row + 1])[0])
    with torch.inference_mode():
        expected = norm(x)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(together, expected, rtol=2 * ulp, atol=2 * ulp * scale)
    # The Llama form on the same weight is another function: the offset is not ignored.
    llama_form = rms_norm(x, norm.weight, 1e-6)
    assert not torch.allclose(llama_form.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_keeps_nan_and_reads_a_strided_row() -> None:
    """A NaN in a row poisons that row only (the NaN check downstream must see it), and
    the rows of a wider buffer (a slice) are read with their stride."""
    buffer = torch.randn(3, 12)
    x = buffer[:, :8]
    x[1, 2] = float("nan")
    weight = torch.randn(8)
    out = rms_norm(x, weight, 1e-5)
    assert out.shape == (3, 8)
    assert out[1].isnan().all()
    assert not out[[0, 2]].isnan().any()
    assert torch.equal(out[0], rms_norm(x[0:1].contiguous(), weight, 1e-5)[0])


@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 5),
    q_len=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_the_kv_copy_is_bitwise_an_indexed_assignment(
    dtype: torch.dtype, batch: int, q_len: int, seed: int
) -> None:
    """Tokens of ``(b, q)`` rows (a transposed view of a fused product, as attention
    hands them over) land where ``buffer[rows, :, positions] = source`` puts them."""
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(6, 2, 10, 4, generator=generator).to(dtype)
    expected = buffer.clone()
    product = torch.randn(batch, q_len, 5, 4, generator=generator).to(dtype)
    source = product[:, :, 1:3]  # (b, q, 2, 4): heads side by side, token stride 20
    rows = torch.randperm(6, generator=generator)[:batch].repeat_interleave(q_len)
    rows = rows.view(batch, q_len)
    positions = torch.stack([torch.randperm(10, generator=generator)[:q_len] for _ in range(batch)])
    expected[rows, :, positions] = source
    assert scatter_(buffer, rows, positions, source)
    assert torch.equal(buffer, expected)


def test_the_kv_copy_refuses_an_index_outside_the_buffer_and_writes_nothing() -> None:
    buffer = torch.zeros(2, 1, 4, 3)
    source = torch.ones(1, 2, 1, 3)
    with pytest.raises(RuntimeError, match="K/V write refused"):
        scatter_(buffer, torch.tensor([[0, 2]]), torch.tensor([[0, 1]]), source)
    with pytest.raises(RuntimeError, match="K/V write refused"):
        scatter_(buffer, torch.tensor([[0, 0]]), torch.tensor([[3, 4]]), source)
    assert not buffer.any()
    # A layout it does not copy (another dtype): False, nothing written.
    assert not scatter_(buffer, torch.tensor([[0, 0]]), torch.tensor([[0, 1]]), source.double())
    assert not buffer.any()


class _GemmaStyleNorm(nn.Module):
    """``(1 + weight) * x / rms``: an RMSNorm :func:`rms_norm` does not compute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (1 + self.weight) * (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype)


_GemmaStyleNorm.__name__ = "GemmaStyleRMSNorm"


def _interleaved_rotary(  # type: ignore[no-untyped-def]
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
):
    """GPT-J's interleaved rotary (pairs of neighbours): another function."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def test_a_norm_or_rotary_of_another_form_keeps_the_models_own() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    assert serves_norms([LlamaRMSNorm(16)], torch.float32)
    assert not serves_norms([_GemmaStyleNorm(16)], torch.float32)
    assert not serves_norms([nn.LayerNorm(16)], torch.float32)
    assert not serves_norms([LlamaRMSNorm(16)], torch.float64)
    assert serves_rotary(apply_rotary_pos_emb, 4, 2, 8, torch.bfloat16)
    assert not serves_rotary(_interleaved_rotary, 4, 2, 8, torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_exact_engine_runs_them_and_keeps_the_contract(family: str, dtype: torch.dtype) -> None:
    """Every verification row bitwise its one-token step, with the compiled norms and
    rotary on every path, and the logits within rounding of the model's own forward."""
    model = tiny_model(family).to(dtype)
    engine = SublayerEngine(model, progress=False)
    assert engine.compiled_norms and engine.compiled_rotary
    assert verification_mismatches(engine, CONTEXT, DRAFTED) == []
    tokens = torch.tensor([3, 14, 15, 92, 65, 35])
    with torch.inference_mode():
        expected = model(tokens[None]).logits[0].float()
    got = engine.forward(tokens, 0, engine.new_cache()).logits.float()
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_without_a_compiler_the_engine_keeps_pytorchs_operations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the library cannot be built (no compiler: ``load`` gives None), the engine
    runs the model's own norm and rotary and still keeps the contract."""
    monkeypatch.setattr(layer_ops.LIBRARY, "load", lambda: None)
    assert not available(torch.float32)
    engine = SublayerEngine(tiny_model("llama"), progress=False)
    assert not engine.compiled_norms and not engine.compiled_rotary
    assert verification_mismatches(engine, CONTEXT, DRAFTED) == []
    buffer = torch.zeros(2, 1, 4, 3)
    assert not scatter_(buffer, torch.tensor([[0]]), torch.tensor([[0]]), torch.ones(1, 1, 1, 3))


def test_the_option_turns_them_all_off_and_batch_caches_write_alike() -> None:
    """``compiled_layer_ops=False`` runs the model's modules and PyTorch's writes (the A/B
    baseline); a batched pass writes bitwise the same K/V through either write."""
    from knapspec.model.passes.batched import forward_batch, new_batch_cache

    model = tiny_model("llama")
    off = SublayerEngine(model, progress=False, compiled_layer_ops=False)
    assert not (off.compiled_norms or off.compiled_rotary or off.compiled_writes)
    on = SublayerEngine(model, progress=False)
    assert on.compiled_writes
    tokens = torch.tensor([[4, 8, 15], [16, 23, 42]])
    caches = []
    for writes in (True, False):
        off.compiled_writes = writes
        cache = new_batch_cache(off, 2, 8)
        forward_batch(off, tokens, [0, 0], cache)
        caches.append(cache)
    for layer in range(off.num_layers):
        assert torch.equal(caches[0].keys(layer, 3), caches[1].keys(layer, 3))
        assert torch.equal(caches[0].values(layer, 3), caches[1].values(layer, 3))
    assert caches[0].keys(0, 3).abs().sum() > 0


def test_the_amx_tile_set_up_is_one_header_both_tile_kernels_include(tmp_path: Path) -> None:
    """The AMX set-up (asking the OS for the tiles, loading the tile configuration) is
    written once, in ``csrc/amx_tiles.h``; the linear and the attention kernels include it,
    and editing it rebuilds both (their cache keys hash every header beside the source)."""
    import shutil

    from knapspec.model.kernels.compiled import CSRC, CompiledLibrary

    set_up = ("ARCH_REQ_XCOMP_PERM 0x", "_tile_loadconfig(")
    writers = sorted(p.name for p in CSRC.iterdir() if any(s in p.read_text() for s in set_up))
    assert writers == ["amx_tiles.h"]
    for path in CSRC.iterdir():
        shutil.copy(path, tmp_path / path.name)
    header = tmp_path / "amx_tiles.h"
    for source in ("row_linear.c", "row_attention.c"):
        assert '#include "amx_tiles.h"' in (CSRC / source).read_text()
        library = CompiledLibrary(source, "test", "test", lambda _: None)
        library.source = tmp_path / source
        before = library.path()
        header.write_text(header.read_text() + f"\n/* edited for {source} */\n")
        assert library.path() != before


def test_a_kernels_cache_key_covers_the_shared_header_and_the_wheel_ships_both(
    tmp_path: Path,
) -> None:
    """Editing ``bfloat16.h`` rebuilds every kernel that includes it (their cache keys hash
    the headers beside the source), and the package data ships every C source and header
    (a wheel without them would fall back to the slow paths)."""
    import fnmatch
    import shutil
    import tomllib

    from knapspec.model.kernels.compiled import CSRC, CompiledLibrary

    for path in CSRC.iterdir():
        shutil.copy(path, tmp_path / path.name)
    library = CompiledLibrary("layer_ops.c", "test", "test", lambda _: None)
    library.source = tmp_path / "layer_ops.c"
    before = library.path()
    header = tmp_path / "bfloat16.h"
    header.write_text(header.read_text() + "\n/* edited */\n")
    assert library.path() != before
    pyproject = tomllib.loads((CSRC.parents[4] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["knapspec"]
    shipped = [f"model/kernels/csrc/{path.name}" for path in CSRC.iterdir()]
    assert {".c", ".h"} <= {Path(name).suffix for name in shipped}
    for name in shipped:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
