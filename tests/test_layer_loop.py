"""The compiled layer loop (:mod:`knapspec.model.kernels.layer_loop`) against the lean items it
replaces.

The loop calls the same kernels with the same arguments as the lean pass's items and does
the steps between them (residual adds, SiLU times up) as PyTorch does them in bfloat16, so
every logit and every K/V entry must be bitwise the items': batched passes with equal or
ragged widths, a sequence's decode and verification steps, token trees, bfloat16 (packed
products, SiLU from the table or the callback) and float32 (``row-linear``, SiLU through
the callback), layer-skipping masks, kernels C cannot call (through the product callback),
Llama, Qwen2 (biases), Qwen3 (q/k norms), Mistral and Gemma 3 (norms scaled by ``1 + w``
after each sublayer too, a rotary table per layer type, GELU-tanh, sliding windows crossed
in batches, sequences and token trees); a step that captures hidden states must keep the
items, and where weights changed after it planned, it must plan again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from knapspec import testing
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels import layer_loop, row_linear
from knapspec.model.kernels.table import (
    AMX_KERNEL,
    FUSION_GROUPS,
    PACKED_KERNEL,
    ROW_LINEAR_KERNEL,
    ROWWISE_KERNEL,
    KernelTable,
)
from knapspec.types import SublayerMask
from pass_pairs import (
    VOCAB,
    assert_bitwise,
    assert_caches_equal,
    batched_both_ways,
    sequence_both_ways,
)
from units import needs_packed_products


def _packed_kernel() -> str | None:
    if row_linear.packed_available():
        return PACKED_KERNEL
    if row_linear.amx_available():
        return AMX_KERNEL
    return None


needs_compiler = pytest.mark.skipif(
    layer_loop.LIBRARY.load() is None or row_linear.LIBRARY.load() is None,
    reason="no C compiler: the loop and the compiled products do not run here",
)
needs_packed = needs_packed_products
DTYPES = [
    pytest.param(torch.bfloat16, marks=needs_packed, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
]
pytestmark = needs_compiler

_ENGINES: dict[tuple[str, torch.dtype], SublayerEngine] = {}


def _engine(family: str = "llama", dtype: torch.dtype = torch.bfloat16) -> SublayerEngine:
    """An exact engine on a tiny model whose every product runs a compiled kernel the loop
    calls (bfloat16: the packed one; float32: ``row-linear``) and fuses q/k/v and gate/up
    at every row count (what the loop serves; the measured table of a tiny model may choose
    others)."""
    if (family, dtype) not in _ENGINES:
        model = testing.tiny_model(family, 3, 0).to(dtype)
        engine = SublayerEngine(model, progress=False)
        name = _packed_kernel() if dtype == torch.bfloat16 else ROW_LINEAR_KERNEL
        assert name is not None
        engine.use_kernels(_table(engine, name))
        _ENGINES[family, dtype] = engine
    return _ENGINES[family, dtype]


def _table(engine: SublayerEngine, name: str) -> KernelTable:
    table = engine.kernels
    shapes = {*table.choices, *table.large}
    return attrs.evolve(
        table,
        choices={shape: (name,) * table.max_rows for shape in shapes},
        large=dict.fromkeys(shapes, name),
        fuse={group: (True,) * table.max_rows for group in FUSION_GROUPS},
    )


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


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    ragged=st.booleans(),
    seed=st.integers(0, 99),
)
def test_a_batched_pass_through_the_loop_is_bitwise_its_items(
    dtype: torch.dtype, widths: list[int], ragged: bool, seed: int
) -> None:
    """Equal widths (padded layout) or ragged ones (packed tokens, zero padding queries):
    the same logits and K/V buffers bit for bit, and the loop ran the pass (mutation
    check: a loop that rotated only the queries or skipped the value write fails here)."""
    engine = _engine("llama", dtype)
    generator = torch.Generator().manual_seed(seed)
    contexts = [int(torch.randint(1, 30, (1,), generator=generator)) for _ in widths]
    if not ragged:
        widths = [max(widths)] * len(widths)
    inputs = torch.randint(0, VOCAB, (len(widths), max(widths)), generator=generator)
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", contexts, inputs, widths if ragged else None
        )
    assert_bitwise(logits, buffers)
    assert sum(widths) in ran


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(context=st.integers(1, 30), width=st.integers(1, 6), seed=st.integers(0, 99))
def test_a_sequences_steps_through_the_loop_are_bitwise_its_items(
    dtype: torch.dtype, context: int, width: int, seed: int
) -> None:
    """A decode step or a verification after a prefill: the same logits, K/V and lengths in
    every layer as the items, through the loop."""
    engine = _engine("llama", dtype)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context,), generator=generator)
    step = torch.randint(0, VOCAB, (width,), generator=generator)
    with looped() as ran:
        outputs, caches = sequence_both_ways(
            engine, "compiled_loop", prompt, lambda cache: engine.forward(step, context, cache)
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert torch.equal(outputs[0].hidden, outputs[1].hidden)
    assert caches[0].lengths == [context + width] * engine.num_layers
    assert_caches_equal(caches)
    assert width in ran


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, deadline=None)
@given(
    context=st.integers(1, 30),
    parents=st.lists(st.integers(0, 10), min_size=0, max_size=8),
    seed=st.integers(0, 99),
)
def test_a_token_tree_through_the_loop_is_bitwise_its_items(
    dtype: torch.dtype, context: int, parents: list[int], seed: int
) -> None:
    """:meth:`SublayerEngine.forward_tree`: node ``i`` at slot ``start + i``, seeing its
    ancestors: the same logits, K/V and lengths as the items."""
    engine = _engine("llama", dtype)
    tree = [-1] + [min(parent, node) for node, parent in enumerate(parents)]
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (context + 1,), generator=generator)
    nodes = torch.randint(0, VOCAB, (len(tree),), generator=generator)
    with looped() as ran:
        outputs, caches = sequence_both_ways(
            engine,
            "compiled_loop",
            prompt,
            lambda cache: engine.forward_tree(nodes, context + 1, tree, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert len(tree) in ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_through_the_loop_are_bitwise_their_items(
    family: str, dtype: torch.dtype
) -> None:
    """Qwen2 (q/k/v biases, passed to the fused product), Qwen3 (per-head q/k norms) and
    Mistral: a ragged batched pass and a sequence's verification, through the loop, bitwise
    the items."""
    engine = _engine(family, dtype)
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", [2, 7, 4], torch.tensor([[1, 2, 3]] * 3), [3, 1, 2]
        )
    assert_bitwise(logits, buffers)
    assert ran == [6]
    with looped() as ran:
        outputs, _ = sequence_both_ways(
            engine,
            "compiled_loop",
            torch.tensor([4, 5, 6]),
            lambda cache: engine.forward(torch.tensor([7, 8]), 3, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert ran == [2]


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, deadline=None)
@given(executed=st.lists(st.booleans(), min_size=6, max_size=6), seed=st.integers(0, 99))
def test_a_layer_skipping_mask_runs_through_the_loop_bitwise(
    dtype: torch.dtype, executed: list[bool], seed: int
) -> None:
    """A draft pass under a sublayer mask (any of the 64 masks of three layers): a batched
    pass and a sequence's step through the loop are bitwise the items, a skipped attention
    item writes no K/V and leaves its layer's length where it was."""
    engine = _engine("llama", dtype)
    mask = SublayerMask(tuple(executed))
    inputs = torch.tensor([[5, 6], [7, 8]])
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", [4, 9], inputs, [2, 1], mask, seed
        )
    assert_bitwise(logits, buffers)
    assert ran == [3]
    with looped() as ran:
        outputs, caches = sequence_both_ways(
            engine,
            "compiled_loop",
            torch.tensor([1, 2, 3]),
            lambda cache: engine.forward(torch.tensor([4, 5]), 3, cache, mask),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    expected = [5 if executed[2 * layer] else 3 for layer in range(engine.num_layers)]
    assert caches[0].lengths == expected
    assert_caches_equal(caches)
    assert ran == [2]


@needs_packed
def test_a_step_that_captures_hidden_states_keeps_the_items() -> None:
    """A step that captures the residual stream at every point (the value proxies read
    them) does not take the loop: its items run and the points are there."""
    engine = _engine()
    with looped() as ran:
        cache = engine.new_cache(16)
        engine.forward(torch.tensor([1, 2, 3]), 0, cache, all_logits=False)
        captured = engine.forward(torch.tensor([4]), 3, cache, capture_points=True)
    assert captured.points is not None
    assert captured.points.shape[0] == 2 * engine.num_layers + 1
    assert ran == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mixed", [False, True], ids=["rowwise", "mixed"])
def test_kernels_c_cannot_call_run_through_the_callback_bitwise(
    dtype: torch.dtype, mixed: bool
) -> None:
    """Products on a kernel the loop cannot call from C (``rowwise``: one ``F.linear`` per
    row; on an AMX Xeon ``transposed-padded``, oneDNN) run through its product callback,
    alone or beside compiled ones: still bitwise the items, through the loop."""
    model = testing.tiny_model("llama", 3, 0).to(dtype)
    engine = SublayerEngine(model, progress=False)
    table = _table(engine, ROWWISE_KERNEL)
    if mixed:  # the fused q/k/v and the down product compiled, the others called back
        compiled = _engine("llama", dtype).kernels
        keep = {(64 + 2 * 32, 64), (64, 128)}  # (q + k + v, d) and (d, ff) of the tiny model
        choices = {
            shape: compiled.choices[shape] if shape in keep else names
            for shape, names in table.choices.items()
        }
        table = attrs.evolve(table, choices=choices)
    engine.use_kernels(table)
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", [3, 8], torch.tensor([[1, 2], [3, 4]]), [2, 1]
        )
    assert_bitwise(logits, buffers)
    assert ran == [3]


