"""The sublayer engine against the model's own forward, on every supported family."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests.tiny_models import FAMILIES, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from knapspec.model import ContextLengthError, KVCache, SublayerEngine, UnsupportedModelError
from knapspec.types import SublayerMask


@pytest.mark.parametrize("family", FAMILIES)
def test_full_mask_matches_model_forward_in_chunks(family: str) -> None:
    model = tiny_model(family)
    engine = SublayerEngine(model)
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(ids.unsqueeze(0)).logits[0]
    cache = engine.new_cache(8)  # forces the cache to grow
    chunks = [(0, 10), (10, 11), (11, 17), (17, 24)]
    logits = torch.cat([engine.forward(ids[a:b], a, cache).logits for a, b in chunks])
    torch.testing.assert_close(logits, reference, atol=2e-5, rtol=1e-4)
    assert cache.lengths == [24] * engine.num_layers


def _manual_masked_forward(
    model: torch.nn.Module, ids: torch.Tensor, mask: SublayerMask
) -> torch.Tensor:
    """Oracle: the model's own layer modules called one by one with skipped items as identity.

    Uses transformers' attention (with its causal mask on the full sequence) — an independent
    implementation of "run only the items of ``mask``".
    """
    backbone = model.model
    hidden = backbone.embed_tokens(ids.unsqueeze(0))
    positions = torch.arange(ids.numel()).unsqueeze(0)
    cos_sin = backbone.rotary_emb(hidden, positions)
    causal = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).tril()[None, None]
    for index, layer in enumerate(backbone.layers):
        if mask.attention(index):
            attn, _ = layer.self_attn(
                layer.input_layernorm(hidden), position_embeddings=cos_sin, attention_mask=causal
            )
            hidden = hidden + attn
        if mask.mlp(index):
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(backbone.norm(hidden))[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@given(skip=st.lists(st.booleans(), min_size=6, max_size=6))
def test_masked_forward_matches_layer_by_layer_oracle(family: str, skip: list[bool]) -> None:
    model = tiny_model(family)
    engine = SublayerEngine(model)
    mask = SublayerMask(tuple(not s for s in skip))
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = _manual_masked_forward(model, ids, mask)
    cache = engine.new_cache()
    got = torch.cat(
        [
            engine.forward(ids[:7], 0, cache, mask).logits,
            engine.forward(ids[7:], 7, cache, mask).logits,
        ]
    )
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    for layer in range(engine.num_layers):
        assert cache.lengths[layer] == (12 if mask.attention(layer) else 0)


def test_capture_points_are_the_residual_stream_at_every_item() -> None:
    model = tiny_model("llama")
    engine = SublayerEngine(model)
    ids = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(3))
    out = engine.forward(ids, 0, engine.new_cache(), capture_points=True)
    assert out.points is not None
    assert out.points.shape == (2 * engine.num_layers + 1, 9, engine.hidden_size)
    with torch.no_grad():
        hidden_states = model(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    # transformers reports the stream after every whole layer (= after every MLP item); its
    # last entry is taken after the final norm.
    for layer in range(engine.num_layers - 1):
        torch.testing.assert_close(
            out.points[2 * layer + 2], hidden_states[layer + 1][0], atol=1e-5, rtol=1e-4
        )
    torch.testing.assert_close(
        engine.final_norm(out.points[-1]), hidden_states[-1][0], atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(out.points[0], hidden_states[0][0])
    last = engine.forward(ids, 0, engine.new_cache(), capture_points=True, capture_last=3)
    assert last.points is not None
    torch.testing.assert_close(last.points, out.points[:, -3:])


@given(
    branches=st.integers(1, 5),
    window=st.integers(1, 6),
    item=st.integers(0, 5),
    seed=st.integers(0, 100),
)
def test_run_item_on_branches_equals_each_branch_alone(
    branches: int, window: int, item: int, seed: int
) -> None:
    model = tiny_model("llama")
    engine = SublayerEngine(model)
    generator = torch.Generator().manual_seed(seed)
    prefix = 10
    cache = engine.new_cache()
    engine.forward(torch.randint(0, 97, (prefix,), generator=generator), 0, cache)
    snapshot = [cache.keys(i).clone() for i in range(engine.num_layers)]
    hidden = torch.randn(branches, window, engine.hidden_size, generator=generator)
    positions = torch.arange(prefix, prefix + window)
    together = engine.run_item(item, hidden, positions, cache, prefix)
    for b in range(branches):
        alone = engine.run_item(item, hidden[b : b + 1], positions, cache, prefix)
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-5, rtol=1e-4)
    assert cache.lengths == [prefix] * engine.num_layers
    for layer in range(engine.num_layers):
        assert torch.equal(cache.keys(layer), snapshot[layer])


def _with_points(
    family: str, length: int, seed: int
) -> tuple[SublayerEngine, torch.Tensor, KVCache, torch.Tensor]:
    """A tiny model's engine, ``length`` random ids, the cache after a full forward over
    them, and that forward's residual points ``(2L + 1, length, d)``."""
    engine = SublayerEngine(tiny_model(family))
    ids = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(seed))
    cache = engine.new_cache()
    points = engine.forward(ids, 0, cache, capture_points=True).points
    assert points is not None
    return engine, ids, cache, points


