"""The few-row linear kernel equals ``F.linear`` to rounding, and the engine's switch."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiny_models import tiny_model

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.onednn import (
    onednn_available,
    onednn_packed,
    packed_count,
    packing_fits,
    release_packed,
)
from knapspec.model.kernels.table import Kernel, linear, padded_rows
from knapspec.testing import examples

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this build")


def test_padding_rule() -> None:
    assert [padded_rows(r) for r in range(1, 7)] == [2, 2, 4, 4, 5, 6]


def test_other_dtypes_fall_back_to_f_linear() -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(5, 8)
    with pytest.raises(RuntimeError):
        linear(x, weight)  # F.linear's own dtype error, not a silent cast


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_with_and_without_the_kernel_agree(family: str) -> None:
    model = tiny_model(family, seed=3)
    fast, plain = SublayerEngine(model), SublayerEngine(model, kernels="f.linear")
    ids = torch.randint(0, fast.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    for width in (1, 3, 8):
        outs = []
        for engine in (fast, plain):
            cache = engine.new_cache(32)
            engine.forward(ids[:-width], 0, cache)
            outs.append(engine.forward(ids[-width:], ids.numel() - width, cache).logits)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(linear, id="transposed-padded"),
        pytest.param(onednn_packed, id="onednn", marks=needs_onednn),
    ],
)
@settings(max_examples=examples(60), deadline=None)
@given(
    rows=st.integers(1, 70),  # few-row products and past SMALL_ROWS (F.linear for linear)
    lead=st.sampled_from([(), (1,), (2,)]),
    in_features=st.integers(1, 48),
    out_features=st.integers(1, 64),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernels_match_f_linear(
    kernel: Kernel,
    rows: int,
    lead: tuple[int, ...],
    in_features: int,
    out_features: int,
    bias: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    got = kernel(x, weight, b)
    assert got.shape == (*lead, rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    # A strided input (a column block of a fused output) gives the same product.
    wide = torch.randn(*lead, rows, 2 * in_features, generator=generator)
    view = wide[..., :in_features]
    torch.testing.assert_close(
        kernel(view, weight, b), F.linear(view, weight, b), rtol=1e-5, atol=1e-5
    )


@needs_onednn
def test_the_reordered_copy_follows_its_weight() -> None:
    release_packed()
    weight = torch.randn(24, 16)
    x = torch.randn(3, 16)
    onednn_packed(x, weight, None)
    assert packed_count() == 1
    with torch.no_grad():
        weight.mul_(-2.0)  # changed in place: the old copy must not serve it
    torch.testing.assert_close(onednn_packed(x, weight, None), F.linear(x, weight))
    del weight
    gc.collect()
    assert packed_count() == 0  # the copy died with its weight
    other = torch.randn(8, 16)
    onednn_packed(x, other, None)
    assert release_packed() == 1 and packed_count() == 0
    torch.testing.assert_close(onednn_packed(x, other, None), F.linear(x, other))  # re-made


def test_onednn_falls_back_to_f_linear_where_it_cannot_run() -> None:
    x = torch.randn(3, 8, dtype=torch.float64)
    weight = torch.randn(5, 8, dtype=torch.float64)
    assert torch.equal(onednn_packed(x, weight, None), F.linear(x, weight))
    with pytest.raises(RuntimeError):
        onednn_packed(x, weight.float(), None)  # F.linear's own dtype error


def test_packing_is_tried_only_where_the_copies_fit() -> None:
    gib = 2**30
    assert packing_fits(gib, memory_bytes=8 * gib)  # 2 GiB of copies in a quarter of 8
    assert not packing_fits(gib + 1, memory_bytes=8 * gib)
    assert not packing_fits(1, memory_bytes=0)  # unknown memory: never
