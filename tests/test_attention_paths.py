"""Every path of the row-invariant bf16 attention keeps the contract: the vector path, on a
CPU whose OS grants AMX tiles the tile path, and on one with AVX512-BF16 the ``VDPBF16PS``
path (``csrc/row_attention.c``). Each path is forced in turn, so each machine tests what it
has (the other cases skip, saying why).

Per path: a row's output is bitwise the same alone or among up to 40 others of any lengths
(rows spread over several 16-row tiles), it is softmax attention to bf16 precision, a tree
row equals the contiguous row over its packed keys, a batched call equals each sequence
alone, and an exact engine's verification equals one-token steps.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import row_attention
from knapspec.model.kernels.row_attention import (
    attend_rows,
    attend_rows_batched,
    attend_tree_rows,
    attention_path,
)
from knapspec.model.machine import AMX_TILE_FLAGS, AVX512_BF16_FLAGS, claimed_absent
from knapspec.testing.exactness import verification_mismatches
from knapspec.testing.models import tiny_model
from units import skip_unless_attention_unit

PATHS = ("vector", "amx-tiles", "avx512-bf16")
#: The path fixture only patches a module flag, the same for every example.
FIXTURE = [HealthCheck.function_scoped_fixture]


def _tiles_here() -> bool:
    library = row_attention.load_library()
    native = library is not None and library.knapspec_attention_amx_available() == 1
    return native and not claimed_absent(*AMX_TILE_FLAGS)


def _dpbf16_here() -> bool:
    library = row_attention.load_library()
    native = library is not None and library.knapspec_attention_dpbf16_available() == 1
    return native and not claimed_absent(*AVX512_BF16_FLAGS)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Force one path for the test (the process-wide decision is patched, then restored)."""
    skip_unless_attention_unit(request.param)
    monkeypatch.setattr(row_attention, "_bf16_unit", request.param)
    assert attention_path(torch.bfloat16, 64) == request.param
    yield request.param


def _signed(mask: int) -> int:
    return mask - (1 << 64) if mask >> 63 else mask