def test_run_item_attention_equals_a_cached_forward_of_that_item() -> None:
    """A branch window through run_item == writing the window to a cache copy and attending."""
    engine, _, cache, points = _with_points("qwen3", 14, seed=4)
    prefix, window = 9, 5
    cache.crop(prefix)
    for item in range(engine.num_items):
        got = engine.run_item(
            item, points[item, prefix:].unsqueeze(0), torch.arange(prefix, 14), cache, prefix
        )
        torch.testing.assert_close(got[0], points[item + 1, prefix:], atol=2e-5, rtol=1e-4)
    assert window == 14 - prefix


def test_step_item_chain_is_forward_item_by_item_and_writes_the_cache() -> None:
    """step_item over all items in order == forward's residual points, same cache writes."""
    engine, ids, reference_cache, points = _with_points("llama", 12, seed=6)
    prefix = 9
    cache = engine.new_cache()
    engine.forward(ids[:prefix], 0, cache)
    positions = torch.arange(prefix, 12)
    hidden = engine.embed_tokens(ids[prefix:]).unsqueeze(0)
    rotary = engine.rotary(positions, hidden)
    for item in range(engine.num_items):
        hidden = engine.step_item(item, hidden, prefix, cache, rotary)
        torch.testing.assert_close(hidden[0], points[item + 1, prefix:], atol=2e-5, rtol=1e-4)
    assert cache.lengths == [12] * engine.num_layers
    for layer in range(engine.num_layers):
        torch.testing.assert_close(cache.keys(layer), reference_cache.keys(layer))
        torch.testing.assert_close(cache.values(layer), reference_cache.values(layer))
    # A step past the cached prefix is a gap, refused; an out-of-range item too.
    with pytest.raises(RuntimeError, match="gap"):
        engine.step_item(0, hidden[:, :1], 14, cache, engine.rotary(torch.tensor([14]), hidden))
    with pytest.raises(ValueError, match="out of range"):
        engine.step_item(engine.num_items, hidden, prefix, cache, rotary)


def test_run_masks_matches_forward_with_each_mask() -> None:
    engine, ids, cache, points = _with_points("llama", 16, seed=5)
    masks = [
        SublayerMask.full(3),
        SublayerMask.from_skipped(3, [1, 4]),
        SublayerMask.from_skipped(3, [0, 2, 3]),
    ]
    prefix = 11
    cache.crop(prefix)
    got = engine.run_masks(masks, points[0, prefix:], torch.arange(prefix, 16), cache, prefix)
    for b, mask in enumerate(masks):
        # The oracle: prefix from the full model, window run with the mask, as one forward.
        oracle_cache = engine.new_cache()
        engine.forward(ids[:prefix], 0, oracle_cache)
        # Skipped attention layers must still see the full model's prefix for later layers,
        # so run the window over a copy of the full prefix cache.
        out = engine.forward(ids[prefix:], prefix, oracle_cache, mask)
        torch.testing.assert_close(got[b], out.hidden, atol=2e-5, rtol=1e-4)


def test_unsupported_architectures_are_refused_with_the_supported_list() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        SublayerEngine(gpt2)
    sliding = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=50,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
    )
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        SublayerEngine(Qwen3ForCausalLM(sliding))


def test_wrong_mask_length_and_context_overflow_are_clear_errors() -> None:
    engine = SublayerEngine(tiny_model("llama"))
    cache = engine.new_cache()
    with pytest.raises(ValueError, match="mask has 4 items but the model has 6"):
        engine.forward(torch.tensor([1, 2]), 0, cache, SublayerMask.full(2))
    with pytest.raises(ContextLengthError, match="exceeds the model's context of 256"):
        engine.forward(torch.zeros(257, dtype=torch.long), 0, cache)
    with pytest.raises(ValueError, match="non-empty"):
        engine.forward(torch.tensor([], dtype=torch.long), 0, cache)


def test_cache_refuses_gaps_and_crops_by_pointer() -> None:
    engine = SublayerEngine(tiny_model("llama"))
    cache = engine.new_cache()
    engine.forward(torch.tensor([1, 2, 3, 4]), 0, cache)
    keys_before = cache.keys(0).clone()
    cache.crop(2)
    assert cache.lengths == [2, 2, 2]
    torch.testing.assert_close(cache.keys(0), keys_before[:, :2])
    with pytest.raises(RuntimeError, match="gap"):
        engine.forward(torch.tensor([5]), 3, cache)
