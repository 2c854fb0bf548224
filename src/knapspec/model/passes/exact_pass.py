"""An exact batched pass's layer items with their per-pass work done once.

:func:`~knapspec.model.passes.batched.forward_batch` on an exact CPU engine runs, per layer,
the same few compiled calls (RMSNorm, the fused q/k/v product, q/k norms where the model
has them, rotary, two K/V writes, the row-invariant attention, the output product, the
norms around the MLP, the fused gate/up product, the activation, the down product).
Through the engine's general methods each item also recomputed what is the same for all
of a pass's layers (the rotary tables' layout, the K/V write indices' checks, the
attention's per-row lengths, thread split and unit), checked its inputs' layouts again and
padded ragged rows one slice at a time: in bfloat16 a one-row round of SmolLM2-135M spent
more than a third of its time outside the kernels, a 16-row round more than a quarter
(figures: ``results/engine/HISTORY.md``).

:class:`ExactLayerPass` prepares that work once per pass and runs each item with the
same kernels on the same inputs, so every output and every K/V entry is bitwise what the
general path computes (the tests compare the two). It serves the Llama layout and Gemma
3's: a norm after each sublayer too (applied to its output before the residual add),
per-head q/k norms, a rotary table per layer type, sliding-window layers (the rows past a
window attended as :mod:`~knapspec.model.passes.sliding_window` says) and the MLP's own
activation (GELU-tanh). Where an item's layer does not fit (a fusion undone by replaced
weights, a kernel that is not compiled here) :meth:`ExactLayerPass.attention_item` /
:meth:`mlp_item` return None and the caller runs the general path for that item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from knapspec.model.kernels import layer_loop, layer_ops, row_attention
from knapspec.model.kernels.fusion import FusedProjection
from knapspec.model.passes.sliding_window import WindowedRows, windowed_rows

_DTYPES = (torch.float32, torch.bfloat16)


@attrs.frozen
class EnginePaths:
    """Which of an exact engine's interchangeable code paths run: a debug and A/B setting.

    Every choice computes bitwise the same logits and K/V (``tests/test_exact_pass.py`` and
    ``tests/test_layer_loop.py`` compare them); they differ in speed, and in how much of a
    pass runs in Python where a debugger, a profiler or a substituted function sees it.
    Give it when the engine is built (``SublayerEngine(model, paths=EnginePaths(...))``) or
    for a block (``with engine.use_paths(lean_passes=False): ...``); read it as
    :attr:`SublayerEngine.paths <knapspec.model.engine.SublayerEngine.paths>`.

    Attributes:
        lean_passes: exact decode steps, verifications, token trees and batched passes run
            their layer items through :class:`ExactLayerPass` (the per-pass work done
            once); False: through the engine's general item methods.
        compiled_loop: a lean pass runs its whole layer loop as one compiled call
            (:mod:`knapspec.model.kernels.layer_loop`) where that serves; False: its items
            one by one from Python.
    """

    lean_passes: bool = True
    compiled_loop: bool = True


class LeanEngine(Protocol):
    """What the lean pass uses of :class:`~knapspec.model.engine.SublayerEngine` (which
    imports this module to run it)."""

    exact: bool
    kernel_generation: int
    kernels: Any
    compiled_norms: bool
    compiled_qk_norms: bool
    compiled_rotary: bool
    sandwich_norms: bool
    windows: list[int | None]
    dtype: torch.dtype
    num_heads: int
    kv_heads: int
    head_dim: int
    attention_scale: float
    layers: list[Any]

    @property
    def has_qk_norm(self) -> bool: ...

    @property
    def paths(self) -> EnginePaths: ...

    def fused_product(
        self, group: str, layer_index: int, x: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[int, ...]] | None: ...

    def project(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor: ...

    def layer_rotary(
        self, layer_index: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def project_kernel(
        self, module: nn.Module, rows: int
    ) -> Callable[..., torch.Tensor] | None: ...

    def fusion(
        self, group: str, layer_index: int, rows: int
    ) -> tuple[FusedProjection, Callable[..., torch.Tensor]] | None: ...


class LayerBuffers(Protocol):
    """A cache whose layers' K/V live in whole buffers the compiled kernels write and read
    (:class:`~knapspec.model.batch_cache.BatchKVCache`, and
    :class:`~knapspec.model.cache.KVCache` as one row)."""

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value buffers, ``(rows, kvH, capacity, hd)`` each,
        contiguous."""
        ...


