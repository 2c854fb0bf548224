"""The compiled layer loop (:mod:`knapspec.model.layer_loop`) against the lean items it
replaces.

The loop calls the same kernels with the same arguments as the lean pass's items and does
the steps between them (residual adds, SiLU times up) as PyTorch does them in bfloat16, so
every logit and every K/V entry must be bitwise the items': batched passes with equal or
ragged widths, a sequence's decode and verification steps, token trees, Llama, Qwen2
(biases) and Mistral; and where it does not serve (float32, a layer-skipping mask, captured
hidden states, weights changed after it was planned) it must step aside or re-plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec import testing
from knapspec.model import layer_loop, row_linear
from knapspec.model.batched import forward_batch, new_batch_cache
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import AMX_KERNEL, FUSION_GROUPS, PACKED_KERNEL
from knapspec.types import SublayerMask

VOCAB = 97


def _packed_kernel() -> str | None:
    if row_linear.packed_available():
        return PACKED_KERNEL
    if row_linear.amx_available():
        return AMX_KERNEL
    return None


needs_kernels = pytest.mark.skipif(
    _packed_kernel() is None or layer_loop.LIBRARY.load() is None,
    reason="the loop calls the packed bfloat16 products: this CPU has neither AVX512-BF16 "
    "nor AMX tiles (or no C compiler)",
)

_ENGINES: dict[str, SublayerEngine] = {}


def _engine(family: str = "llama") -> SublayerEngine:
    """An exact bfloat16 engine on a tiny model whose every product runs the packed kernel
    and fuses q/k/v and gate/up at every row count (what the loop serves; the measured
    table of a tiny model may choose others)."""
    if family not in _ENGINES:
        model = testing.tiny_model(family, 3, 0).to(torch.bfloat16)
        engine = SublayerEngine(model, progress=False)
        table = engine.kernels
        name = _packed_kernel()
        assert name is not None
        shapes = {*table.choices, *table.large}
        engine.use_kernels(
            attrs.evolve(
                table,
                choices={shape: (name,) * table.max_rows for shape in shapes},
                large=dict.fromkeys(shapes, name),
                fuse={group: (True,) * table.max_rows for group in FUSION_GROUPS},
            )
        )
        _ENGINES[family] = engine
    return _ENGINES[family]


@contextlib.contextmanager
def looped() -> Iterator[list[int]]:
    """The token counts of the passes the compiled loop ran (not those it declined)."""
    ran: list[int] = []
    original = layer_loop.run_layers

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        out = original(*args, **kwargs)  # type: ignore[arg-type]
        if out is not None:
            ran.append(out.numel() // out.shape[-1])
        return out

    layer_loop.run_layers = counted  # type: ignore[assignment]
    try:
        yield ran
    finally:
        layer_loop.run_layers = original  # type: ignore[assignment]


def _batched_both_ways(
    engine: SublayerEngine,
    contexts: list[int],
    inputs: torch.Tensor,
    widths: list[int] | None,
    mask: SublayerMask | None = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Logits and every layer's K/V buffers of one batched pass, loop then items."""
    logits, buffers = [], []
    for on in (True, False):
        cache = new_batch_cache(engine, len(contexts), 48)
        for row, context in enumerate(contexts):
            single = engine.new_cache(48)
            prompt = torch.randint(
                0, VOCAB, (context,), generator=torch.Generator().manual_seed(row)
            )
            engine.forward(prompt, 0, single, all_logits=False)
            cache.load_row(row, single, context)
        engine.compiled_loop = on
        try:
            logits.append(forward_batch(engine, inputs, contexts, cache, widths=widths, mask=mask))
        finally:
            engine.compiled_loop = True
        buffers.append([b for layer in range(engine.num_layers) for b in cache.buffers(layer)])
    return logits, buffers


def _assert_bitwise(logits: list[torch.Tensor], buffers: list[list[torch.Tensor]]) -> None:
    assert torch.equal(logits[0], logits[1])
    for on, off in zip(*buffers, strict=True):
        assert torch.equal(on, off)


