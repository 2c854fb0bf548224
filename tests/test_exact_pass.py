"""The lean exact pass (:mod:`knapspec.model.passes.exact_pass`) against the general layer loop.

The lean pass only reorganises the Python around the kernels (per-pass work done once),
so every logit and every K/V entry must be bitwise what the general path writes, on every
layout a batched pass takes: equal widths, ragged packed widths, a layer-skipping mask,
float32 and bfloat16, Llama, Qwen2, Qwen3 (q/k norms), Mistral and Gemma 3 (a norm after
each sublayer, a rotary table per layer type, sliding windows crossed, GELU-tanh); where a
layer does not fit (weights replaced after fusion) it must step aside for that layer and
the results stay the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import attrs
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from knapspec import testing
from knapspec.model.batch_cache import BatchKVCache
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.table import FUSION_GROUPS
from knapspec.model.passes import exact_pass
from knapspec.model.passes.batched import forward_batch, new_batch_cache
from knapspec.model.passes.exact_pass import EnginePaths
from knapspec.types import SublayerMask
from pass_pairs import (
    VOCAB,
    assert_bitwise,
    assert_caches_equal,
    batched_both_ways,
    sequence_both_ways,
)
from tiny_models import tiny_model


def _engine(family: str = "llama", dtype: torch.dtype = torch.float32) -> SublayerEngine:
    """An exact engine on a tiny model that fuses q/k/v and gate/up at every row count (what
    the lean pass serves; the measured table of a tiny model on one thread may not), its
    lean passes running their items one by one (the compiled layer loop, which replaces
    them where it serves, is compared with them in ``test_layer_loop.py``)."""
    model = tiny_model(family, 3) if dtype == torch.float32 else _bf16_model(family)
    return _fusing(SublayerEngine(model, progress=False, paths=EnginePaths(compiled_loop=False)))


def _fusing(engine: SublayerEngine) -> SublayerEngine:
    table = engine.kernels
    fuse = {group: (True,) * table.max_rows for group in FUSION_GROUPS}
    engine.use_kernels(attrs.evolve(table, fuse=fuse))
    return engine


_BF16: dict[str, torch.nn.Module] = {}


def _bf16_model(family: str) -> torch.nn.Module:
    if family not in _BF16:
        _BF16[family] = testing.tiny_model(family, 3, 0).to(torch.bfloat16)
    return _BF16[family]


_ENGINES: dict[tuple[str, torch.dtype], SublayerEngine] = {}


def _cached_engine(family: str, dtype: torch.dtype) -> SublayerEngine:
    key = (family, dtype)
    if key not in _ENGINES:
        _ENGINES[key] = _engine(family, dtype)
    return _ENGINES[key]


Keep = Callable[[exact_pass.ExactLayerPass, torch.Tensor], bool]


@contextlib.contextmanager
def counting(keep: Keep = lambda lean, hidden: True) -> Iterator[list[str]]:
    """The items the lean pass ran (``"attention 0"``, ``"mlp 0"``, ...; not those it
    handed back to the general path), of the passes ``keep`` accepts."""
    ran: list[str] = []
    cls = exact_pass.ExactLayerPass
    originals = {"attention": cls.attention_item, "mlp": cls.mlp_item}

    def counted(kind: str) -> Callable[..., torch.Tensor | None]:
        def item(
            lean: exact_pass.ExactLayerPass, layer: int, hidden: torch.Tensor
        ) -> torch.Tensor | None:
            out = originals[kind](lean, layer, hidden)
            if out is not None and keep(lean, hidden):
                ran.append(f"{kind} {layer}")
            return out

        return item

    cls.attention_item, cls.mlp_item = counted("attention"), counted("mlp")  # type: ignore[method-assign]
    try:
        yield ran
    finally:
        cls.attention_item, cls.mlp_item = originals["attention"], originals["mlp"]  # type: ignore[method-assign]


def _batched(lean: exact_pass.ExactLayerPass, hidden: torch.Tensor) -> bool:
    """A batched pass (not the single-sequence prefills that fill the rows' caches)."""
    return isinstance(lean.cache, BatchKVCache)


def _attention(ran: list[str]) -> list[str]:
    return [item for item in ran if item.startswith("attention")]


def _every_layer(engine: SublayerEngine) -> list[str]:
    return [f"attention {layer}" for layer in range(engine.num_layers)]


@settings(max_examples=30, deadline=None)
@given(
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    ragged=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_lean_pass_writes_and_returns_bitwise_the_general_paths(
    widths: list[int], ragged: bool, bf16: bool, seed: int
) -> None:
    """Equal widths (padded layout) or ragged ones (products packed), float32 or bfloat16:
    the same logits and the same K/V buffers, bit for bit, and the lean pass ran every
    item of the pass (mutation check: a lean pass that rotated only the queries, or wrote
    a row's K/V one position off, fails here)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    engine = _cached_engine("llama", dtype)
    generator = torch.Generator().manual_seed(seed)
    contexts = [int(torch.randint(1, 30, (1,), generator=generator)) for _ in widths]
    if not ragged:
        widths = [max(widths)] * len(widths)
    inputs = torch.randint(0, VOCAB, (len(widths), max(widths)), generator=generator)
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(
            engine, "lean_passes", contexts, inputs, widths if ragged else None
        )
    assert_bitwise(logits, buffers)
    assert _attention(ran) == _every_layer(engine)


def test_a_layer_skipping_mask_runs_only_its_items_alike() -> None:
    """A draft step under a mask: the lean pass runs the executed items only, bitwise."""
    engine = _cached_engine("llama", torch.bfloat16)
    executed = [True, False, False, True, True, True]
    mask = SublayerMask(tuple(executed))
    inputs = torch.tensor([[5, 6], [7, 8]])
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(engine, "lean_passes", [4, 9], inputs, None, mask=mask)
    assert_bitwise(logits, buffers)
    assert ran == ["attention 0", "mlp 1", "attention 2", "mlp 2"]


def test_a_layer_whose_weights_were_replaced_takes_the_general_path() -> None:
    """Weights replaced after the engine fused them (a new ``nn.Parameter``): that layer's
    projections no longer alias the fused matrix, the lean pass hands the layer back, and
    the pass still equals the general one (which runs the replaced weights)."""
    model = testing.tiny_model("llama", 3, 0)
    engine = _fusing(SublayerEngine(model, progress=False, paths=EnginePaths(compiled_loop=False)))
    attention = engine.layers[1].self_attn
    attention.k_proj.weight = torch.nn.Parameter(attention.k_proj.weight.detach().clone() * 2)
    mlp = engine.layers[2].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach().clone())
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(
            engine, "lean_passes", [3, 6, 2], torch.tensor([[1], [2], [3]]), None
        )
    assert_bitwise(logits, buffers)
    assert ran == ["attention 0", "mlp 0", "mlp 1", "attention 2"]


def test_q_k_norms_take_the_lean_pass_and_inexact_engines_keep_the_general_path() -> None:
    """Qwen3's per-head q/k norms run compiled on every path, the lean pass's too: a ragged
    batched pass equals the general path through the lean pass at every layer; an inexact
    engine's batched passes and decode steps never take it."""
    engine = _cached_engine("qwen3", torch.float32)
    assert engine.has_qk_norm and engine.compiled_qk_norms
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(
            engine, "lean_passes", [3, 5], torch.tensor([[1, 2], [3, 4]]), [2, 1]
        )
    assert_bitwise(logits, buffers)
    assert _attention(ran) == _every_layer(engine)
    with counting() as ran:
        inexact = SublayerEngine(tiny_model("llama", 3), progress=False, exact=False)
        cache = new_batch_cache(inexact, 1, 8)
        forward_batch(inexact, torch.tensor([[1, 2]]), [0], cache)
        single = inexact.new_cache(8)
        inexact.forward(torch.tensor([1, 2]), 0, single, all_logits=False)
        inexact.forward(torch.tensor([3]), 2, single)  # a decode step, inexact: not lean
    assert ran == []


@settings(max_examples=20, deadline=None)
@given(
    context=st.integers(1, 30), width=st.integers(1, 6), bf16=st.booleans(), seed=st.integers(0, 99)
)
def test_a_sequences_decode_and_verify_steps_take_the_lean_pass_bitwise(
    context: int, width: int, bf16: bool, seed: int
) -> None:
    """:meth:`SublayerEngine.forward` of a decode step or a verification after a prefill:
    the same logits and the same K/V and lengths in every layer as the general path, and
    the lean pass ran its attention items (a prefill from position 0 does not)."""
    engine = _cached_engine("llama", torch.bfloat16 if bf16 else torch.float32)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context,), generator=generator)
    step = torch.randint(0, VOCAB, (width,), generator=generator)
    with counting() as ran:
        outputs, caches = sequence_both_ways(
            engine, "lean_passes", prompt, lambda cache: engine.forward(step, context, cache)
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert caches[0].lengths == [context + width] * engine.num_layers
    assert_caches_equal(caches)
    # The prefill ran the general path (position 0, several tokens) unless it was one token.
    assert _attention(ran) == _every_layer(engine) * (2 if context == 1 else 1)


def test_a_sequences_gap_is_refused_on_the_lean_pass_too() -> None:
    """A step past a layer's length raises the cache's gap error before anything is read."""
    engine = _cached_engine("llama", torch.float32)
    cache = engine.new_cache(16)
    engine.forward(torch.tensor([1, 2, 3]), 0, cache, all_logits=False)
    with pytest.raises(RuntimeError, match="KV cache gap at layer 0"):
        engine.forward(torch.tensor([4]), 5, cache)
    assert cache.lengths == [3] * engine.num_layers
    engine.forward(torch.tensor([4]), 3, cache)  # the engine still works
    assert cache.lengths == [4] * engine.num_layers


@settings(max_examples=20, deadline=None)
@given(
    context=st.integers(1, 30),
    parents=st.lists(st.integers(0, 10), min_size=0, max_size=8),
    bf16=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_token_tree_takes_the_lean_pass_bitwise(
    context: int, parents: list[int], bf16: bool, seed: int
) -> None:
    """:meth:`SublayerEngine.forward_tree` (node ``i`` written at slot ``start + i``, rotated
    at its depth, seeing its ancestors): the same logits, K/V and lengths as the general
    path, through the lean pass for every layer."""
    engine = _cached_engine("llama", torch.bfloat16 if bf16 else torch.float32)
    tree = [-1] + [min(parent, node) for node, parent in enumerate(parents)]
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context + 1,), generator=generator)
    nodes = torch.randint(0, VOCAB, (len(tree),), generator=generator)
    with counting() as ran:  # the prefills are not lean (position 0, several tokens)
        outputs, caches = sequence_both_ways(
            engine,
            "lean_passes",
            prompt,
            lambda cache: engine.forward_tree(nodes, context + 1, tree, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert _attention(ran) == _every_layer(engine)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_take_the_lean_pass_bitwise(family: str) -> None:
    """Qwen2 (biases on q/k/v, through the fused product's bias) and Mistral: a ragged
    batched pass and a sequence's verification equal the general path, through the lean
    pass at every layer."""
    engine = _cached_engine(family, torch.bfloat16)
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(
            engine, "lean_passes", [2, 7, 4], torch.tensor([[1, 2, 3]] * 3), [3, 1, 2]
        )
    assert_bitwise(logits, buffers)
    assert _attention(ran) == _every_layer(engine)
    with counting() as ran:
        outputs, _ = sequence_both_ways(
            engine,
            "lean_passes",
            torch.tensor([4, 5, 6]),
            lambda cache: engine.forward(torch.tensor([7, 8]), 3, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert _attention(ran) == _every_layer(engine)


# ------------------------------------------------------------------------------ Gemma 3
#: Gemma's tiny model attends over a window of 8 tokens on its first two layers.
GEMMA_WINDOW = 8


@settings(max_examples=15, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    ragged=st.booleans(),
    bf16=st.booleans(),
)
@example(contexts=[30, 2, 7], widths=[6, 1, 2], ragged=True, bf16=False)  # inside and past
@example(contexts=[12, 20], widths=[3, 3, 3], ragged=False, bf16=True)
def test_gemma3_takes_the_lean_pass_bitwise_across_the_window(
    contexts: list[int], widths: list[int], ragged: bool, bf16: bool
) -> None:
    """Gemma 3 (norms after each sublayer, q/k norms, a rotary table per layer type,
    GELU-tanh, sliding layers whose rows inside the window share the pass's call and rows
    past it are attended alone): a batched pass and a sequence's verification equal the
    general path bit for bit, through the lean pass at every layer."""
    engine = _cached_engine("gemma3", torch.bfloat16 if bf16 else torch.float32)
    widths = widths[: len(contexts)] if ragged else [max(widths)] * len(contexts)
    inputs = torch.tensor([[1 + row, 2, 3, 4, 5, 6][: max(widths)] for row in range(len(widths))])
    with counting(_batched) as ran:
        logits, buffers = batched_both_ways(
            engine, "lean_passes", contexts, inputs, widths if ragged else None
        )
    assert_bitwise(logits, buffers)
    assert _attention(ran) == _every_layer(engine)
    prompt = torch.arange(contexts[0]) % VOCAB
    step = torch.arange(widths[0]) + 40
    with counting() as ran:
        outputs, caches = sequence_both_ways(
            engine, "lean_passes", prompt, lambda cache: engine.forward(step, contexts[0], cache)
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert _every_layer(engine)[0] in ran


@settings(max_examples=15, deadline=None)
@given(
    context=st.integers(1, 30),
    parents=st.lists(st.integers(0, 10), min_size=0, max_size=9),
    bf16=st.booleans(),
)
@example(context=20, parents=[0, 1, 0, 3, 2, 1, 6, 7, 8], bf16=False)  # deeper than the window
@example(context=4, parents=[0, 1, 2, 3, 4, 5], bf16=False)  # crosses it inside the tree
def test_a_gemma3_token_tree_takes_the_lean_pass_bitwise_across_the_window(
    context: int, parents: list[int], bf16: bool
) -> None:
    """A token tree on Gemma 3: where some node sees past the window every node is attended
    alone over its visible keys inside the window, as the general path gathers them."""
    engine = _cached_engine("gemma3", torch.bfloat16 if bf16 else torch.float32)
    tree = [-1] + [min(parent, node) for node, parent in enumerate(parents)]
    prompt = torch.arange(context + 1) % VOCAB
    nodes = torch.arange(len(tree)) + 50
    with counting() as ran:
        outputs, caches = sequence_both_ways(
            engine,
            "lean_passes",
            prompt,
            lambda cache: engine.forward_tree(nodes, context + 1, tree, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert _attention(ran)[-engine.num_layers :] == _every_layer(engine)


@pytest.mark.parametrize("check", ["batch", "tree"])
def test_a_lean_pass_that_forgets_the_window_is_caught(
    check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power: without the rows past the window attended alone (every row in the shared
    call, over all its keys) the lean pass leaves the general path's logits."""
    engine = _cached_engine("gemma3", torch.float32)
    monkeypatch.setattr(exact_pass, "windowed_rows", lambda *args, **kwargs: None)
    if check == "batch":
        logits, _ = batched_both_ways(
            engine, "lean_passes", [20, 3], torch.tensor([[1, 2], [3, 4]]), None
        )
    else:
        outputs, _ = sequence_both_ways(
            engine,
            "lean_passes",
            torch.arange(21),
            lambda cache: engine.forward_tree(torch.tensor([1, 2, 3]), 21, [-1, 0, 0], cache),
        )
        logits = [output.logits for output in outputs]
    assert not torch.equal(logits[0], logits[1])
