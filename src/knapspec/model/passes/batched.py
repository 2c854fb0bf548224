"""One full-model step over a batch of rows, each at its own position (ragged).

Row ``r`` feeds ``q_r`` new tokens at positions ``starts[r] ..``; the rows are padded on
the right to ``q = max(q_r)``. Attention runs per row against that row's own cache with a
mask ``key <= start_r + t``, on the padded ``(rows, q)`` layout. The linear products
(projections, MLPs, LM head) run once over the batch through the engine's kernel table
(a batched decode step is a few-row product like a verify step): over all ``rows × q``
tokens when the rows are equally long (a padded token is any valid id; its output is
ignored and the K/V it writes lies beyond the row's length, overwritten by the row's next
step), and over the ``Σ q_r`` real tokens only, *packed*, when the caller gives each row's
width: a round where one row drafts 5 tokens and three draft none computes the products
of 9 tokens, not 24. Packed, only the real tokens' K/V are written. Attention stays one
padded call unless padding would at least double the attended queries
(:func:`splits_attention`): then the pass splits it, every row's first token in one
batched call (a plain batched step) and each wider row's later queries alone over its own
keys. A 2048-token round of four rows of widths (11, 1, 1, 1) spent about twice as long
per layer in the padded call as row by row, while near-equal widths ran faster padded (one
call, no per-row masks), and width-1 rows attended one call per row read their caches more
slowly than in one batched call at 8 rows (figures: ``results/engine/HISTORY.md``).

Under a :class:`~knapspec.types.SublayerMask` (a layer-skipping draft step shared by the
batch's rows) only the executed items run; a skipped attention item writes no K/V. The
draft's K/V lie past each row's committed length, where the full-model verification that
follows overwrites every layer (it covers every drafted position), so a row's committed
tokens are never touched by a draft.

A batch of one is not routed here: it runs :meth:`~knapspec.model.engine.SublayerEngine.forward`.

Sliding-window layers (Gemma 3) attend as the engine does alone: exact passes row by row
through :meth:`~knapspec.model.engine.SublayerEngine.attend_exact` where a row sees past
the window, other passes padded (never split) with the window in the mask.

Size: a little over 450 lines: the three attention layouts share the pass's masks and
lengths, and the sliding-window cases add a few lines to each.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import attrs
import torch
import torch.nn.functional as F

from knapspec.model.batch_cache import BatchKVCache
from knapspec.model.kernels.row_attention import EXACT_MAX_QUERIES, attend_rows_batched
from knapspec.model.passes.exact_pass import ExactLayerPass, query_lengths
from knapspec.model.passes.sliding_window import ragged_window_mask

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.types import SublayerMask


def new_batch_cache(engine: SublayerEngine, rows: int, capacity: int) -> BatchKVCache:
    """A zeroed batch cache for ``rows`` sequences of up to ``capacity`` tokens each."""
    return BatchKVCache(
        engine.num_layers,
        rows,
        engine.kv_heads,
        engine.head_dim,
        capacity,
        dtype=engine.dtype,
        device=engine.device,
        compiled_writes=engine.compiled_writes,
    )


#: Split a ragged pass's attention (first tokens batched, later queries row by row) when
#: the padded layout's ``rows × q`` queries are at least this many times the ``Σ q_r`` real
#: ones (a layout rule, the same on every machine: how much of the padded call's work is
#: padding).
SPLIT_PADDING_FACTOR = 2

AttentionLayout = Literal["auto", "padded", "split"]


def splits_attention(rows: int, width: int, tokens: int) -> bool:
    """Whether a pass of ``rows`` rows padded to ``width`` with ``tokens`` real tokens in
    all splits its attention: every row's first token in one call, the later queries of
    the rows that draft row by row (the cost models price each row at its own width
    there)."""
    return rows > 1 and rows * width >= SPLIT_PADDING_FACTOR * tokens


def later_masks(
    starts: Sequence[int], widths: Sequence[int], groups: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per row, the ``(groups * (q_r - 1), start_r + q_r)`` bool mask of its queries after
    the first over its own keys (query ``t >= 1`` sees keys ``<= start_r + t``); None for a
    row of one token."""
    masks: list[torch.Tensor | None] = []
    for start, width in zip(starts, widths, strict=True):
        if width == 1:
            masks.append(None)
            continue
        mask = torch.ones(width - 1, start + width, dtype=torch.bool, device=device)
        mask[:, start + 1 :] = torch.ones(
            width - 1, width - 1, dtype=torch.bool, device=device
        ).tril()
        masks.append(mask.repeat(groups, 1))
    return masks