def test_the_silu_table_holds_pytorchs_vector_path_and_refuses_other_layouts() -> None:
    """The table is ``F.silu`` of every bfloat16 pattern as the layer computes it (rows of
    gates read from a fused output); a width PyTorch finishes on its scalar path, which
    rounds some inputs otherwise, is refused rather than served wrongly."""
    table = layer_loop.silu_table(1536)
    assert table is not None and table.shape == (65536,)
    gates = torch.randn(7, 2 * 1536).to(torch.bfloat16)[:, :1536]
    expected = F.silu(gates).view(torch.int16)
    looked_up = table.view(torch.int16)[gates.contiguous().view(torch.int16).long() & 0xFFFF]
    assert torch.equal(looked_up, expected)
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    one_at_a_time = torch.stack([F.silu(patterns[i : i + 1])[0] for i in range(0, 65536, 7)])
    if not torch.equal(one_at_a_time.view(torch.int16), table.view(torch.int16)[::7]):
        assert layer_loop.silu_table(1) is None  # the scalar path differs: width 1 refused


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    ragged=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_batched_pass_through_the_loop_is_bitwise_its_items(
    widths: list[int], ragged: bool, seed: int
) -> None:
    """Equal widths (padded layout) or ragged ones (packed tokens, zero padding queries):
    the same logits and K/V buffers bit for bit, and the loop ran the pass (mutation
    check: a loop that rotated only the queries or skipped the value write fails here)."""
    engine = _engine()
    generator = torch.Generator().manual_seed(seed)
    contexts = [int(torch.randint(1, 30, (1,), generator=generator)) for _ in widths]
    if not ragged:
        widths = [max(widths)] * len(widths)
    inputs = torch.randint(0, VOCAB, (len(widths), max(widths)), generator=generator)
    with looped() as ran:
        logits, buffers = _batched_both_ways(engine, contexts, inputs, widths if ragged else None)
    _assert_bitwise(logits, buffers)
    assert sum(widths) in ran


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(context=st.integers(1, 30), width=st.integers(1, 6), seed=st.integers(0, 99))
def test_a_sequences_steps_through_the_loop_are_bitwise_its_items(
    context: int, width: int, seed: int
) -> None:
    """A decode step or a verification after a prefill: the same logits, K/V and lengths in
    every layer as the items, through the loop."""
    engine = _engine()
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context,), generator=generator)
    step = torch.randint(0, VOCAB, (width,), generator=generator)
    outputs, caches = [], []
    with looped() as ran:
        try:
            for on in (True, False):
                engine.compiled_loop = on
                cache = engine.new_cache(16)  # grows during the step
                engine.forward(prompt, 0, cache, all_logits=False)
                outputs.append(engine.forward(step, context, cache))
                caches.append(cache)
        finally:
            engine.compiled_loop = True
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].hidden, outputs[1].hidden)
    assert caches[0].lengths == caches[1].lengths == [context + width] * engine.num_layers
    for layer in range(engine.num_layers):
        assert torch.equal(caches[0].keys(layer), caches[1].keys(layer))
        assert torch.equal(caches[0].values(layer), caches[1].values(layer))
    assert width in ran


@needs_kernels
@settings(max_examples=15, deadline=None)
@given(
    context=st.integers(1, 30),
    parents=st.lists(st.integers(0, 10), min_size=0, max_size=8),
    seed=st.integers(0, 99),
)
def test_a_token_tree_through_the_loop_is_bitwise_its_items(
    context: int, parents: list[int], seed: int
) -> None:
    """:meth:`SublayerEngine.forward_tree`: node ``i`` at slot ``start + i``, seeing its
    ancestors: the same logits, K/V and lengths as the items."""
    engine = _engine()
    tree = [-1] + [min(parent, node) for node, parent in enumerate(parents)]
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context + 1,), generator=generator)
    nodes = torch.randint(0, VOCAB, (len(tree),), generator=generator)
    outputs, caches = [], []
    with looped() as ran:
        try:
            for on in (True, False):
                engine.compiled_loop = on
                cache = engine.new_cache(16)
                engine.forward(prompt, 0, cache, all_logits=False)
                outputs.append(engine.forward_tree(nodes, context + 1, tree, cache).logits)
                caches.append(cache)
        finally:
            engine.compiled_loop = True
    assert torch.equal(outputs[0], outputs[1])
    assert caches[0].lengths == caches[1].lengths
    for layer in range(engine.num_layers):
        assert torch.equal(caches[0].keys(layer), caches[1].keys(layer))
        assert torch.equal(caches[0].values(layer), caches[1].values(layer))
    assert len(tree) in ran