@needs_packed
def test_bf16_without_the_table_runs_silu_through_the_callback_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the SiLU table does not hold for a model's layout, the bfloat16 loop runs
    PyTorch's SiLU through its callback instead, still bitwise the items."""
    monkeypatch.setattr(layer_loop, "activation_table", lambda activation, feed_width: None)
    model = testing.tiny_model("llama", 3, 0).to(torch.bfloat16)
    engine = SublayerEngine(model, progress=False)
    engine.use_kernels(_engine().kernels)
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", [3, 8], torch.tensor([[1, 2], [3, 4]]), [2, 1]
        )
    assert_bitwise(logits, buffers)
    assert ran == [3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_pass_that_fails_in_the_loop_raises_and_the_engine_goes_on(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside the loop (here the model's SiLU raising in the callback) raises a
    RuntimeError that names the step, leaves the cache's lengths where they were, and the
    next step runs and equals the items'."""
    model = testing.tiny_model("llama", 3, 0).to(dtype)
    engine = SublayerEngine(model, progress=False)
    engine.use_kernels(_engine("llama", dtype).kernels)
    monkeypatch.setattr(layer_loop, "activation_table", lambda activation, feed_width: None)
    cache = engine.new_cache(16)
    engine.forward(torch.tensor([1, 2, 3]), 0, cache, all_logits=False)

    def broken(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(type(engine.layers[0].mlp.act_fn), "forward", broken)
        with pytest.raises(RuntimeError, match="failed in its activation"):
            engine.forward(torch.tensor([4]), 3, cache)
    assert cache.lengths == [3] * engine.num_layers
    on = engine.forward(torch.tensor([4]), 3, cache).logits
    cache.crop(3)
    with engine.use_paths(compiled_loop=False):
        off = engine.forward(torch.tensor([4]), 3, cache).logits
    assert torch.equal(on, off)


@needs_packed
def test_weights_changed_after_planning_are_planned_again() -> None:
    """A weight changed in place after the loop planned its pointers (its version moves)
    and another kernel table: the loop plans again and still equals the items, which run
    the new weights."""
    model = testing.tiny_model("llama", 3, 0).to(torch.bfloat16)
    engine = SublayerEngine(model, progress=False)
    engine.use_kernels(_engine().kernels)
    step, prompt = torch.tensor([9, 10]), torch.tensor([1, 2, 3, 4])

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        outputs, _ = sequence_both_ways(
            engine, "compiled_loop", prompt, lambda cache: engine.forward(step, 4, cache)
        )
        return outputs[0].logits, outputs[1].logits

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


def test_ctrl_c_inside_a_callback_is_raised_when_the_loop_returns() -> None:
    """Ctrl-C while the loop calls back into Python (a product it cannot call in C): a
    KeyboardInterrupt there would be printed and dropped by ctypes, and the loop would run
    on; it is held until the call returns, then raised, and the engine goes on."""
    import os
    import signal

    engine = _engine("llama", torch.float32)
    cache = engine.new_cache(16)
    engine.forward(torch.tensor([1, 2, 3]), 0, cache, all_logits=False)
    sent: list[int] = []

    def interrupting(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return F.linear(x, weight, bias)

    with engine.substituted_products(interrupting), pytest.raises(KeyboardInterrupt):
        engine.forward(torch.tensor([4, 5]), 3, cache)
    assert sent
    cache.crop(3)
    assert engine.forward(torch.tensor([4]), 3, cache).logits.isfinite().all()


# ------------------------------------------------------------------------------ Gemma 3
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=12, deadline=None)
@given(
    contexts=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    ragged=st.booleans(),
)
@example(contexts=[30, 2, 7], widths=[6, 1, 2], ragged=True)  # rows inside and past
@example(contexts=[12, 20], widths=[3, 3, 3], ragged=False)
def test_gemma3_batches_and_steps_through_the_loop_are_bitwise_its_items(
    dtype: torch.dtype, contexts: list[int], widths: list[int], ragged: bool
) -> None:
    """Gemma 3 (q/k norms, ``1 + w`` norms before and after each sublayer, a rotary table
    per layer type, GELU-tanh from the table or the callback, sliding layers whose rows
    past the window are attended alone): a batched pass and a sequence's verification
    through the loop, bitwise the items."""
    engine = _engine("gemma3", dtype)
    widths = widths[: len(contexts)] if ragged else [max(widths)] * len(contexts)
    inputs = torch.tensor([[1 + row, 2, 3, 4, 5, 6][: max(widths)] for row in range(len(widths))])
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", contexts, inputs, widths if ragged else None
        )
    assert_bitwise(logits, buffers)
    assert sum(widths) in ran  # (a one-token prefill of a row runs through it too)
    prompt = torch.arange(contexts[0]) % VOCAB
    step = torch.arange(widths[0]) + 40
    with looped() as ran:
        outputs, caches = sequence_both_ways(
            engine, "compiled_loop", prompt, lambda cache: engine.forward(step, contexts[0], cache)
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert widths[0] in ran


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, deadline=None)
@given(context=st.integers(1, 30), parents=st.lists(st.integers(0, 10), min_size=0, max_size=9))
@example(context=20, parents=[0, 1, 0, 3, 2, 1, 6, 7, 8])  # every node past the window
@example(context=4, parents=[0, 1, 2, 3, 4, 5])  # the window crossed inside the tree
def test_a_gemma3_token_tree_through_the_loop_is_bitwise_its_items(
    dtype: torch.dtype, context: int, parents: list[int]
) -> None:
    """A token tree on Gemma 3: where a node sees past the window every node's visible keys
    inside it are gathered and attended alone, in C as in the lean items."""
    engine = _engine("gemma3", dtype)
    tree = [-1] + [min(parent, node) for node, parent in enumerate(parents)]
    prompt = torch.arange(context + 1) % VOCAB
    nodes = torch.arange(len(tree)) + 50
    with looped() as ran:
        outputs, caches = sequence_both_ways(
            engine,
            "compiled_loop",
            prompt,
            lambda cache: engine.forward_tree(nodes, context + 1, tree, cache),
        )
    assert torch.equal(outputs[0].logits, outputs[1].logits)
    assert_caches_equal(caches)
    assert len(tree) in ran


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=8, deadline=None)
@given(executed=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_layer_skipping_mask_runs_gemma3_through_the_loop_bitwise(
    dtype: torch.dtype, executed: list[bool]
) -> None:
    """A draft pass under a sublayer mask on Gemma 3, past the window: bitwise the items."""
    engine = _engine("gemma3", dtype)
    mask = SublayerMask(tuple(executed))
    with looped() as ran:
        logits, buffers = batched_both_ways(
            engine, "compiled_loop", [4, 19], torch.tensor([[5, 6], [7, 8]]), [2, 1], mask
        )
    assert_bitwise(logits, buffers)
    assert ran == [3]


@needs_packed
def test_gemma3_in_bf16_reads_gelu_tanh_from_its_table_or_calls_it_back_bitwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GELU-tanh table holds for the tiny Gemma's layout (the loop reads it); without
    it the loop calls the model's activation back: bitwise the items either way."""
    engine = _engine("gemma3", torch.bfloat16)
    activation = engine.layers[0].mlp.act_fn
    table = layer_loop.activation_table(activation, 128)
    assert table is not None
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(table.view(torch.int16), activation(patterns).view(torch.int16))
    for held in (True, False):
        if not held:
            monkeypatch.setattr(layer_loop, "activation_table", lambda activation, width: None)
            engine.use_kernels(engine.kernels)  # plan again
        with looped() as ran:
            logits, buffers = batched_both_ways(
                engine, "compiled_loop", [3, 20], torch.tensor([[1, 2], [3, 4]]), [2, 1]
            )
        assert_bitwise(logits, buffers)
        assert ran == [3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loop_that_forgets_the_window_is_caught(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power: a loop that attends every row in the shared call, over all its keys (no
    window plans), leaves the items' logits."""
    engine = _engine("gemma3", dtype)
    monkeypatch.setattr(layer_loop, "_window_plans", lambda *args: (None, [], 0))
    with looped() as ran:
        logits, _ = batched_both_ways(
            engine, "compiled_loop", [20, 3], torch.tensor([[1, 2], [3, 4]]), None
        )
    assert ran == [4]
    assert not torch.equal(logits[0], logits[1])
