"""Tree verification keeps the exactness contract: one pass over a token tree, then the
cache compacted to one root-to-node path, gives logits and K/V bitwise equal to one-token
steps along that path, in float32 and bfloat16, for Llama, Qwen3 and Gemma 3 (its sliding
window crossed), on the compiled kernel's tree mode and on its fallback alike.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import row_attention
from knapspec.model.kernels.row_attention import attend_rows, attend_tree_rows
from knapspec.model.passes.tree import tree_layout
from knapspec.testing.exactness import tree_mismatches
from knapspec.testing.models import tiny_model

FAMILIES = ("llama", "qwen3", "gemma3")
DTYPES = (torch.float32, torch.bfloat16)
VOCAB = 97


@functools.cache
def _engine(family: str, dtype: torch.dtype, exact: bool = True) -> SublayerEngine:
    model = tiny_model(family).to(dtype)
    return SublayerEngine(model, exact=exact, kernels=None if exact else "f.linear")


def _tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def _random_parents(size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)]


def _signed(mask: int) -> int:
    """A 64-bit mask as the int64 holding the same bits."""
    return mask - (1 << 64) if mask >> 63 else mask


# ------------------------------------------------------------------------- the kernel
def _packed_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix: int,
    mask: int,
    scale: float,
) -> torch.Tensor:
    """``attend_rows`` for one query row ``(H, 1, hd)`` over its visible keys, copied to
    the front of a cache-like buffer with spare slots (as after compaction)."""
    index = torch.tensor(
        [*range(prefix), *(prefix + t for t in range(64) if mask >> t & 1)], dtype=torch.int64
    )
    length = index.numel()
    buffer_keys = torch.zeros(keys.shape[0], length + 9, keys.shape[2], dtype=keys.dtype)
    buffer_values = torch.zeros_like(buffer_keys)
    buffer_keys[:, :length] = keys[:, index]
    buffer_values[:, :length] = values[:, index]
    return attend_rows(
        query,
        buffer_keys[:, :length],
        buffer_values[:, :length],
        torch.tensor([length]),
        scale,
    )


@given(
    dtype=st.sampled_from(DTYPES),
    heads=st.sampled_from([(4, 2), (6, 3), (4, 4), (2, 1)]),
    head_dim=st.sampled_from([8, 16, 24, 64]),
    rows=st.integers(1, 20),
    prefix=st.integers(0, 200),
    width=st.integers(1, 64),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
)
def test_the_tree_kernel_equals_the_contiguous_kernel_on_packed_keys(
    dtype: torch.dtype,
    heads: tuple[int, int],
    head_dim: int,
    rows: int,
    prefix: int,
    width: int,
    density: float,
    seed: int,
) -> None:
    query_heads, kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    n_keys = prefix + width
    query = torch.randn(query_heads, rows, head_dim, generator=generator).to(dtype)
    # Views of wider buffers, as the cache's keys are.
    keys = torch.randn(kv_heads, n_keys + 5, head_dim, generator=generator).to(dtype)[:, :n_keys]
    values = torch.randn(kv_heads, n_keys + 5, head_dim, generator=generator).to(dtype)[:, :n_keys]
    prefixes, masks = [], []
    for _ in range(rows):
        first = int(torch.randint(0, prefix + 1, (1,), generator=generator))
        bits = torch.rand(min(64, n_keys - first), generator=generator) < density
        mask = sum(1 << t for t in range(bits.numel()) if bits[t])
        if first == 0 and mask == 0:
            mask = 1
        prefixes.append(first)
        masks.append(mask)
    scale = head_dim**-0.5
    together = attend_tree_rows(
        query,
        keys,
        values,
        torch.tensor(prefixes),
        torch.tensor([_signed(m) for m in masks]),
        scale,
    )
    for i in range(rows):
        expected = _packed_reference(
            query[:, i : i + 1], keys, values, prefixes[i], masks[i], scale
        )
        assert torch.equal(together[:, i : i + 1], expected), f"row {i}"


@pytest.mark.parametrize("threads", [2, 4])
def test_tree_rows_split_over_threads_are_unchanged(threads: int) -> None:
    """Three K/V heads over 2 or 4 threads: tasks take a K/V head's rows in chunks (7 rows,
    across query positions, with 4), each reading its rows' visibility at ``row % q``."""
    generator = torch.Generator().manual_seed(11)
    rows, start = 13, 40
    query = torch.randn(6, rows, 16, generator=generator)
    keys = torch.randn(3, start + rows, 16, generator=generator)
    values = torch.randn(3, start + rows, 16, generator=generator)
    tree = tree_layout(_random_parents(rows, 4), start, rows)
    alone = attend_tree_rows(query, keys, values, tree.prefix, tree.visible, 0.25)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        split = attend_tree_rows(query, keys, values, tree.prefix, tree.visible, 0.25)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(split, alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_full_tree_mask_is_the_contiguous_kernel(dtype: torch.dtype) -> None:
    """Rows that see every key up to their own are the causal rows of ``attend_rows``
    (including bit 63, the int64 sign bit)."""
    generator = torch.Generator().manual_seed(7)
    start, rows = 37, 64
    query = torch.randn(4, rows, 16, generator=generator).to(dtype)
    keys = torch.randn(2, start + rows, 16, generator=generator).to(dtype)
    values = torch.randn(2, start + rows, 16, generator=generator).to(dtype)
    masks = torch.tensor([_signed((1 << (i + 1)) - 1) for i in range(rows)])
    tree = attend_tree_rows(query, keys, values, torch.full((rows,), start), masks, 0.25)
    causal = attend_rows(query, keys, values, torch.arange(start + 1, start + rows + 1), 0.25)
    assert torch.equal(tree, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fallback_tree_attention_equals_its_packed_rows(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_attention, "load_library", lambda: None)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(6, 5, 16, generator=generator).to(dtype)
    keys = torch.randn(3, 90, 16, generator=generator).to(dtype)[:, :80]
    values = torch.randn(3, 90, 16, generator=generator).to(dtype)[:, :80]
    prefixes = [20, 0, 16, 5, 3]
    masks = [0b1011, 0b1, (1 << 64) - 1, 0, 1 << 63 | 1 << 40]
    together = attend_tree_rows(
        query, keys, values, torch.tensor(prefixes), torch.tensor([_signed(m) for m in masks]), 0.3
    )
    for i in range(5):
        expected = _packed_reference(query[:, i : i + 1], keys, values, prefixes[i], masks[i], 0.3)
        assert torch.equal(together[:, i : i + 1], expected), f"row {i}"


def test_tree_rows_that_reach_past_the_keys_are_refused() -> None:
    query = torch.randn(2, 2, 8)
    keys = values = torch.randn(1, 10, 8)
    with pytest.raises(ValueError, match="row 1"):
        attend_tree_rows(query, keys, values, torch.tensor([2, 8]), torch.tensor([1, 0b100]), 1.0)
    with pytest.raises(ValueError, match="at least one visible key"):
        attend_tree_rows(query, keys, values, torch.tensor([0, 0]), torch.tensor([1, 0]), 1.0)
    with pytest.raises(ValueError, match="one entry per query row"):
        attend_tree_rows(query, keys, values, torch.tensor([0]), torch.tensor([1]), 1.0)


# ------------------------------------------------------------------------- the engine
def _tree_mismatches(
    engine: SublayerEngine,
    context: torch.Tensor,
    tokens: torch.Tensor,
    parents: list[int],
    node: int,
) -> list[str]:
    """:func:`tree_mismatches` with one following token drawn from ``node``."""
    return tree_mismatches(engine, context, tokens, parents, node, _tokens(1, node))


@given(
    family=st.sampled_from(FAMILIES),
    dtype=st.sampled_from(DTYPES),
    context=st.integers(1, 60),
    size=st.integers(1, 64),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
def test_a_verified_tree_compacted_to_a_path_equals_one_token_steps(
    family: str,
    dtype: torch.dtype,
    context: int,
    size: int,
    seed: int,
    data: st.DataObject,
) -> None:
    engine = _engine(family, dtype)
    node = data.draw(st.integers(0, size - 1), label="accepted node")
    parents = _random_parents(size, seed)
    problems = _tree_mismatches(
        engine, _tokens(context, seed), _tokens(size, seed + 1), parents, node
    )
    assert problems == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_deepest_node_of_a_64_token_chain(dtype: torch.dtype) -> None:
    """Node 63 sees bit 63 (the int64 sign bit) of its mask."""
    parents = [-1, *range(63)]
    assert (
        _tree_mismatches(_engine("qwen3", dtype), _tokens(9, 1), _tokens(64, 2), parents, 63) == []
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fallback_attention_keeps_tree_verification_exact(
    family: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(row_attention, "load_library", lambda: None)
    engine = _engine(family, dtype)
    parents = _random_parents(12, 5)
    for node in (0, 7, 11):
        assert _tree_mismatches(engine, _tokens(23, 4), _tokens(12, 6), parents, node) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_chain_is_a_plain_forward(family: str, dtype: torch.dtype) -> None:
    engine = _engine(family, dtype)
    context, tokens = _tokens(17, 8), _tokens(10, 9)
    results = []
    for tree in (True, False):
        cache = engine.new_cache(32)
        engine.forward(context, 0, cache, all_logits=False)
        if tree:
            parents = [-1, *range(9)]
            results.append(engine.forward_tree(tokens, 17, parents, cache, capture_points=True))
        else:
            results.append(engine.forward(tokens, 17, cache, capture_points=True))
    ours, theirs = results
    assert torch.equal(ours.logits, theirs.logits)
    assert torch.equal(ours.hidden, theirs.hidden)
    assert ours.points is not None and theirs.points is not None
    assert ours.points.shape == (2 * engine.num_layers + 1, 10, engine.hidden_size)
    assert torch.equal(ours.points, theirs.points)


def test_an_inexact_engine_attends_through_a_tree_mask() -> None:
    """Without the contract the tree runs one masked SDPA call: the same attention, up to
    rounding."""
    exact, inexact = _engine("llama", torch.float32), _engine("llama", torch.float32, False)
    parents = _random_parents(9, 2)
    outputs = []
    for engine in (exact, inexact):
        cache = engine.new_cache(32)
        engine.forward(_tokens(14, 3), 0, cache, all_logits=False)
        outputs.append(engine.forward_tree(_tokens(9, 4), 14, parents, cache).logits)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)


def test_a_tree_attended_in_one_sdpa_call_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: tree attention as one masked SDPA call in an otherwise exact engine. On
    this machine's float32 it rounds differently from one-token steps; the check sees it
    (this is the check that it can)."""
    from knapspec.model import engine as engine_module

    calls: list[int] = []

    def one_call(
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        prefix: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        calls.append(query.shape[1])
        start, size = int(prefix[0]), query.shape[1]
        bits = (visible.unsqueeze(1) >> torch.arange(size)) & 1
        mask = torch.cat([torch.ones(size, start, dtype=torch.bool), bits.bool()], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out[0]

    monkeypatch.setattr(engine_module, "attend_tree_rows", one_call)
    engine = _engine("llama", torch.float32)
    # The mutant sits in the general path; the lean pass (bitwise that path, see
    # tests/test_exact_pass.py) would not call it.
    parents = _random_parents(12, 3)
    with engine.use_paths(lean_passes=False):
        problems = _tree_mismatches(engine, _tokens(30, 1), _tokens(12, 2), parents, 11)
    assert calls, "the mutant tree attention never ran"
    assert problems


@pytest.mark.parametrize(
    ("parents", "size", "message"),
    [
        ([0, 0, 1], 3, "parents\\[0\\] must be -1"),
        ([-1, 0, 2], 3, "parents\\[2\\] = 2"),
        ([-1, 0, -1], 3, "parents\\[2\\] = -1"),
        ([-1, 5], 2, "parents\\[1\\] = 5"),
        ([-1, 0], 3, "2 entries for 3 tokens"),
        (torch.tensor([[-1, 0]]), 2, "1-D integer tensor"),
        (torch.tensor([-1.0, 0.0]), 2, "1-D integer tensor"),
        ([-1, *range(64)], 65, "1 to 64 tokens"),
    ],
)
def test_malformed_trees_are_refused(parents: object, size: int, message: str) -> None:
    engine = _engine("llama", torch.float32)
    cache = engine.new_cache(80)
    engine.forward(_tokens(5, 0), 0, cache, all_logits=False)
    with pytest.raises(ValueError, match=message):
        engine.forward_tree(_tokens(size, 1), 5, parents, cache)  # type: ignore[arg-type]
    assert cache.lengths == [5] * engine.num_layers  # nothing written


# -------------------------------------------------------------------------- the cache
def _filled_cache(length: int) -> KVCache:
    cache = KVCache(2, 2, 4, 8, dtype=torch.float32, device=torch.device("cpu"))
    for layer in range(2):
        positions = torch.arange(length, dtype=torch.float32) + 100 * layer
        keys = positions[None, :, None].expand(2, length, 4)
        cache.write(layer, 0, keys, -keys)
    return cache


def test_compact_moves_the_kept_slots_down() -> None:
    cache = _filled_cache(12)
    cache.compact(5, [0, 1, 4, 6])
    assert cache.lengths == [9, 9]
    for layer in range(2):
        expected = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 11], dtype=torch.float32) + 100 * layer
        assert torch.equal(cache.keys(layer)[0, :, 0], expected)
        assert torch.equal(cache.values(layer)[1, :, 3], -expected)


def test_compact_of_a_leading_run_only_sets_lengths() -> None:
    cache = _filled_cache(12)
    before = [cache.keys(layer, 12).clone() for layer in range(2)]
    cache.compact(5, [0, 1, 2])
    assert cache.lengths == [8, 8]
    for layer in range(2):
        assert torch.equal(cache.keys(layer, 12), before[layer])


@pytest.mark.parametrize("slots", [[], [1, 2], [0, 2, 2], [0, 3, 1], [0, 7]], ids=lambda s: str(s))
def test_compact_refuses_bad_slots(slots: list[int]) -> None:
    cache = _filled_cache(12)
    with pytest.raises(ValueError, match="slots"):
        cache.compact(5, slots)
    assert cache.lengths == [12, 12]