@needs_kernels
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_through_the_loop_are_bitwise_their_items(family: str) -> None:
    """Qwen2 (q/k/v biases, passed to the fused product) and Mistral: a ragged batched pass
    and a sequence's verification, through the loop, bitwise the items."""
    engine = _engine(family)
    with looped() as ran:
        logits, buffers = _batched_both_ways(
            engine, [2, 7, 4], torch.tensor([[1, 2, 3]] * 3), [3, 1, 2]
        )
    _assert_bitwise(logits, buffers)
    assert ran == [6]
    outputs = []
    with looped() as ran:
        for on in (True, False):
            engine.compiled_loop = on
            cache = engine.new_cache(16)
            engine.forward(torch.tensor([4, 5, 6]), 0, cache, all_logits=False)
            outputs.append(engine.forward(torch.tensor([7, 8]), 3, cache).logits)
        engine.compiled_loop = True
    assert torch.equal(outputs[0], outputs[1])
    assert ran == [2]


@needs_kernels
def test_a_mask_captured_points_and_float32_keep_the_items() -> None:
    """A layer-skipping draft pass, a step that captures the residual stream at every point
    and a float32 engine do not take the loop (their passes run the items)."""
    engine = _engine()
    with looped() as ran:
        mask = SublayerMask((True, False, False, True, True, True))
        logits, buffers = _batched_both_ways(
            engine, [4, 9], torch.tensor([[5, 6], [7, 8]]), None, mask
        )
        _assert_bitwise(logits, buffers)
        cache = engine.new_cache(16)
        engine.forward(torch.tensor([1, 2, 3]), 0, cache, all_logits=False)
        captured = engine.forward(torch.tensor([4]), 3, cache, capture_points=True)
        assert captured.points is not None
        float32 = SublayerEngine(testing.tiny_model("llama", 3, 0), progress=False)
        single = float32.new_cache(8)
        float32.forward(torch.tensor([1, 2]), 0, single, all_logits=False)
        float32.forward(torch.tensor([3]), 2, single)
    assert ran == []


@needs_kernels
def test_weights_changed_after_planning_are_planned_again() -> None:
    """A weight changed in place after the loop planned its pointers (its version moves)
    and another kernel table: the loop plans again and still equals the items, which run
    the new weights."""
    model = testing.tiny_model("llama", 3, 0).to(torch.bfloat16)
    engine = SublayerEngine(model, progress=False)
    engine.use_kernels(_engine().kernels)
    step, prompt = torch.tensor([9, 10]), torch.tensor([1, 2, 3, 4])

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        results = []
        for on in (True, False):
            engine.compiled_loop = on
            cache = engine.new_cache(16)
            engine.forward(prompt, 0, cache, all_logits=False)
            results.append(engine.forward(step, 4, cache).logits)
        engine.compiled_loop = True
        return results[0], results[1]

    with looped() as ran:
        before, _ = both()
        with torch.no_grad():
            engine.layers[1].self_attn.o_proj.weight.mul_(2)
            engine.layers[2].mlp.down_proj.weight.mul_(-1)
        on, off = both()
        assert torch.equal(on, off)
        assert not torch.equal(on, before)
        engine.use_kernels(attrs.evolve(engine.kernels))  # another table object
        again, _ = both()
        assert torch.equal(again, on)
    assert ran == [2, 2, 2]