def _reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention in float64: ``(H, q, hd)``, row ``i`` over keys ``< lengths[i]``."""
    groups = query.shape[0] // keys.shape[0]
    k64 = keys.double().repeat_interleave(groups, 0)
    v64 = values.double().repeat_interleave(groups, 0)
    scores = query.double() @ k64.transpose(1, 2) * scale
    visible = torch.arange(keys.shape[1])[None] < lengths[:, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v64


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE)
@given(
    heads=st.sampled_from([(9, 3), (4, 2), (4, 4), (2, 1)]),
    head_dim=st.sampled_from([8, 16, 24, 64, 96, 128]),
    rows=st.integers(1, 40),
    keys_count=st.integers(1, 300),
    seed=st.integers(0, 10_000),
)
def test_each_path_is_row_invariant_and_correct(
    path: str, heads: tuple[int, int], head_dim: int, rows: int, keys_count: int, seed: int
) -> None:
    query_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(query_heads, rows, head_dim, generator=generator).bfloat16()
    # a view into wider buffers, as the cache's keys are
    keys = torch.randn(kv_heads, keys_count + 7, head_dim, generator=generator).bfloat16()
    values = torch.randn(kv_heads, keys_count + 7, head_dim, generator=generator).bfloat16()
    keys, values = keys[:, :keys_count], values[:, :keys_count]
    lengths = torch.randint(1, keys_count + 1, (rows,), generator=generator)
    scale = head_dim**-0.5
    together = attend_rows(query, keys, values, lengths, scale)
    for i in range(rows):
        alone = attend_rows(query[:, i : i + 1], keys, values, lengths[i : i + 1], scale)
        assert torch.equal(together[:, i : i + 1], alone), f"row {i} ({path})"
    # rows in reverse order: each lands in another tile position
    backwards = attend_rows(query.flip(1), keys, values, lengths.flip(0), scale)
    assert torch.equal(backwards.flip(1), together)
    expected = _reference(query, keys, values, lengths, scale)
    torch.testing.assert_close(together.double(), expected, atol=2e-2, rtol=2e-2)


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE)
@given(
    head_dim=st.sampled_from([16, 64, 128]),
    rows=st.integers(1, 40),
    prefix=st.integers(0, 200),
    width=st.integers(1, 64),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
)
def test_each_path_keeps_tree_rows_equal_to_their_packed_rows(
    path: str, head_dim: int, rows: int, prefix: int, width: int, density: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    n_keys = prefix + width
    query = torch.randn(6, rows, head_dim, generator=generator).bfloat16()
    keys = torch.randn(3, n_keys, head_dim, generator=generator).bfloat16()
    values = torch.randn(3, n_keys, head_dim, generator=generator).bfloat16()
    prefixes, masks = [], []
    for _ in range(rows):
        first = int(torch.randint(0, prefix + 1, (1,), generator=generator))
        bits = torch.rand(min(64, n_keys - first), generator=generator) < density
        mask = sum(1 << t for t in range(bits.numel()) if bits[t]) or (1 if first == 0 else 0)
        prefixes.append(first)
        masks.append(mask)
    together = attend_tree_rows(
        query, keys, values, torch.tensor(prefixes), torch.tensor([_signed(m) for m in masks]), 0.3
    )
    for i, (first, mask) in enumerate(zip(prefixes, masks, strict=True)):
        index = torch.tensor([*range(first), *(first + t for t in range(64) if mask >> t & 1)])
        packed_keys, packed_values = keys[:, index].contiguous(), values[:, index].contiguous()
        alone = attend_rows(
            query[:, i : i + 1], packed_keys, packed_values, torch.tensor([index.numel()]), 0.3
        )
        assert torch.equal(together[:, i : i + 1], alone), f"tree row {i} ({path})"


@settings(max_examples=15, deadline=None, suppress_health_check=FIXTURE)
@given(
    sequences=st.integers(1, 6),
    q_len=st.integers(1, 20),
    seed=st.integers(0, 10_000),
)
def test_each_path_batches_sequences_bitwise(
    path: str, sequences: int, q_len: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(sequences, 6, q_len, 64, generator=generator).bfloat16()
    buffers = torch.randn(2, sequences + 1, 2, 90, 64, generator=generator).bfloat16()
    keys, values = buffers[0, :sequences, :, :70], buffers[1, :sequences, :, :70]
    starts = torch.randint(0, 70 - q_len + 1, (sequences,), generator=generator)
    lengths = starts[:, None] + torch.arange(1, q_len + 1)
    together = attend_rows_batched(query, keys, values, lengths, 0.125)
    assert together is not None
    for b in range(sequences):
        assert torch.equal(
            together[b], attend_rows(query[b], keys[b], values[b], lengths[b], 0.125)
        )


@functools.cache
def _bf16_engine(family: str) -> SublayerEngine:
    return SublayerEngine(tiny_model(family).to(torch.bfloat16), exact=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("context", "drafted"), [(1, 16), (40, 7), (75, 33)])
def test_each_path_keeps_an_exact_engine_exact(
    path: str, family: str, context: int, drafted: int
) -> None:
    generator = torch.Generator().manual_seed(context * 31 + drafted)
    tokens = torch.randint(0, 97, (context + drafted,), generator=generator)
    engine = _bf16_engine(family)
    assert engine.exact_attention_path == path
    assert verification_mismatches(engine, tokens[:context], tokens[context:]) == []


def test_the_paths_follow_the_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` takes the fastest path here; ``KNAPSPEC_ATTENTION_UNIT`` picks one, and a
    name that is no path or one this machine lacks is a clear error; the older
    ``KNAPSPEC_AMX_ATTENTION=0`` rules out the tiles; float32, an odd head size and a head
    too wide for the bf16 units take the vector path."""
    here = row_attention.available_bf16_units()
    expected = "amx-tiles" if _tiles_here() else "avx512-bf16" if _dpbf16_here() else "vector"
    assert here[0] == expected and here[-1] == "vector"
    monkeypatch.setattr(row_attention, "_bf16_unit", None)
    monkeypatch.delenv("KNAPSPEC_ATTENTION_UNIT", raising=False)
    monkeypatch.delenv("KNAPSPEC_AMX_ATTENTION", raising=False)
    assert attention_path(torch.bfloat16, 64) == expected
    assert attention_path(torch.float32, 64) == "vector"
    assert attention_path(torch.bfloat16, 256) == "vector"
    assert attention_path(torch.bfloat16, 63) == "vector"
    for unit in here:
        monkeypatch.setattr(row_attention, "_bf16_unit", None)
        monkeypatch.setenv("KNAPSPEC_ATTENTION_UNIT", unit)
        assert attention_path(torch.bfloat16, 64) == unit
    monkeypatch.setattr(row_attention, "_bf16_unit", None)
    monkeypatch.setenv("KNAPSPEC_ATTENTION_UNIT", "tensor-cores")
    with pytest.raises(ValueError, match="valid: auto, vector, amx-tiles, avx512-bf16"):
        attention_path(torch.bfloat16, 64)
    missing = [unit for unit in ("amx-tiles", "avx512-bf16") if unit not in here]
    for unit in missing:
        monkeypatch.setattr(row_attention, "_bf16_unit", None)
        monkeypatch.setenv("KNAPSPEC_ATTENTION_UNIT", unit)
        with pytest.raises(ValueError, match="available here"):
            attention_path(torch.bfloat16, 64)
    monkeypatch.setattr(row_attention, "_bf16_unit", None)
    monkeypatch.delenv("KNAPSPEC_ATTENTION_UNIT")
    monkeypatch.setenv("KNAPSPEC_AMX_ATTENTION", "0")
    assert attention_path(torch.bfloat16, 64) == next(u for u in here if u != "amx-tiles")


@pytest.mark.parametrize("unit", [1, 2, 3])
def test_the_kernel_refuses_a_unit_it_cannot_serve(
    unit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked for a bf16 unit on float32 (or for one that is not there, or no unit at all),
    the kernel returns an error instead of computing something else; the Python side
    raises it."""
    monkeypatch.setattr(row_attention, "_unit", lambda dtype, head_dim: unit)
    query, keys = torch.randn(2, 3, 16), torch.randn(1, 5, 16)
    with pytest.raises(RuntimeError, match="status 4"):
        attend_rows(query, keys, keys, torch.tensor([3, 4, 5]), 0.25)
