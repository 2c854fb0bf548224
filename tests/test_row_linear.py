"""The compiled row-invariant linear kernel (``row-linear``): every row of an ``m``-row
product is bitwise that row's one-row product, for any shape, dtype, bias and layout; the
probe lets it through; an exact engine running it everywhere keeps the contract; where it
cannot be built, the fallback keeps it too."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import row_linear as row_linear_module
from knapspec.model.kernels.compiled import CompiledLibrary
from knapspec.model.kernels.row_linear import (
    amx_available,
    amx_linear,
    amx_pack,
    available,
    build_description,
    packed_available,
    packed_linear,
    row_linear,
)
from knapspec.model.kernels.table import (
    AMX_KERNEL,
    KERNELS,
    PACKED_KERNEL,
    ROW_LINEAR_KERNEL,
    Kernel,
)
from knapspec.model.tuning.invariance import first_violation, row_invariant_table
from knapspec.testing.exactness import RowCountingKernel, verification_mismatches
from knapspec.testing.models import tiny_model
from units import needs_amx_tiles, needs_avx512_bf16

DTYPES = (torch.float32, torch.bfloat16)
#: Worst relative error against a float64 product (bf16 output rounding dominates).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

needs_amx = needs_amx_tiles
needs_packed = needs_avx512_bf16
#: (kernel, dtype) pairs to test: the AVX kernel in both dtypes, the AMX and packed ones
#: in bf16 (where the CPU has their units).
CASES = [
    pytest.param(row_linear, torch.float32, id="row-linear-float32"),
    pytest.param(row_linear, torch.bfloat16, id="row-linear-bfloat16"),
    pytest.param(amx_linear, torch.bfloat16, id="amx-linear-bfloat16", marks=needs_amx),
    pytest.param(packed_linear, torch.bfloat16, id="packed-linear-bfloat16", marks=needs_packed),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_builds_here(dtype: torch.dtype) -> None:
    """CI machines have a C compiler; without one the kernel falls back (tested below)."""
    assert available(dtype)
    assert "float32 lanes" in build_description()
    assert KERNELS[ROW_LINEAR_KERNEL] is row_linear


@given(
    kernel_and_dtype=st.sampled_from(
        [(row_linear, torch.float32), (row_linear, torch.bfloat16)]
        + ([(amx_linear, torch.bfloat16)] if amx_available() else [])
        + ([(packed_linear, torch.bfloat16)] if packed_available() else [])
    ),
    out_features=st.integers(1, 70),
    in_features=st.integers(1, 200),
    rows=st.integers(1, 40),
    with_bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_every_row_is_its_one_row_product_and_the_product_is_right(
    kernel_and_dtype: tuple[Kernel, torch.dtype],
    out_features: int,
    in_features: int,
    rows: int,
    with_bias: bool,
    seed: int,
) -> None:
    kernel, dtype = kernel_and_dtype
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    together = kernel(x, weight, bias)
    assert together.shape == (rows, out_features) and together.dtype == dtype
    for i in range(rows):
        assert torch.equal(together[i : i + 1], kernel(x[i : i + 1], weight, bias)), i
    reference = torch.nn.functional.linear(
        x.double(), weight.double(), None if bias is None else bias.double()
    )
    scale = x.double().abs() @ weight.double().abs().T + (
        0 if bias is None else bias.double().abs()
    )
    error = ((together.double() - reference).abs() / scale.clamp_min(1e-30)).max().item()
    assert error <= TOLERANCE[dtype]


@pytest.mark.parametrize(("kernel", "dtype"), CASES)
def test_strided_and_batched_inputs(kernel: Kernel, dtype: torch.dtype) -> None:
    weight = torch.randn(40, 96).to(dtype)
    wide = torch.randn(2, 5, 200).to(dtype)
    x = wide[..., 10:106]  # rows not contiguous with each other
    out = kernel(x, weight, None)
    assert out.shape == (2, 5, 40)
    assert torch.equal(out, kernel(x.contiguous(), weight, None))
    assert torch.equal(out[1, 3], kernel(x[1, 3:4].contiguous(), weight, None)[0])


@pytest.mark.parametrize(("kernel", "dtype"), CASES)
def test_a_weight_changed_in_place_is_not_served_stale(kernel: Kernel, dtype: torch.dtype) -> None:
    """A padded (row-linear, odd sizes) or packed (amx-linear) copy follows its weight."""
    weight = torch.randn(8, 37).to(dtype)  # 37 is no multiple of either kernel's chunk
    x = torch.randn(3, 37).to(dtype)
    before = kernel(x, weight, None)
    weight.mul_(2)
    assert torch.equal(kernel(x, weight, None), before * 2)


def test_the_amx_packing_is_the_documented_layout() -> None:
    """Tile (n_tile, k_tile) holds k-pairs side by side for 16 outputs (VNNI order)."""
    weight = torch.arange(20 * 70, dtype=torch.float32).view(20, 70).to(torch.bfloat16)
    packed = amx_pack(weight)
    assert packed.shape == (2, 3, 16, 16, 2)
    n_tile, k_tile, pair, n, two = 1, 2, 2, 3, 1
    assert packed[n_tile, k_tile, pair, n, two] == weight[16 + n, 64 + 2 * pair + two]
    assert packed[1, 0, 0, 4, 0] == 0  # output 20 is padding
    assert packed[0, 2, 3, 0, 0] == 0  # k 70 is padding


@pytest.mark.parametrize("kernel", [amx_linear, packed_linear], ids=["amx", "packed"])
def test_the_bf16_kernels_fall_back_outside_their_dtype(kernel: Kernel) -> None:
    weight, x = torch.randn(24, 40), torch.randn(5, 40)
    together = kernel(x, weight, None)  # float32: each row its own F.linear
    for i in range(5):
        assert torch.equal(together[i : i + 1], torch.nn.functional.linear(x[i : i + 1], weight))


@pytest.mark.parametrize(("kernel", "dtype"), CASES)
def test_the_probe_lets_it_through_on_the_inputs_that_catch_others(
    kernel: Kernel, dtype: torch.dtype
) -> None:
    """Cancelling inputs and every probed count, as for any candidate."""
    assert first_violation(kernel, torch.randn(48, 576).to(dtype), None) is None


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(("kernel", "dtype"), CASES)
def test_an_exact_engine_running_it_everywhere_keeps_the_contract(
    family: str, kernel: Kernel, dtype: torch.dtype
) -> None:
    engine = SublayerEngine(tiny_model(family).to(dtype))
    counted = RowCountingKernel(0.0, base=kernel)
    with engine.substituted_products(counted):
        for seed in range(6):
            context = torch.randint(
                0, 97, (20 + 9 * seed,), generator=torch.Generator().manual_seed(seed)
            )
            drafted = torch.randint(
                0, 97, (1 + 3 * seed,), generator=torch.Generator().manual_seed(seed + 50)
            )
            assert verification_mismatches(engine, context, drafted) == []
    assert counted.multi_row_calls > 0, "the kernel never ran over several rows"


def test_the_probe_offers_it_to_exact_engines() -> None:
    engine = SublayerEngine(tiny_model("llama"))
    report = row_invariant_table(engine, engine.kernels, use_cache=False)
    offered = {name for names in report.timed.values() for name in names}
    chosen = set(report.kernels.values())
    assert ROW_LINEAR_KERNEL in offered | chosen


@pytest.mark.parametrize(
    ("name", "kernel"),
    [
        pytest.param(PACKED_KERNEL, packed_linear, id="packed", marks=needs_packed),
        pytest.param(AMX_KERNEL, amx_linear, id="amx", marks=needs_amx),
    ],
)
def test_the_probe_offers_the_bf16_kernels_to_exact_bf16_engines(name: str, kernel: Kernel) -> None:
    engine = SublayerEngine(tiny_model("llama").to(torch.bfloat16))
    report = row_invariant_table(engine, engine.kernels, use_cache=False)
    offered = {candidate for timed in report.timed.values() for candidate in timed}
    assert name in offered | set(report.kernels.values())
    assert KERNELS[name] is kernel


def test_without_a_compiler_it_falls_back_to_one_row_at_a_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken compiler: the library is unavailable, said once, and the kernel still
    gives every row its one-row result (each row its own ``F.linear``)."""
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    library = CompiledLibrary(
        "row_linear.c", "the row-invariant linear kernel", "fallback", lambda lib: None
    )
    with caplog.at_level(logging.WARNING):
        assert library.load() is None
        assert library.load() is None
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setattr(row_linear_module, "LIBRARY", library)
    assert not available(torch.float32)
    weight, x = torch.randn(24, 40), torch.randn(7, 40)
    together = row_linear(x, weight, None)
    for i in range(7):
        assert torch.equal(together[i : i + 1], torch.nn.functional.linear(x[i : i + 1], weight))


@given(
    dtype=st.sampled_from(DTYPES),
    sequences=st.integers(1, 5),
    q_len=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_attention_over_a_batch_in_one_call_is_each_sequence_alone(
    dtype: torch.dtype, sequences: int, q_len: int, seed: int
) -> None:
    """``attend_rows_batched`` (one kernel call for every sequence of a batch, each with its
    own keys) gives each sequence bitwise what ``attend_rows`` gives it alone."""
    from knapspec.model.kernels.row_attention import attend_rows, attend_rows_batched

    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, capacity = 6, 2, 16, 40
    query = torch.randn(sequences, heads, q_len, head_dim, generator=generator).to(dtype)
    buffers = torch.randn(2, sequences + 1, kv_heads, capacity, head_dim, generator=generator)
    keys, values = (b.to(dtype)[:sequences, :, :30] for b in buffers)
    starts = torch.randint(0, 30 - q_len + 1, (sequences,), generator=generator)
    lengths = starts[:, None] + torch.arange(1, q_len + 1)
    together = attend_rows_batched(query, keys, values, lengths, 0.25)
    assert together is not None
    for b in range(sequences):
        alone = attend_rows(query[b], keys[b], values[b], lengths[b], 0.25)
        assert torch.equal(together[b], alone)
