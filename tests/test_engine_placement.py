"""The engine on other dtypes and placements: bf16/fp16 models decode exactly as the model
does in that dtype; weights offloaded by accelerate are refused with the layers named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tests.tiny_models import tiny_model

from knapspec import SpeculativeDecoder
from knapspec.model.engine import OffloadedModelError, SublayerEngine
from knapspec.planners import AutoregressivePlanner

NEW_TOKENS = 20


def _greedy_reference(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    ids = prompt.unsqueeze(0)
    out = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
    )
    tokens: torch.Tensor = out[0, prompt.numel() :]
    return tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_half_precision_greedy_equals_the_models_own_greedy(
    family: str, dtype: torch.dtype
) -> None:
    model = copy.deepcopy(tiny_model(family, seed=7)).to(dtype)
    # Without the exactness contract the engine runs the model's own products and
    # attention; with it (the default) it equals its own plain decoding instead
    # (tests/test_exactness.py), which rounds differently from the model's.
    engine = SublayerEngine(model, exact=False)
    assert engine.dtype == dtype and engine.kernels.is_plain  # the model's own products
    assert engine.kernels.source == "framework"
    generator = torch.Generator().manual_seed(3)
    decoder = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    for seed in range(3):
        prompt = torch.randint(0, engine.vocab_size, (12 + 5 * seed,), generator=generator)
        tokens = decoder.generate(prompt, max_new_tokens=NEW_TOKENS).tokens
        assert torch.equal(tokens, _greedy_reference(model, prompt)), f"prompt {seed}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_half_precision_forwards_are_the_models_bit_for_bit(
    family: str, dtype: torch.dtype
) -> None:
    """A k-row verify pass is the model's own k-row forward, bit for bit. (The model's k-row
    forward may round differently from its k one-row steps in half precision, so a draft
    can flip a near-tie there: that is the model's batch-shape dependence, not the engine's.)"""
    from transformers import DynamicCache

    model = copy.deepcopy(tiny_model(family, seed=7)).to(dtype)
    engine = SublayerEngine(model, exact=False)  # the model's own arithmetic (see above)
    ids = torch.randint(0, engine.vocab_size, (24,), generator=torch.Generator().manual_seed(5))
    for width in (1, 4, 8):
        start = ids.numel() - width
        cache = engine.new_cache(32)
        engine.forward(ids[:start], 0, cache)
        ours = engine.forward(ids[start:], start, cache).logits
        reference = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:start].unsqueeze(0), cache=reference)
            theirs = model(ids[start:].unsqueeze(0), cache=reference).logits[0]
        assert torch.equal(ours, theirs.float()), f"{width} rows"


def test_layers_offloaded_to_disk_are_refused_by_name(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    tiny_model("llama", seed=8).save_pretrained(tmp_path / "model")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    with pytest.raises(OffloadedModelError, match=r"model\.layers\.1, model\.layers\.2 are"):
        SublayerEngine(model)
    prompt = torch.arange(5)
    before = _greedy_reference(model, prompt)  # the model itself is untouched and still runs
    assert torch.equal(before, _greedy_reference(tiny_model("llama", seed=8), prompt))
