"""An exact pass's decoder layers in one compiled call (``csrc/layer_loop.c``).

A lean exact pass (:class:`~knapspec.model.passes.exact_pass.ExactLayerPass`) runs, per layer,
about fifteen Python-level calls: the compiled RMSNorm, rotary, K/V writes, attention and
products, a few tensor operations between them, and the Python around each. With their
kernels stubbed out, those calls alone still took about a quarter of a one-token step and
of a five-token verification (bfloat16, SmolLM2-135M, 30 layers; figures:
``results/engine/HISTORY.md``).

:func:`run_layers` hands the whole layer loop to one C function that calls the same
kernels through their function pointers with the same arguments, and does the steps
between them as PyTorch does them: the residual adds in the pass's dtype (in bfloat16 in
float32, rounded once), and the activation (SiLU, or Gemma's GELU-tanh) times up either
from a table of the layer's own activation's outputs for all 65,536 bfloat16 inputs
(checked against it in the layout the layer runs it in: PyTorch's scalar path, which
finishes rows of other widths, rounds some inputs otherwise) or, in float32 or where the
table does not hold, through a callback that runs the activation module and PyTorch's
product on the loop's buffers. Every output and K/V entry is bitwise the Python loop's
(the tests compare them).

It serves the Llama layout and Gemma 3's (per-head q/k norms, norms scaled by ``1 + w``, a
norm after each sublayer, a rotary table per layer type, sliding-window layers: the rows
past a window attended alone as the lean pass plans them,
:func:`~knapspec.model.passes.sliding_window.windowed_rows`), full passes and
layer-skipping draft passes (a sublayer mask: the skipped items neither run nor write
K/V) whose layers run fused q/k/v and gate/up products; a product on a kernel C cannot
call runs through a callback. Where it does not fit (weights replaced since the fusion,
another MLP or activation, norms of two forms) it returns None and the caller runs the
Python loop; a pass that captures hidden states never asks.

Size: over 450 lines because the per-engine plan (the pointers and epsilons of every
layer, in ``csrc/layer_loop.c``'s slot order), the per-pass tables (rotary, window plans)
and the call they feed share one argument layout, and the callbacks live beside the call
that installs them; the plan (``_Plan`` with ``_product`` and the activation tables) is
the seam along which to split it.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn
from transformers.activations import GELUTanh, SiLUActivation

from knapspec.model.kernels import layer_ops, row_attention, row_linear
from knapspec.model.kernels.compiled import CompiledLibrary
from knapspec.model.kernels.fusion import FusedProjection

#: Pointers per layer and sizes per pass, as ``csrc/layer_loop.c`` lays them out.
_LAYER_SLOTS, _SIZES = 22, 18
#: Norm epsilons per layer (input, MLP input, q, k, attention output, MLP output).
_EPS_SLOTS = 6
#: Activations the loop computes (a table of the module's own outputs, or the module called
#: back): each elementwise, the same for every layer of one class.
_ACTIVATIONS = (SiLUActivation, nn.SiLU, GELUTanh)
#: How the loop runs a product (``csrc/layer_loop.c``'s PACKED, ROW_LINEAR, CALLBACK): a C
#: kernel with either argument convention, or a kernel C cannot call, through a callback.
_PACKED, _ROW_LINEAR, _CALLBACK = 0, 1, 2
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: ``activate(gate_up, gated, tokens) -> status``, the loop's callback for act times up.
_ACTIVATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
#: ``product(layer, which, x, out, tokens) -> status``, its callback for other kernels.
_PRODUCT = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64
)


def _declare(library: ctypes.CDLL) -> None:
    ptr = ctypes.c_void_p
    loop = library.knapspec_layer_loop
    loop.restype = ctypes.c_int
    loop.argtypes = [ptr, ctypes.c_int64, *(ptr,) * 14, ctypes.c_float, *(ptr,) * 5]
    library.knapspec_layer_loop_scratch.restype = ctypes.c_int64
    library.knapspec_layer_loop_scratch.argtypes = [ptr]
    library.knapspec_layer_loop_slots.restype = ctypes.c_int
    library.knapspec_layer_loop_slots.argtypes = []
    if library.knapspec_layer_loop_slots() != _LAYER_SLOTS * 1000 + _SIZES:
        raise AttributeError("csrc/layer_loop.c lays out its arguments otherwise")


LIBRARY = CompiledLibrary(
    "layer_loop.c",
    "the compiled layer loop",
    "exact passes run their layer items one by one from Python",
    _declare,
    flags=("-ffp-contract=off",),
)

#: Names of the steps in the loop's status codes (status // 1000).
_STEPS = (
    "",
    "sizes",
    "input RMSNorm",
    "q/k/v product",
    "rotary",
    "K/V write",
    "attention",
    "output product",
    "post-attention RMSNorm",
    "gate/up product",
    "activation",
    "down product",
    "q/k norms",
    "attention output's norm",
    "MLP output's norm",
    "windowed attention",
)


class WindowedRows(Protocol):
    """What the loop reads of a pass's plan for one sliding layer (the passes' record,
    :class:`~knapspec.model.passes.sliding_window.WindowedRows`; named structurally so
    the kernels never import a pass)."""

    inside: row_attention.BatchedAttention | None
    entries: torch.Tensor
    scale: float

    def keys_of(self, entry: int) -> torch.Tensor | None: ...


class LoopEngine(Protocol):
    """What the loop uses of :class:`~knapspec.model.engine.SublayerEngine`."""

    kernel_generation: int
    dtype: torch.dtype
    num_heads: int
    kv_heads: int
    head_dim: int
    layers: list[Any]
    sandwich_norms: bool
    windows: list[int | None]

    @property
    def has_qk_norm(self) -> bool: ...

    def fusion(
        self, group: str, layer_index: int, rows: int
    ) -> tuple[FusedProjection, Callable[..., torch.Tensor]] | None: ...

    def project_kernel(
        self, module: nn.Module, rows: int
    ) -> Callable[..., torch.Tensor] | None: ...


def _address(library: ctypes.CDLL, name: str) -> int:
    address = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    assert address is not None
    return address


_tables: dict[type, torch.Tensor] = {}


def activation_table(activation: nn.Module, feed_width: int) -> torch.Tensor | None:
    """``activation`` (an elementwise module of :data:`_ACTIVATIONS`) of every bfloat16 bit
    pattern, ``(65536,)`` bfloat16 indexed by the pattern, or None where the module over
    rows of ``feed_width`` gates read from a fused gate/up output (the layout the layer
    runs it in) does not give exactly those values (its vector and scalar paths may round
    differently; the table holds the vector path's)."""
    kind = type(activation)
    if kind not in _tables:
        patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        _tables[kind] = activation(patterns)
    table = _tables[kind]
    rows = -(-65536 // feed_width)
    patterns = torch.arange(rows * feed_width, dtype=torch.int32) % 65536
    fused = torch.zeros(rows, 2 * feed_width, dtype=torch.bfloat16)
    fused[:, :feed_width] = patterns.to(torch.int16).view(torch.bfloat16).view(rows, feed_width)
    expected = table.view(torch.int16)[patterns.view(rows, feed_width)]
    if not torch.equal(activation(fused[:, :feed_width]).view(torch.int16), expected):
        return None
    return table


def silu_table(feed_width: int) -> torch.Tensor | None:
    """:func:`activation_table` of ``F.silu`` (the Llama layout's activation)."""
    return activation_table(nn.SiLU(), feed_width)


def _product(
    kernel: Callable[..., torch.Tensor] | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    library: ctypes.CDLL,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int] | None:
    """What the loop passes for one product that ``kernel`` runs: the weight as the kernel
    reads it, the bias, the C function's address (0 for a callback) and how it runs; None
    where the product does not run through a kernel at all (the module runs itself)."""
    dtype = _DTYPES.get(weight.dtype)
    if kernel is None or dtype is None or (bias is not None and bias.dtype != weight.dtype):
        return None
    if kernel in (row_linear.packed_linear, row_linear.amx_linear):
        packed = kernel is row_linear.packed_linear
        if (
            weight.dtype == torch.bfloat16
            and weight.shape[1] % 32 == 0
            and (row_linear.packed_available() if packed else row_linear.amx_available())
        ):
            name = "knapspec_packed_linear" if packed else "knapspec_amx_linear"
            bias = bias.contiguous() if bias is not None else None
            return row_linear.packed_weight(weight), bias, _address(library, name), _PACKED
    elif (
        kernel is row_linear.row_linear
        and weight.shape[1] % int(library.knapspec_row_linear_chunk(dtype)) == 0
    ):
        bias = bias.contiguous() if bias is not None else None
        address = _address(library, "knapspec_row_linear")
        return weight.contiguous(), bias, address, _ROW_LINEAR
    return weight, bias, 0, _CALLBACK  # the kernel itself, called back (it may pad, pack)


def _layer_norms(engine: LoopEngine, layer: Any) -> list[nn.Module | None]:
    """A layer's norms in the loop's order (input, MLP input, q, k, attention output, MLP
    output), None where the layer has none of that kind."""
    attention = layer.self_attn
    qk = [attention.q_norm, attention.k_norm] if engine.has_qk_norm else [None, None]
    if engine.sandwich_norms:  # Gemma 3: post_attention_layernorm normalises the output
        outputs = [layer.post_attention_layernorm, layer.post_feedforward_layernorm]
        return [layer.input_layernorm, layer.pre_feedforward_layernorm, *qk, *outputs]
    return [layer.input_layernorm, layer.post_attention_layernorm, *qk, None, None]


def _epsilon(norm: nn.Module | None) -> float | None:
    """An RMSNorm's epsilon (``variance_epsilon``, or Gemma's ``eps``)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


class _Plan:
    """One engine's layer pointers for passes of one token count, with what they were made
    from (:meth:`current` says whether they still hold)."""

    def __init__(self, engine: LoopEngine, tokens: int) -> None:
        self.ok = False
        # Another table (the autotuner swaps them) or substituted products run other kernels.
        self._generation = engine.kernel_generation
        self._sources: list[tuple[nn.Module, str, torch.Tensor, int]] = []
        self._fusions: list[tuple[FusedProjection, int]] = []
        self._keep: list[torch.Tensor] = []
        #: The products the loop calls back for (layer * 4 + which: kernel, weight, bias).
        self.called_back: dict[int, tuple[Callable[..., torch.Tensor], torch.Tensor, Any]] = {}
        pointers: list[int] = []
        eps: list[float] = []
        width, kv_width = engine.num_heads * engine.head_dim, engine.kv_heads * engine.head_dim
        feed_width = 0
        library = row_linear.LIBRARY.load()
        if library is None or not engine.layers:
            return
        activation = getattr(engine.layers[0].mlp, "act_fn", None)
        forms: set[bool] = set()
        for index, layer in enumerate(engine.layers):
            mlp, attention = layer.mlp, layer.self_attn
            qkv = engine.fusion("qkv", index, tokens)
            gate_up = engine.fusion("gate_up", index, tokens)
            o_proj, down = attention.o_proj, getattr(mlp, "down_proj", None)
            if (
                qkv is None
                or gate_up is None
                or down is None
                or qkv[0].sizes != (width, kv_width, kv_width)
                or len(gate_up[0].sizes) != 2
                or gate_up[0].sizes[0] != gate_up[0].sizes[1]
                or type(activation) not in _ACTIVATIONS
                or type(getattr(mlp, "act_fn", None)) is not type(activation)
                or (index and gate_up[0].sizes[0] != feed_width)
            ):
                return
            feed_width = gate_up[0].sizes[0]
            kernels = (
                (qkv[1], qkv[0].weight, qkv[0].bias),
                (engine.project_kernel(o_proj, tokens), o_proj.weight, o_proj.bias),
                (gate_up[1], gate_up[0].weight, gate_up[0].bias),
                (engine.project_kernel(down, tokens), down.weight, down.bias),
            )
            products = [_product(k, w, b, library) for k, w, b in kernels]
            norms = _layer_norms(engine, layer)
            present = [norm for norm in norms if norm is not None]
            forms |= {type(norm).__name__ in layer_ops.UNIT_OFFSET_NORMS for norm in present}
            if len(forms) > 1 or any(_epsilon(norm) is None for norm in present):
                return  # the loop runs one norm form
            norm_weights = [cast(torch.Tensor, norm.weight) for norm in present]
            for norm, weight in zip(present, norm_weights, strict=True):
                self._sources.append((norm, "weight", weight, weight._version))
            for module in (o_proj, down):
                self._sources.append((module, "weight", module.weight, module.weight._version))
            for fused in (qkv[0], gate_up[0]):
                self._fusions.append((fused, fused.weight._version))
            slots: list[int] = []
            for which, ((kernel, _, _), entry) in enumerate(zip(kernels, products, strict=True)):
                if entry is None or kernel is None:
                    return
                weight, bias, function, convention = entry
                if convention == _CALLBACK:
                    self.called_back[4 * index + which] = (kernel, weight, bias)
                self._keep += [weight] + ([bias] if bias is not None else [])
                bias_pointer = bias.data_ptr() if bias is not None else 0
                slots += [weight.data_ptr(), bias_pointer, function, convention]
            weights = [
                None if norm is None else cast(torch.Tensor, norm.weight).contiguous()
                for norm in norms
            ]
            self._keep += [weight for weight in weights if weight is not None]
            norm_at = [0 if weight is None else weight.data_ptr() for weight in weights]
            pointers += [norm_at[0], *slots[:8], norm_at[1], *slots[8:], *norm_at[2:]]
            eps += [_epsilon(norm) or 0.0 for norm in norms]
        assert isinstance(activation, nn.Module)  # one of _ACTIVATIONS
        #: The layers' activation, and its table where bfloat16 reads it from one.
        self.activation = activation
        bf16 = engine.dtype == torch.bfloat16
        self.table = activation_table(activation, feed_width) if bf16 else None
        #: Whether the norms scale by ``1 + weight`` (Gemma's form).
        self.unit_offset = forms == {True}
        self.pointers = torch.tensor(pointers, dtype=torch.int64)
        self.eps = torch.tensor(eps, dtype=torch.float32)
        self.feed_width = feed_width
        self.ok = True

    def current(self, engine: LoopEngine) -> bool:
        """Whether ``engine`` still runs the kernels the plan was made from and every
        weight the plan points at is still the module's, unchanged."""
        if engine.kernel_generation != self._generation:
            return False
        for module, name, tensor, version in self._sources:
            if module._parameters.get(name) is not tensor or tensor._version != version:
                return False
        return all(f.is_current() and f.weight._version == v for f, v in self._fusions)


#: Per engine, its plans by token count (None: that count does not fit the loop).
_plans: weakref.WeakKeyDictionary[Any, dict[int, _Plan]] = weakref.WeakKeyDictionary()


def _plan(engine: LoopEngine, tokens: int) -> _Plan | None:
    plans = _plans.setdefault(engine, {})
    plan = plans.get(tokens)
    if plan is None or not plan.current(engine):
        plan = plans[tokens] = _Plan(engine, tokens)
    return plan if plan.ok else None


def _functions() -> torch.Tensor | None:
    """The small operations' and the attention's addresses, or None where either library is
    missing."""
    ops, attention = layer_ops.LIBRARY.load(), row_attention.LIBRARY.load()
    if ops is None or attention is None:
        return None
    names = ((ops, "knapspec_rms_norm"), (ops, "knapspec_rotary"), (ops, "knapspec_scatter"))
    addresses = [_address(library, name) for library, name in names]
    return torch.tensor(
        [*addresses, _address(attention, "knapspec_attend_tree")], dtype=torch.int64
    )


_function_table: torch.Tensor | None = None


def _activation(scratch: torch.Tensor, feed_width: int, activation: nn.Module) -> Any:
    """The loop's activation-times-up callback over ``scratch``'s buffers: the layer's own
    ``act(gate) * up`` (as its MLP item computes it) from the fused gate/up output into the
    gated buffer, both given as pointers into ``scratch``."""
    base, size = scratch.data_ptr(), scratch.element_size()

    def activate(gate_up: int, gated: int, tokens: int) -> int:
        try:
            start = (gate_up - base) // size
            fused = scratch[start : start + tokens * 2 * feed_width].view(tokens, 2 * feed_width)
            start = (gated - base) // size
            out = scratch[start : start + tokens * feed_width].view(tokens, feed_width)
            torch.mul(activation(fused[:, :feed_width]), fused[:, feed_width:], out=out)
        except Exception:  # an exception must not cross into C: fail the pass instead
            return 1
        return 0

    return _ACTIVATE(activate)


def _products(scratch: torch.Tensor, plan: _Plan) -> Any:
    """The loop's callback for the products it cannot call in C: ``plan``'s kernel for that
    layer and product over the input in ``scratch``, its output copied to ``scratch``."""
    base, size = scratch.data_ptr(), scratch.element_size()

    def product(layer: int, which: int, x: int, out: int, tokens: int) -> int:
        try:
            kernel, weight, bias = plan.called_back[4 * layer + which]
            width, out_width = weight.shape[1], weight.shape[0]
            start = (x - base) // size
            source = scratch[start : start + tokens * width].view(tokens, width)
            start = (out - base) // size
            target = scratch[start : start + tokens * out_width].view(tokens, out_width)
            target.copy_(kernel(source, weight, bias))
        except Exception:  # an exception must not cross into C: fail the pass instead
            return 1
        return 0

    return _PRODUCT(product)


@contextlib.contextmanager
def _interrupts_after_the_call(callbacks: bool) -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the compiled loop returns, where it calls back into
    Python: a KeyboardInterrupt raised inside a ctypes callback is printed and dropped, and
    the loop would run on with the interrupt lost. The held signal goes to the handler that
    was in place (a KeyboardInterrupt by default) once the call is over."""
    if not callbacks or threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def _window_plans(
    engine: LoopEngine, windows: Mapping[int, WindowedRows], layers: int
) -> tuple[torch.Tensor | None, list[torch.Tensor], int]:
    """Per layer, the address of its window plan (``csrc/layer_loop.c``'s ``W_*`` layout;
    0 where the layer's rows all share the call), or None where no layer has one; the plans
    (kept alive by the caller) and the most keys an entry gathers."""
    if not windows:
        return None, [], 0
    plans: dict[int, torch.Tensor] = {}
    gathered = 0
    for window, crossed in windows.items():
        entries = crossed.entries
        shared = crossed.inside.row_pointers()[0] if crossed.inside is not None else None
        single = row_attention.BatchedAttention(
            row_attention.LIBRARY.load(),  # type: ignore[arg-type]  # loaded: the pass runs
            torch.ones(1, 1, dtype=torch.int64),
            engine.num_heads,
            engine.kv_heads,
            engine.head_dim,
            engine.dtype,
            crossed.scale,
        )
        head = torch.tensor([shared or 0, entries.shape[0], single.settings[0]])
        plans[window] = torch.cat([head, entries.reshape(-1)])
        for entry in range(entries.shape[0]):
            slots = crossed.keys_of(entry)
            gathered = max(gathered, 0 if slots is None else slots.numel())
    addresses = [
        plans[w].data_ptr() if w is not None and w in plans else 0 for w in engine.windows[:layers]
    ]
    return torch.tensor(addresses, dtype=torch.int64), list(plans.values()), gathered


def run_layers(
    engine: LoopEngine,
    buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    hidden: torch.Tensor,
    rotary: Sequence[tuple[torch.Tensor, torch.Tensor]],
    write_rows: torch.Tensor,
    write_positions: torch.Tensor,
    packing: tuple[torch.Tensor, torch.Tensor] | None,
    attention: row_attention.BatchedAttention,
    rows: int,
    end: int,
    executed: Sequence[bool] | None = None,
    windows: Mapping[int, WindowedRows] | None = None,
) -> torch.Tensor | None:
    """Every layer of an exact pass in one compiled call: the residual stream after the last
    layer, shaped like ``hidden``, with the K/V of every executed attention item written; or
    None, nothing touched, where the pass does not fit (module docstring).

    Args:
        buffers: layer -> its key and value buffers ``(slots, kvH, capacity, hd)``.
        hidden: ``(rows, q, d)`` or ``(1, T, d)`` float32 or bfloat16, the embedded tokens
            (not changed).
        rotary: per layer, its ``cos, sin`` tables ``(N, hd)`` contiguous; write_rows,
            write_positions: ``(N,)`` int64 contiguous, each token's cache slot and position.
        packing: each packed token's row and step ``(T,)`` int64 each, or None.
        attention: the pass's prepared attention call; rows: its rows; end: its key count.
        executed: ``2 * layers`` flags, attention then MLP per layer (a mask's
            ``executed``), or None for every item.
        windows: per sliding window that some row of the pass sees past, its rows' plan
            (:func:`~knapspec.model.passes.sliding_window.windowed_rows`).
    """
    global _function_table
    library = LIBRARY.load()
    dtype = _DTYPES.get(hidden.dtype)
    if library is None or dtype is None:
        return None
    tokens = write_rows.numel()
    plan = _plan(engine, tokens)
    if plan is None:
        return None
    if _function_table is None:
        _function_table = _functions()
        if _function_table is None:
            return None
    layers = len(engine.layers)
    kv: list[int] = []
    for layer in range(layers):
        keys, values = buffers(layer)
        kv += [keys.data_ptr(), values.data_ptr()]
    slots, _, capacity, _ = keys.shape
    tables = torch.tensor(
        [table.data_ptr() for pair in rotary[:layers] for table in pair], dtype=torch.int64
    )
    window_table, window_plans, gathered = _window_plans(engine, windows or {}, layers)
    chunk, unit, scale, threads = attention.settings
    sizes = [tokens, hidden.shape[-1], engine.num_heads, engine.kv_heads, engine.head_dim]
    sizes += [plan.feed_width, rows, attention.q_len, slots, capacity, end, chunk, unit]
    dims = torch.tensor(
        [*sizes, threads, dtype, int(plan.unit_offset), gathered, 0], dtype=torch.int64
    )
    dims[-1] = library.knapspec_layer_loop_scratch(dims.data_ptr())
    scratch = torch.empty(int(dims[-1]), dtype=hidden.dtype)
    table = plan.table
    activate = _activation(scratch, plan.feed_width, plan.activation) if table is None else None
    products = _products(scratch, plan) if plan.called_back else None
    out = hidden.clone(memory_format=torch.contiguous_format)
    kv_table = torch.tensor(kv, dtype=torch.int64)
    token_row, token_step = packing if packing is not None else (None, None)
    flags = None if executed is None else (ctypes.c_uint8 * len(executed))(*executed)
    lengths, prefix, visible = attention.row_pointers()
    with _interrupts_after_the_call(activate is not None or products is not None):
        status = library.knapspec_layer_loop(
            out.data_ptr(),
            layers,
            plan.pointers.data_ptr(),
            plan.eps.data_ptr(),
            kv_table.data_ptr(),
            _function_table.data_ptr(),
            dims.data_ptr(),
            tables.data_ptr(),
            None if window_table is None else window_table.data_ptr(),
            write_rows.data_ptr(),
            write_positions.data_ptr(),
            None if token_row is None else token_row.data_ptr(),
            None if token_step is None else token_step.data_ptr(),
            lengths,
            prefix,
            visible,
            scale,
            None if table is None else table.data_ptr(),
            None if activate is None else ctypes.cast(activate, ctypes.c_void_p),
            None if products is None else ctypes.cast(products, ctypes.c_void_p),
            flags,
            scratch.data_ptr(),
        )
    del window_plans  # alive until the call returned
    if status:
        step = _STEPS[status // 1000] if status // 1000 < len(_STEPS) else "?"
        raise RuntimeError(f"the compiled layer loop failed in its {step} (status {status})")
    return out


__all__ = ["LIBRARY", "LoopEngine", "activation_table", "run_layers", "silu_table"]
