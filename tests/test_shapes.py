"""The published 0.6-8B shapes (knapspec.testing.shapes): the configs, the random-weight
builder, and exactness at each shape's real widths (two layers, a small vocabulary).

Hidden sizes 1,024-4,096, head_dim 64 and 128, GQA ratios 2-4, intermediate sizes up to
14,336 and q/k norms are what SmolLM2 and the tiny test models never exercise: here the
exact engine runs each of them, and greedy speculative output (drafting forced on) must
equal plain decoding token for token, one prompt and a batch, in float32 and bfloat16.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from knapspec import SpeculativeDecoder
from knapspec.config import DecoderConfig, build_components, load_builtin_components
from knapspec.model.engine import SublayerEngine
from knapspec.planners import AutoregressivePlanner
from knapspec.proxies.base import PROXIES
from knapspec.testing import CheapDraftCostModel
from knapspec.testing.shapes import (
    SHAPES,
    ModelShape,
    random_model,
    random_parameters,
    shape,
    weight_bytes,
)

load_builtin_components()

VOCAB = 256
NEW_TOKENS = 8
DTYPES = (torch.float32, torch.bfloat16)
#: Parameter counts (billions; tied embeddings once): the Llama cards' 1.24 / 3.21 / 8.03,
#: and what the Qwen3 cards round to 0.6 and 1.7.
PUBLISHED_BILLIONS = {
    "Qwen3-0.6B": 0.60,
    "Llama-3.2-1B": 1.24,
    "Qwen3-1.7B": 1.72,
    "Llama-3.2-3B": 3.21,
    "Llama-3.1-8B": 8.03,
}
#: The engine build at each shape's widths measures and probes kernels (first use): the
#: two largest shapes take longest, so they run with the slow tests.
SLOW_SHAPES = frozenset({"Llama-3.2-3B", "Llama-3.1-8B"})


def _shapes() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SHAPES else name
        for name in SHAPES
    ]


def test_the_configs_are_the_published_ones() -> None:
    assert set(SHAPES) == set(PUBLISHED_BILLIONS)
    for name, billions in PUBLISHED_BILLIONS.items():
        spec = SHAPES[name]
        assert spec.parameters() / 1e9 == pytest.approx(billions, abs=0.011), name
        assert spec.heads % spec.kv_heads == 0
        assert spec.qk_norm == name.startswith("Qwen3")
    assert SHAPES["Llama-3.1-8B"].head_dim == 128 and SHAPES["Llama-3.2-1B"].head_dim == 64
    assert not SHAPES["Llama-3.1-8B"].tied_embeddings
    assert shape("meta-llama/Llama-3.2-3B") is SHAPES["Llama-3.2-3B"]
    with pytest.raises(ValueError, match="unknown shape"):
        shape("Llama-3.1-70B")


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Llama-3.1-8B"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_random_model_has_the_shape_in_the_dtype(name: str, dtype: torch.dtype) -> None:
    spec = SHAPES[name]
    model = random_model(name, layers=1, vocab=VOCAB, dtype=dtype)
    count = sum(p.numel() for p in model.parameters())
    assert count == spec.parameters(layers=1, vocab=VOCAB)
    assert weight_bytes(model) == count * (4 if dtype == torch.float32 else 2)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not any(p.is_meta for p in model.parameters())
    assert not model.training
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (spec.heads * spec.head_dim, spec.hidden)
    assert attention.k_proj.weight.shape == (spec.kv_heads * spec.head_dim, spec.hidden)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (spec.hidden, spec.intermediate)
    assert hasattr(attention, "q_norm") == spec.qk_norm
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == spec.tied_embeddings
    weight = attention.o_proj.weight.float()
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    # The rotary tables are computed, not left as uninitialised memory.
    rotary = model.model.rotary_emb
    fresh = type(rotary)(config=model.config)
    assert torch.equal(rotary.inv_freq, fresh.inv_freq)


def test_the_weights_follow_the_seed_not_the_depth() -> None:
    shallow = random_model("Qwen3-0.6B", layers=1, vocab=VOCAB, seed=3)
    deeper = random_model("Qwen3-0.6B", layers=2, vocab=VOCAB, seed=3)
    other = random_model("Qwen3-0.6B", layers=1, vocab=VOCAB, seed=4)
    first = shallow.state_dict()
    for key, value in first.items():
        assert torch.equal(value, deeper.state_dict()[key]), key
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"],
                           other.state_dict()["model.layers.0.mlp.up_proj.weight"])  # fmt: skip
    layer_one = deeper.state_dict()["model.layers.1.mlp.up_proj.weight"]
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], layer_one)


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Llama-3.1-8B"])  # tied / untied head
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_streamed_parameters_are_the_models(name: str, dtype: torch.dtype) -> None:
    """``random_parameters`` (the GGUF writer's source) yields the very numbers
    ``random_model`` holds, every parameter once, in the model's order."""
    model = random_model(name, layers=1, vocab=VOCAB, dtype=dtype, seed=2)
    streamed = list(random_parameters(name, layers=1, vocab=VOCAB, dtype=dtype, seed=2))
    expected = list(model.named_parameters())
    assert [n for n, _ in streamed] == [n for n, _ in expected]
    for (key, tensor), (_, parameter) in zip(streamed, expected, strict=True):
        assert tensor.dtype == dtype and torch.equal(tensor, parameter), key
    other = dict(random_parameters(name, layers=1, vocab=VOCAB, dtype=dtype, seed=3))
    assert not torch.equal(other["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_a_bfloat16_draw_is_the_float32_draw_rounded() -> None:
    """What lets one GGUF (converted from the float32 draws) stand for both dtypes' runs."""
    fp32 = dict(random_parameters("Qwen3-0.6B", layers=1, vocab=VOCAB))
    bf16 = dict(random_parameters("Qwen3-0.6B", layers=1, vocab=VOCAB, dtype=torch.bfloat16))
    for key, tensor in fp32.items():
        assert torch.equal(tensor.to(torch.bfloat16), bf16[key]), key


@functools.cache
def _engine(name: str, dtype: torch.dtype) -> SublayerEngine:
    return SublayerEngine(random_model(name, layers=2, vocab=VOCAB, dtype=dtype), progress=False)


def _forced(engine: SublayerEngine) -> SpeculativeDecoder:
    """The default knapsack planner with its search always on and drafts priced as free
    (``tests/test_lossless_drafting.py``'s forcing), so that rounds draft."""
    settings = DecoderConfig.from_dict(
        {"planner": {"name": "knapsack", "search_gate": "always", "max_planning_fraction": None}}
    )
    planner, _, _ = build_components(settings, engine)
    proxy_class = PROXIES.get("montecarlo")
    return SpeculativeDecoder(
        engine,
        settings,
        planner=planner,
        cost_model=CheapDraftCostModel(engine.num_layers),
        proxy=proxy_class.from_config(proxy_class.config_class(), engine),
    )


def _prompts() -> list[torch.Tensor]:
    """Two prompts that repeat a phrase (lookup drafts find it), of different lengths."""
    generator = torch.Generator().manual_seed(7)
    phrase = torch.randint(0, VOCAB, (6,), generator=generator)
    return [
        torch.cat([torch.randint(0, VOCAB, (5,), generator=generator), phrase, phrase]),
        torch.cat([phrase, torch.randint(0, VOCAB, (9,), generator=generator), phrase]),
    ]


@pytest.mark.parametrize("name", _shapes())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_speculative_output_equals_plain_decoding(name: str, dtype: torch.dtype) -> None:
    engine = _engine(name, dtype)
    assert engine.invariance is not None  # the exact engine, its kernels probed here
    plain = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    forced = _forced(engine)
    drafted = 0
    expected = []
    for prompt in _prompts():
        reference = plain.generate(prompt, max_new_tokens=NEW_TOKENS).tokens
        result = forced.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.tokens, reference), f"{name} {dtype}: differs from plain"
        drafted += result.stats.drafted_tokens
        expected.append(reference)
    assert drafted > 0, "nothing was drafted: this run says nothing about speculation"
    batch = forced.generate_batch([p.tolist() for p in _prompts()], max_new_tokens=NEW_TOKENS)
    for row, reference in enumerate(expected):
        assert torch.equal(torch.as_tensor(batch.tokens[row]), reference), f"batch row {row}"


def test_a_shape_by_object_builds_too() -> None:
    spec: ModelShape = SHAPES["Llama-3.2-1B"]
    model = random_model(spec, layers=1, vocab=64, dtype=torch.bfloat16)
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.config.num_hidden_layers == 1 and model.config.vocab_size == 64