class ExactLayerPass:
    """One exact batched pass over ``N`` token rows (``rows × q`` padded-equal, or ``T``
    packed), prepared for all of its layers (module docstring). Build it with
    :meth:`prepare`, which returns None where the pass as a whole does not fit.

    Args:
        engine, cache: the pass's engine and cache.
        rows: the rows the pass runs (a batch cache's active rows; 1 for a sequence).
        rotary: per layer, its rotary tables ``(cos, sin)``, ``(N, hd)`` contiguous each in
            the engine's dtype (layers of one type share theirs).
        write_rows, write_positions: each token's cache row and position, ``(N,)`` int64
            contiguous.
        attention: the prepared attention call (its per-row lengths ``(rows, q_max)``).
        packing: each packed token's row and step, or None (every row ``q`` tokens).
        windows: per sliding window (tokens) that some row of the pass sees past, how those
            rows are attended (:func:`~knapspec.model.passes.sliding_window.windowed_rows`).
    """

    def __init__(
        self,
        engine: LeanEngine,
        cache: LayerBuffers,
        rows: int,
        rotary: list[tuple[torch.Tensor, torch.Tensor]],
        write_rows: torch.Tensor,
        write_positions: torch.Tensor,
        attention: row_attention.BatchedAttention,
        packing: tuple[torch.Tensor, torch.Tensor] | None,
        windows: dict[int, WindowedRows] | None = None,
    ) -> None:
        self.engine = engine
        self.cache = cache
        self.rotary = rotary
        self._write_rows, self._write_positions = write_rows, write_positions
        self._attention = attention
        self._packing = packing
        self.windows: dict[int, WindowedRows] = windows or {}
        self.tokens = write_rows.numel()
        self.rows = rows
        #: Keys the longest row's last query sees (the attention's key count).
        self.end = 0

    @classmethod
    def prepare(
        cls,
        engine: LeanEngine,
        cache: LayerBuffers,
        compiled_writes: bool,
        cos: torch.Tensor,
        sin: torch.Tensor,
        index: tuple[torch.Tensor, torch.Tensor],
        lengths: torch.Tensor | None,
        packing: tuple[torch.Tensor, torch.Tensor] | None,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
        tree_positions: torch.Tensor | None = None,
    ) -> ExactLayerPass | None:
        """The pass over ``index``'s tokens, or None where it does not fit (an inexact
        engine, no compiled layer operations or attention kernel, q/k norms that do not
        run compiled, a token tree in sliding layers without its positions) or the engine
        turned it off (:attr:`EnginePaths.lean_passes`).

        Args:
            compiled_writes: whether the cache may be written through the compiled copy.
            cos, sin: the rotary tables, ``(rows, q, hd)`` or ``(1, T, hd)``; stacked over
                the layer types where the model has one table per type (``(types * rows,
                q, hd)``, as :meth:`~knapspec.model.engine.SublayerEngine.rotary_tables`
                gives them).
            index: each token's cache row and position, ``(rows, q)`` or ``(1, T)`` int64.
            lengths: ``(rows, q_max)`` keys each query row sees (padding rows: 1), or
                None with ``tree``.
            packing: each packed token's row and step, or None (every row ``q`` tokens).
            tree: one sequence's token tree instead of ``lengths``: ``(prefix, visible)``
                as :func:`~knapspec.model.kernels.row_attention.attend_tree_rows` takes them (node
                ``i`` written at the slot ``index`` gives it).
            tree_positions: with ``tree``, each node's position ``(q,)`` (what a sliding
                window is measured in).
        """
        library = row_attention.load_library()
        if (
            library is None
            or not engine.paths.lean_passes
            or not engine.exact
            or not engine.compiled_norms
            or not engine.compiled_rotary
            or not compiled_writes
            or (engine.has_qk_norm and not engine.compiled_qk_norms)
            or engine.dtype not in _DTYPES
        ):
            return None
        rows_index, positions = index
        tokens, head_dim = rows_index.numel(), engine.head_dim
        if (
            cos.dtype != engine.dtype
            or sin.dtype != engine.dtype
            or cos.numel() != sin.numel()
            or cos.numel() % (tokens * head_dim)
            or positions.numel() != tokens
            or rows_index.dtype != torch.int64
            or positions.dtype != torch.int64
        ):
            return None
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        rotary = []
        for layer_index in range(len(engine.layers)):
            layer_cos, layer_sin = engine.layer_rotary(layer_index, cos, sin)
            if layer_cos.numel() != tokens * head_dim:
                return None
            key = layer_cos.data_ptr()  # layers of one type share a table: lay it out once
            if key not in tables:
                tables[key] = (
                    layer_cos.reshape(tokens, head_dim).contiguous(),
                    layer_sin.reshape(tokens, head_dim).contiguous(),
                )
            rotary.append(tables[key])

        def call(row_lengths: torch.Tensor | None) -> row_attention.BatchedAttention:
            return row_attention.BatchedAttention(
                library,
                row_lengths,
                engine.num_heads,
                engine.kv_heads,
                head_dim,
                engine.dtype,
                engine.attention_scale,
                tree if row_lengths is None else None,
            )

        windows: dict[int, WindowedRows] = {}
        sliding = {w for w in engine.windows if w is not None}
        nodes = None  # a tree's (node 0's slot, positions, visibility) for its windows
        if tree is not None and sliding:
            if tree_positions is None:
                return None
            nodes = (int(positions.min()), tree_positions, tree[1])
        for window in sliding:
            crossed = windowed_rows(
                call, window, engine.num_heads, engine.attention_scale, lengths, nodes
            )
            if crossed is not None:
                windows[window] = crossed
        prepared = cls(
            engine,
            cache,
            lengths.shape[0] if lengths is not None else 1,
            rotary,
            rows_index.reshape(tokens).contiguous(),
            positions.reshape(tokens).contiguous(),
            call(lengths),
            packing,
            windows,
        )
        prepared.end = int(positions.max()) + 1  # every row's last real token sees that far
        return prepared

    def _norm(self, norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The compiled RMSNorm of ``hidden (..., d)`` (what the engine's ``normed`` runs)."""
        return layer_ops.apply_norm(norm, hidden)

    def _attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of ``query (N, H, hd)`` over each row's own cache ->
        ``(N, H * hd)``: the general path's padding, kernel call and gathering (in a
        sliding layer, the rows past its window attended alone over their keys)."""
        engine = self.engine
        rows, q_len = self.rows, self._attention.q_len
        heads, kv_heads, head_dim = engine.num_heads, engine.kv_heads, engine.head_dim
        if self._packing is None:
            by_row = query.view(rows, q_len, heads, head_dim)
        else:  # padded query rows are zeros and see one key, as in the general path
            by_row = query.new_zeros(rows, q_len, heads, head_dim)
            by_row[self._packing] = query
        folded = by_row.transpose(1, 2).reshape(rows * heads, q_len, head_dim).contiguous()
        keys, values = self.cache.buffers(layer_index)
        merged = (rows * kv_heads, self.end, head_dim)
        strides = (keys.stride(1), keys.stride(2), 1)
        shared = (keys.as_strided(merged, strides), values.as_strided(merged, strides))
        window = engine.windows[layer_index]
        crossed = self.windows.get(window) if window is not None else None
        if crossed is not None:
            out: torch.Tensor | None = crossed.attend(folded, keys, values, shared)
        else:
            out = self._attention(folded, *shared)
        if out is None:  # the tree was checked when it was laid out
            raise RuntimeError("the attention kernel refused tree rows that passed the check")
        by_query = out.view(rows, heads, q_len, head_dim).transpose(1, 2)
        if self._packing is not None:
            by_query = by_query[self._packing]  # (T, H, hd)
        return by_query.reshape(self.tokens, heads * head_dim)

    def run_layers(
        self, hidden: torch.Tensor, executed: Sequence[bool] | None = None
    ) -> torch.Tensor | None:
        """The residual stream after every layer's attention and MLP items (those
        ``executed`` flags, attention then MLP per layer, where given), all in one compiled
        call (:mod:`knapspec.model.kernels.layer_loop`, bitwise these items one by one), the
        executed attention items' K/V written; or None, nothing written, where that call
        does not serve this pass or the engine turned it off (:attr:`EnginePaths.compiled_loop`;
        the caller then runs the items)."""
        if not self.engine.paths.compiled_loop:
            return None
        return layer_loop.run_layers(
            self.engine,
            self.cache.buffers,
            hidden,
            self.rotary,
            self._write_rows,
            self._write_positions,
            self._packing,
            self._attention,
            self.rows,
            self.end,
            executed,
            self.windows,
        )

    def attention_item(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The residual stream ``(rows, q, d)`` / ``(1, T, d)`` after layer
        ``layer_index``'s attention item (its K/V written), or None where this layer needs
        the general path (nothing written then)."""
        engine = self.engine
        layer = engine.layers[layer_index]
        attention = layer.self_attn
        normed = self._norm(layer.input_layernorm, hidden)
        product = engine.fused_product("qkv", layer_index, normed)
        heads, kv_heads, head_dim = engine.num_heads, engine.kv_heads, engine.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        if product is None or product[1] != (q_width, kv_width, kv_width):
            return None
        flat = product[0].reshape(self.tokens, q_width + 2 * kv_width)
        # (N, heads, hd) views of the fused output: heads side by side, token stride Σ sizes.
        query = flat[:, :q_width].view(self.tokens, heads, head_dim)
        key = flat[:, q_width : q_width + kv_width].view(self.tokens, kv_heads, head_dim)
        value = flat[:, q_width + kv_width :].view(self.tokens, kv_heads, head_dim)
        if engine.has_qk_norm:  # per head, before rotary (new contiguous tensors)
            query = self._norm(attention.q_norm, query)
            key = self._norm(attention.k_norm, key)
        cos, sin = self.rotary[layer_index]
        layer_ops.rotary_heads_(query, cos, sin)
        layer_ops.rotary_heads_(key, cos, sin)
        keys, values = self.cache.buffers(layer_index)
        layer_ops.scatter_heads_(keys, self._write_rows, self._write_positions, key)
        layer_ops.scatter_heads_(values, self._write_rows, self._write_positions, value)
        attended = self._attend(layer_index, query).view(*hidden.shape[:-1], q_width)
        out = engine.project(attention.o_proj, attended)
        if engine.sandwich_norms:  # Gemma 3: the output normalised before the residual add
            out = self._norm(layer.post_attention_layernorm, out)
        output: torch.Tensor = hidden + out
        return output

    def mlp_item(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The residual stream after layer ``layer_index``'s MLP item, or None where this
        layer needs the general path."""
        engine = self.engine
        layer = engine.layers[layer_index]
        mlp = layer.mlp
        down, activation = getattr(mlp, "down_proj", None), getattr(mlp, "act_fn", None)
        if down is None or not isinstance(activation, nn.Module):
            return None
        sandwich = engine.sandwich_norms
        norm = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        normed = self._norm(norm, hidden)
        product = engine.fused_product("gate_up", layer_index, normed)
        if product is None or len(product[1]) != 2:
            return None
        fused, (gate_width, _) = product
        gated = activation(fused[..., :gate_width])
        gated.mul_(fused[..., gate_width:])  # as the general path: act(gate), then * up
        fed = engine.project(down, gated)
        if sandwich:
            fed = self._norm(layer.post_feedforward_layernorm, fed)
        output: torch.Tensor = hidden + fed
        return output


def query_lengths(starts: Sequence[int], widths: Sequence[int], q_len: int) -> torch.Tensor:
    """``(rows, q_len)`` int64: query ``i`` of row ``r`` sees ``starts[r] + i + 1`` keys;
    padding queries (``i >= widths[r]``) see one. Built in a few tensor ops: a loop of one
    ``arange`` per row, run for each of 30 layers, had cost a visible share of a 16-row
    round; a pass builds them once for all its layers."""
    start = torch.tensor(starts, dtype=torch.int64)[:, None]
    width = torch.tensor(widths, dtype=torch.int64)[:, None]
    offsets = torch.arange(q_len, dtype=torch.int64)[None, :]
    return torch.where(offsets < width, start + offsets + 1, 1)
