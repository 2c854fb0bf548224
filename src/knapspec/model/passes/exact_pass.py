"""An exact batched pass's layer items with their per-pass work done once.

:func:`~knapspec.model.passes.batched.forward_batch` on an exact CPU engine runs, per layer, the
same few compiled calls (RMSNorm, the fused q/k/v product, rotary, two K/V writes, the
row-invariant attention, the output product, RMSNorm, the fused gate/up product, SiLU,
the down product). Through the engine's general methods each item also recomputed what
is the same for all of a pass's layers (the rotary tables' layout, the K/V write
indices' checks, the attention's per-row lengths, thread split and unit), checked its
inputs' layouts again and padded ragged rows one slice at a time: on a 2-core AMD EPYC
Zen 4 (bfloat16, SmolLM2-135M) a one-row round spent 5.3 of its 13.5 ms outside the
kernels, a 16-row round 7.8 of 28.8 ms.

:class:`ExactLayerPass` prepares that work once per pass and runs each item with the
same kernels on the same inputs, so every output and every K/V entry is bitwise what the
general path computes (the tests compare the two). Where an item's layer does not fit
(a fusion undone by replaced weights, q/k norms, another activation, a kernel that is
not compiled here) :meth:`ExactLayerPass.attention_item` / :meth:`mlp_item` return None
and the caller runs the general path for that item.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from knapspec.model.kernels import layer_loop, layer_ops, row_attention
from knapspec.model.kernels.fusion import FusedProjection

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
    compiled_rotary: bool
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


def _silu_module(module: nn.Module | None) -> bool:
    """Whether ``module`` is exactly ``F.silu`` (what the general path calls it for)."""
    return type(module) in (SiLUActivation, nn.SiLU)


class ExactLayerPass:
    """One exact batched pass over ``N`` token rows (``rows × q`` padded-equal, or ``T``
    packed), prepared for all of its layers (module docstring). Build it with
    :meth:`prepare`, which returns None where the pass as a whole does not fit.

    Args:
        engine, cache: the pass's engine and cache.
        rows: the rows the pass runs (a batch cache's active rows; 1 for a sequence).
        cos, sin: the rotary tables, ``(N, hd)`` contiguous in the engine's dtype.
        write_rows, write_positions: each token's cache row and position, ``(N,)`` int64
            contiguous.
        attention: the prepared attention call (its per-row lengths ``(rows, q_max)``).
        packing: each packed token's row and step, or None (every row ``q`` tokens).
    """

    def __init__(
        self,
        engine: LeanEngine,
        cache: LayerBuffers,
        rows: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: torch.Tensor,
        write_positions: torch.Tensor,
        attention: row_attention.BatchedAttention,
        packing: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.engine = engine
        self.cache = cache
        self._cos, self._sin = cos, sin
        self._write_rows, self._write_positions = write_rows, write_positions
        self._attention = attention
        self._packing = packing
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
    ) -> ExactLayerPass | None:
        """The pass over ``index``'s tokens, or None where it does not fit (an inexact
        engine, no compiled layer operations or attention kernel, q/k norms) or the engine
        turned it off (:attr:`EnginePaths.lean_passes`).

        Args:
            compiled_writes: whether the cache may be written through the compiled copy.
            cos, sin: the rotary tables, ``(rows, q, hd)`` or ``(1, T, hd)``.
            index: each token's cache row and position, ``(rows, q)`` or ``(1, T)`` int64.
            lengths: ``(rows, q_max)`` keys each query row sees (padding rows: 1), or
                None with ``tree``.
            packing: each packed token's row and step, or None (every row ``q`` tokens).
            tree: one sequence's token tree instead of ``lengths``: ``(prefix, visible)``
                as :func:`~knapspec.model.kernels.row_attention.attend_tree_rows` takes them (node
                ``i`` written at the slot ``index`` gives it).
        """
        library = row_attention.load_library()
        if (
            library is None
            or not engine.paths.lean_passes
            or not engine.exact
            or not engine.compiled_norms
            or not engine.compiled_rotary
            or not compiled_writes
            or engine.has_qk_norm
            or engine.dtype not in _DTYPES
        ):
            return None
        rows_index, positions = index
        tokens, head_dim = rows_index.numel(), engine.head_dim
        if (
            cos.dtype != engine.dtype
            or sin.dtype != engine.dtype
            or cos.numel() != tokens * head_dim
            or sin.numel() != tokens * head_dim
            or positions.numel() != tokens
            or rows_index.dtype != torch.int64
            or positions.dtype != torch.int64
        ):
            return None
        attention = row_attention.BatchedAttention(
            library,
            lengths,
            engine.num_heads,
            engine.kv_heads,
            head_dim,
            engine.dtype,
            engine.attention_scale,
            tree,
        )
        prepared = cls(
            engine,
            cache,
            lengths.shape[0] if lengths is not None else 1,
            cos.reshape(tokens, head_dim).contiguous(),
            sin.reshape(tokens, head_dim).contiguous(),
            rows_index.reshape(tokens).contiguous(),
            positions.reshape(tokens).contiguous(),
            attention,
            packing,
        )
        prepared.end = int(positions.max()) + 1  # every row's last real token sees that far
        return prepared

    def _norm(self, norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The compiled RMSNorm of ``hidden (..., d)`` (what the engine's ``normed`` runs)."""
        return layer_ops.apply_norm(norm, hidden)

    def _attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        """Row-invariant attention of ``query (N, H, hd)`` over each row's own cache ->
        ``(N, H * hd)``: the general path's padding, kernel call and gathering."""
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
        out = self._attention(
            folded, keys.as_strided(merged, strides), values.as_strided(merged, strides)
        )
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
            self._cos,
            self._sin,
            self._write_rows,
            self._write_positions,
            self._packing,
            self._attention,
            self.rows,
            self.end,
            executed,
        )

    def attention_item(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The residual stream ``(rows, q, d)`` / ``(1, T, d)`` after layer
        ``layer_index``'s attention item (its K/V written), or None where this layer needs
        the general path (nothing written then)."""
        engine = self.engine
        layer = engine.layers[layer_index]
        o_proj = layer.self_attn.o_proj
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
        layer_ops.rotary_heads_(query, self._cos, self._sin)
        layer_ops.rotary_heads_(key, self._cos, self._sin)
        keys, values = self.cache.buffers(layer_index)
        layer_ops.scatter_heads_(keys, self._write_rows, self._write_positions, key)
        layer_ops.scatter_heads_(values, self._write_rows, self._write_positions, value)
        attended = self._attend(layer_index, query).view(*hidden.shape[:-1], q_width)
        output: torch.Tensor = hidden + engine.project(o_proj, attended)
        return output

    def mlp_item(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The residual stream after layer ``layer_index``'s MLP item, or None where this
        layer needs the general path."""
        engine = self.engine
        layer = engine.layers[layer_index]
        mlp = layer.mlp
        down = getattr(mlp, "down_proj", None)
        if down is None or not _silu_module(getattr(mlp, "act_fn", None)):
            return None
        normed = self._norm(layer.post_attention_layernorm, hidden)
        product = engine.fused_product("gate_up", layer_index, normed)
        if product is None or len(product[1]) != 2:
            return None
        fused, (gate_width, _) = product
        gated = F.silu(fused[..., :gate_width])
        gated.mul_(fused[..., gate_width:])  # as the general path: act(gate), then * up
        output: torch.Tensor = hidden + engine.project(down, gated)
        return output


def query_lengths(starts: Sequence[int], widths: Sequence[int], q_len: int) -> torch.Tensor:
    """``(rows, q_len)`` int64: query ``i`` of row ``r`` sees ``starts[r] + i + 1`` keys;
    padding queries (``i >= widths[r]``) see one. Built in a few tensor ops: a loop of one
    ``arange`` per row, run for each of 30 layers, had cost 2 ms of a 16-row round; a pass
    builds them once for all its layers."""
    start = torch.tensor(starts, dtype=torch.int64)[:, None]
    width = torch.tensor(widths, dtype=torch.int64)[:, None]
    offsets = torch.arange(q_len, dtype=torch.int64)[None, :]
    return torch.where(offsets < width, start + offsets + 1, 1)
