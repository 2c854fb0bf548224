"""Fused query/key/value and gate/up projections: same outputs, same memory, no stale use."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tests.tiny_models import FAMILIES, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM

from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.fusion import fuse_linears


def _fresh(family: str) -> nn.Module:
    """A private copy of a tiny model (the cached ones are shared between tests)."""
    return copy.deepcopy(tiny_model(family, seed=5))


def _steps(engine: SublayerEngine, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill 8 tokens, then steps of 1, 3 and 5 tokens (few-row products): all logits."""
    cache = engine.new_cache(64)
    outs = [engine.forward(ids[:8], 0, cache).logits]
    start = 8
    for width in (1, 3, 5):
        outs.append(engine.forward(ids[start : start + width], start, cache).logits)
        start += width
    return outs


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_engine_matches_the_unfused_engine_and_the_model(family: str) -> None:
    model = _fresh(family)
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids.unsqueeze(0)).logits[0]
    fused = SublayerEngine(model)
    assert all(f is not None for f in fused._fused_qkv + fused._fused_gate_up)
    plain = SublayerEngine(model, fuse_projections=False)
    for got, expected in zip(_steps(fused, ids), _steps(plain, ids), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the model itself computes what it did before the fusion
        torch.testing.assert_close(model(ids.unsqueeze(0)).logits[0], before, rtol=0, atol=0)


def test_fusion_reuses_the_weights_memory_and_is_shared_by_later_engines() -> None:
    model = _fresh("qwen2")  # q/k/v with biases
    count = sum(p.numel() for p in model.parameters())
    first = SublayerEngine(model)
    attn = first.layers[0].self_attn
    fused = first._fused_qkv[0]
    assert fused is not None and fused.bias is not None
    shared = fused.weight.untyped_storage().data_ptr()
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == shared
        assert proj.bias is not None
        assert proj.bias.untyped_storage().data_ptr() == fused.bias.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count
    second = SublayerEngine(model)
    assert second._fused_qkv[0] is fused and second._fused_gate_up[1] is first._fused_gate_up[1]


def test_a_replaced_weight_is_used_not_the_stale_fusion() -> None:
    model = _fresh("llama")
    engine = SublayerEngine(model)
    fused = engine._fused_qkv[1]
    assert fused is not None and fused.is_current()
    k_proj = engine.layers[1].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight = nn.Parameter(torch.randn_like(k_proj.weight))
    assert not fused.is_current()
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(4))
    reference = SublayerEngine(model, fuse_projections=False)
    for got, expected in zip(_steps(engine, ids), _steps(reference, ids), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Moving the data under the same parameter (what ``model.to`` does) is seen too.
    up = engine.layers[0].mlp.up_proj
    up.weight.data = up.weight.data.clone()
    gate_up = engine._fused_gate_up[0]
    assert gate_up is not None and not gate_up.is_current()


def test_an_in_place_weight_update_reaches_the_fused_product() -> None:
    """``load_state_dict`` and in-place edits write through the views."""
    model = _fresh("llama")
    engine = SublayerEngine(model)
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(6))
    donor = tiny_model("llama", seed=9)
    model.load_state_dict(donor.state_dict())
    assert all(f is not None and f.is_current() for f in engine._fused_qkv)
    reference = SublayerEngine(copy.deepcopy(donor), fuse_projections=False)
    for got, expected in zip(_steps(engine, ids), _steps(reference, ids), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_layers_that_cannot_be_fused_are_left_alone() -> None:
    model = _fresh("llama")
    attn = model.model.layers[0].self_attn
    weight = attn.q_proj.weight
    attn.q_proj.register_forward_hook(lambda module, args, output: None)
    assert fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]) is None
    assert attn.q_proj.weight is weight
    assert fuse_linears([attn.k_proj, None]) is None
    assert fuse_linears([attn.k_proj]) is None
    mlp = model.model.layers[0].mlp
    assert fuse_linears([mlp.gate_proj, mlp.down_proj]) is None  # different inputs
    engine = SublayerEngine(model)
    assert engine._fused_qkv[0] is None and engine._fused_qkv[1] is not None


def test_a_fused_model_saves_and_reloads(tmp_path: Path) -> None:
    model = _fresh("qwen3")
    SublayerEngine(model)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_an_exact_bf16_engine_fuses_where_its_kernel_computes_each_output_alone() -> None:
    """bfloat16 runs the framework's products unless exact; an exact engine's row-linear
    or packed-linear kernel makes each output a function of its weight row alone, so the
    projections fuse (one call a group) and every logit stays bitwise the unfused
    engine's."""
    from knapspec.model.kernels.row_linear import available

    if not available(torch.bfloat16):
        pytest.skip("no compiled row-linear kernel here (no C compiler)")
    model = _fresh("llama").to(torch.bfloat16)
    ids = torch.randint(0, 97, (17,), generator=torch.Generator().manual_seed(3))
    fused = SublayerEngine(model, exact=True)
    table = fused.kernels
    fused_groups = {group for group in ("qkv", "gate_up") if all(table.fuse.get(group, ()))}
    if not fused_groups:
        pytest.skip("the probe chose no kernel that fuses by construction (an AMX CPU)")
    assert fused.invariance is not None
    assert {g for g, on in fused.invariance.fused.items() if on} == fused_groups
    plain = SublayerEngine(copy.deepcopy(model), exact=True, fuse_projections=False)
    assert not any(any(flags) for flags in plain.kernels.fuse.values())
    for got, expected in zip(_steps(fused, ids), _steps(plain, ids), strict=True):
        assert torch.equal(got, expected)