@attrs.frozen
class FirstQueries:
    """The first new token of every row, attended in one batched call.

    Attributes:
        starts: each row's first new position.
        index: ``(rows,)`` packed index of each row's first token.
        end: keys the call reads, ``max(starts) + 1``.
        mask: ``(rows, 1, groups, end)`` ragged mask (:func:`ragged_mask` for one token).
    """

    starts: tuple[int, ...]
    index: torch.Tensor
    end: int
    mask: torch.Tensor


def ragged_mask(starts: torch.Tensor, q_len: int, keys: int, groups: int) -> torch.Tensor:
    """``(rows, 1, groups * q, keys)`` bool: packed query ``(g, t)`` of row ``r`` sees key
    ``k`` iff ``k <= starts[r] + t`` (its row's cached tokens and its own causal prefix)."""
    steps = torch.arange(q_len, device=starts.device)
    limits = (starts.unsqueeze(1) + steps).unsqueeze(2)  # (rows, q, 1)
    columns = torch.arange(keys, device=starts.device)
    mask = columns <= limits  # (rows, q, keys)
    return mask.repeat(1, groups, 1).unsqueeze(1)


def _split_attention(
    engine: SublayerEngine,
    query: torch.Tensor,
    cache: BatchKVCache,
    layer_index: int,
    first: FirstQueries,
    widths: Sequence[int],
    masks: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """Every row's first query in one call (a plain batched step), then each wider row's
    later queries over its own keys, one call per such row: ``query (1, H, T, hd)``
    packed (row ``r``'s ``q_r`` in order) -> ``(1, T, H * hd)``."""
    heads, kv_heads, head_dim = engine.num_heads, engine.kv_heads, engine.head_dim
    groups = engine.kv_groups
    rows = len(widths)
    firsts = query[0][:, first.index].transpose(0, 1)  # (rows, H, hd)
    plain = F.scaled_dot_product_attention(
        firsts.reshape(rows, kv_heads, groups, head_dim),
        cache.keys(layer_index, first.end),
        cache.values(layer_index, first.end),
        attn_mask=first.mask,
        scale=engine.attention_scale,
    ).reshape(rows, heads, 1, head_dim)
    pieces = []
    offset = 0
    for row, (start, width) in enumerate(zip(first.starts, widths, strict=True)):
        pieces.append(plain[row : row + 1])
        if width > 1:
            later = query[:, :, offset + 1 : offset + width]
            pieces.append(
                F.scaled_dot_product_attention(
                    later.reshape(1, kv_heads, groups * (width - 1), head_dim),
                    cache.row_keys(layer_index, row, start + width),
                    cache.row_values(layer_index, row, start + width),
                    attn_mask=masks[row],
                    scale=engine.attention_scale,
                ).reshape(1, heads, width - 1, head_dim)
            )
        offset += width
    return torch.cat(pieces, dim=2).transpose(1, 2).reshape(1, -1, heads * head_dim)


def _exact_attention(
    engine: SublayerEngine,
    query: torch.Tensor,
    cache: BatchKVCache,
    layer_index: int,
    starts: Sequence[int],
    widths: Sequence[int],
    packed: bool,
    lengths: torch.Tensor,
) -> torch.Tensor:
    """Every row's queries over its own keys through the row-invariant kernel, so that a
    row computes bitwise what it computes decoded alone (the exactness contract):
    ``query (1, H, T, hd)`` packed or ``(rows, H, q, hd)`` padded -> ``(1, T, H * hd)`` or
    ``(rows, q, H * hd)``; ``lengths`` from :func:`_query_lengths` (the same every layer).
    In a sliding layer that some row sees past, row by row, as each runs alone."""
    window = engine.windows[layer_index]
    if window is None or int(lengths.max()) <= window:
        window = None
        together = _exact_attention_together(
            engine, query, cache, layer_index, starts, widths, packed, lengths
        )
        if together is not None:
            return together
    pieces = []
    offset = 0
    for row, (start, width) in enumerate(zip(starts, widths, strict=True)):
        row_query = query[0, :, offset : offset + width] if packed else query[row, :, :width]
        pieces.append(
            engine.attend_exact(
                row_query,
                cache.row_keys(layer_index, row, start + width)[0],
                cache.row_values(layer_index, row, start + width)[0],
                start,
                window,
            )
        )
        offset += width
    if packed:
        return torch.cat(pieces, dim=1)
    q_len = query.shape[2]
    if any(width != q_len for width in widths):  # padding: its attention is never read
        pieces = [
            torch.cat([piece, piece.new_zeros(1, q_len - piece.shape[1], piece.shape[2])], 1)
            for piece in pieces
        ]
    return torch.cat(pieces, dim=0)


def _exact_attention_together(
    engine: SublayerEngine,
    query: torch.Tensor,
    cache: BatchKVCache,
    layer_index: int,
    starts: Sequence[int],
    widths: Sequence[int],
    packed: bool,
    lengths: torch.Tensor,
) -> torch.Tensor | None:
    """:func:`_exact_attention` in one kernel call for all rows (bitwise the same: a query
    row's output depends on its own query, keys and length only), or None where the
    compiled kernel does not serve. Padded query rows see one key and are dropped."""
    rows = len(widths)
    q_len = max(widths)
    heads, head_dim = engine.num_heads, engine.head_dim
    if packed:
        padded = query.new_zeros(rows, heads, q_len, head_dim)
        offset = 0
        for row, width in enumerate(widths):
            padded[row, :, :width] = query[0, :, offset : offset + width]
            offset += width
    else:
        padded = query[:, :, :q_len]
    end = max(start + width for start, width in zip(starts, widths, strict=True))
    out = attend_rows_batched(
        padded,
        cache.keys(layer_index, end),
        cache.values(layer_index, end),
        lengths,
        engine.attention_scale,
    )
    if out is None:
        return None
    out = out.transpose(1, 2)  # (rows, q, H, hd)
    if packed:
        pieces = [out[row, :width] for row, width in enumerate(widths)]
        return torch.cat(pieces).reshape(1, -1, heads * head_dim)
    result = out.reshape(rows, q_len, heads * head_dim)
    if any(width != q_len for width in widths):  # padding: never read; zero as before
        result = result.clone()
        for row, width in enumerate(widths):
            result[row, width:] = 0
    if query.shape[2] != q_len:
        result = torch.cat(
            [result, result.new_zeros(rows, query.shape[2] - q_len, result.shape[2])], 1
        )
    return result


def _padded_attention(
    engine: SublayerEngine,
    query: torch.Tensor,
    cache: BatchKVCache,
    layer_index: int,
    end: int,
    visible: torch.Tensor,
    packing: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One attention call over the rows padded to ``q``: ``query`` is ``(rows, H, q, hd)``,
    or ``(1, H, T, hd)`` packed (scattered onto the padding, gathered back after); returns
    ``(rows, q, H * hd)``, or ``(1, T, H * hd)`` packed."""
    rows, q_len = visible.shape[0], visible.shape[2] // engine.kv_groups
    heads, kv_heads, head_dim = engine.num_heads, engine.kv_heads, engine.head_dim
    if packing is not None:
        padded = query.new_zeros(rows, heads, q_len, head_dim)
        padded[packing[0], :, packing[1]] = query[0].transpose(0, 1)
        query = padded
    # Query heads sharing a K/V head are packed along the query axis (no repeat_kv).
    out = F.scaled_dot_product_attention(
        query.reshape(rows, kv_heads, engine.kv_groups * q_len, head_dim),
        cache.keys(layer_index, end),
        cache.values(layer_index, end),
        attn_mask=visible,
        scale=engine.attention_scale,
    ).reshape(rows, heads, q_len, head_dim)
    if packing is None:
        return out.transpose(1, 2).reshape(rows, q_len, heads * head_dim)
    return out[packing[0], :, packing[1]].reshape(1, -1, heads * head_dim)


@torch.inference_mode()
def forward_batch(
    engine: SublayerEngine,
    token_ids: torch.Tensor,
    starts: list[int],
    cache: BatchKVCache,
    *,
    all_logits: bool = True,
    mask: SublayerMask | None = None,
    widths: Sequence[int] | None = None,
    attention: AttentionLayout = "auto",
    packed_logits: bool = False,
) -> torch.Tensor:
    """Run the model (the items of ``mask``; all when None) over ``q`` new tokens per row,
    writing the K/V of every executed attention item.

    Args:
        token_ids: ``(rows, q)`` new tokens, right-padded per row.
        starts: per row, the position of its first new token; the row must hold exactly
            the positions before it (its cache length).
        cache: the batch's cache (its active rows are the ``rows`` rows, in order).
        all_logits: logits for every position, or only for the last column.
        mask: the sub-network to run (a draft step); None runs the full model.
        widths: per row, its real tokens ``q_r`` in ``[1, q]`` (the rest is padding);
            ragged widths run the products packed. None: every row has ``q``.
        attention: ``"auto"`` (:func:`splits_attention` decides for a ragged pass),
            ``"padded"`` or ``"split"`` (the tests compare the two).
        packed_logits: with ``all_logits``, return the ``(Σ q_r, vocab)`` logits of the
            real tokens, row after row, instead of the padded ``(rows, q, vocab)``: a
            fresh padded tensor of logits is tens of MB to zero (4 rows × 11 tokens ×
            49152 entries: 8.6 MB, whose zeroing is mostly page faults).

    Returns:
        ``(rows, q, vocab)`` float32 logits (zeros at padded positions when packed),
        ``(Σ q_r, vocab)`` with ``packed_logits``, or ``(rows, vocab)`` for each row's last
        real token. The caller sets each row's new
        length (:meth:`BatchKVCache.set_lengths`).
    """
    rows, q_len = token_ids.shape
    if mask is not None and mask.num_items != engine.num_items:
        raise ValueError(f"mask has {mask.num_items} items, the model {engine.num_items}")
    executed = mask.executed if mask is not None else (True,) * engine.num_items
    if rows != cache.rows or len(starts) != rows:
        raise ValueError(
            f"token_ids has {rows} rows, starts {len(starts)}, the cache {cache.rows} active rows"
        )
    for row, start in enumerate(starts):
        if start != cache.lengths[row]:
            raise RuntimeError(
                f"row {row}: the cache holds {cache.lengths[row]} tokens but the step starts "
                f"at position {start}"
            )
    # Padding may run past a row's real tokens; the real ones are checked by the caller.
    engine.check_context(max(starts) + 1)
    device = engine.device
    start_tensor = torch.tensor(starts, device=device)
    packing: tuple[torch.Tensor, torch.Tensor] | None = None
    if widths is not None:
        if len(widths) != rows or any(not 1 <= w <= q_len for w in widths):
            raise ValueError(f"widths {list(widths)} must give each of {rows} rows 1..{q_len}")
        if any(w != q_len for w in widths):
            # (T,) row and step of every real token, T = Σ widths.
            row_of = torch.repeat_interleave(torch.arange(rows), torch.tensor(list(widths)))
            step_of = torch.cat([torch.arange(w) for w in widths])
            packing = (row_of.to(device), step_of.to(device))
    if packing is None:
        hidden = engine.embed_tokens(token_ids.to(device))  # (rows, q, d)
        positions = start_tensor.unsqueeze(1) + torch.arange(q_len, device=device)
        index = cache.write_index(start_tensor, q_len)  # (rows, q) each
    else:
        row_of, step_of = packing
        hidden = engine.embed_tokens(token_ids.to(device)[row_of, step_of]).unsqueeze(0)
        positions = (start_tensor[row_of] + step_of).unsqueeze(0)  # (1, T)
        cache.check_room(int(positions.max()) + 1)
        index = (row_of.unsqueeze(0), positions)  # (1, T) each
    cos, sin = engine.rotary_tables(hidden, positions)
    end = max(starts) + q_len
    groups = engine.kv_groups
    row_widths_all = list(widths) if widths is not None else [q_len] * rows
    exact = engine.exact and max(row_widths_all) <= EXACT_MAX_QUERIES
    windows = {w for w in engine.windows if w is not None and w < end}
    split = (
        not exact
        and not windows  # the split layout's masks know no window
        and packing is not None
        and (
            attention == "split"
            or (attention == "auto" and splits_attention(rows, q_len, int(row_of.numel())))
        )
    )
    if split:
        row_widths = list(widths or ())
        masks = later_masks(starts, row_widths, groups, device)
        offsets = [0, *itertools.accumulate(row_widths)][:-1]
        first = FirstQueries(
            tuple(starts),
            torch.tensor(offsets, device=device),
            max(starts) + 1,
            ragged_mask(start_tensor, 1, max(starts) + 1, groups),
        )
    elif not exact:
        visible = ragged_mask(start_tensor, q_len, end, groups)
        windowed = {
            w: visible & ragged_window_mask(start_tensor, q_len, end, groups, w) for w in windows
        }
    lean: ExactLayerPass | None = None
    if exact:
        lengths = query_lengths(starts, row_widths_all, max(row_widths_all))
        packed = packing is not None
        # Same kernels as below, per-pass work done once; the layer loop in one C call.
        lean = ExactLayerPass.prepare(
            engine, cache, cache.compiled_writes, cos, sin, index, lengths, packing
        )
    looped = lean.run_layers(hidden, executed) if lean is not None else None
    for layer_index, layer in enumerate(engine.layers if looped is None else ()):
        attend = executed[2 * layer_index]
        stepped = lean.attention_item(layer_index, hidden) if lean and attend else None
        if stepped is not None:
            hidden = stepped
        elif attend:
            normed = engine.normed(layer.input_layernorm, hidden)
            query, key, value = engine.project_qkv(layer_index, normed, cos, sin)
            cache.write(layer_index, index, key, value)
            if exact:
                attended = _exact_attention(
                    engine, query, cache, layer_index, starts, row_widths_all, packed, lengths
                )
            elif split:
                attended = _split_attention(
                    engine, query, cache, layer_index, first, row_widths, masks
                )
            else:
                window = engine.windows[layer_index]
                seen = visible if window is None else windowed.get(window, visible)
                attended = _padded_attention(engine, query, cache, layer_index, end, seen, packing)
            hidden = engine.attention_residual(layer_index, hidden, attended)
        if executed[2 * layer_index + 1]:
            hidden = engine.mlp_item(layer_index, hidden, lean)
    hidden = hidden if looped is None else looped
    if packing is None:
        if all_logits and packed_logits:
            return engine.logits(hidden.reshape(rows * q_len, -1))
        return engine.logits(hidden if all_logits else hidden[:, -1])
    if not all_logits:  # each row's last real token
        last = torch.tensor(list(widths or ()), device=device).cumsum(0) - 1
        return engine.logits(hidden[0, last])
    logits = engine.logits(hidden[0])  # (T, vocab)
    if packed_logits:
        return logits
    result = logits.new_zeros(rows, q_len, logits.shape[-1])
    result[packing] = logits
    return result


__all__ = [
    "SPLIT_PADDING_FACTOR",
    "AttentionLayout",
    "FirstQueries",
    "forward_batch",
    "later_masks",
    "new_batch_cache",
    "ragged_mask",
    "splits_attention",
]
