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
of 9 tokens, not 24. Packed, only the real tokens' K/V are written.

Under a :class:`~knapspec.types.SublayerMask` (a layer-skipping draft step shared by the
batch's rows) only the executed items run; a skipped attention item writes no K/V. The
draft's K/V lie past each row's committed length, where the full-model verification that
follows overwrites every layer (it covers every drafted position), so a row's committed
tokens are never touched by a draft.

The engine's own :meth:`~knapspec.model.engine.SublayerEngine.forward` stays the
single-sequence path, unchanged: a batch of one is not routed through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from knapspec.model.batch_cache import BatchKVCache

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
    )


def ragged_mask(starts: torch.Tensor, q_len: int, keys: int, groups: int) -> torch.Tensor:
    """``(rows, 1, groups * q, keys)`` bool: packed query ``(g, t)`` of row ``r`` sees key
    ``k`` iff ``k <= starts[r] + t`` (its row's cached tokens and its own causal prefix)."""
    steps = torch.arange(q_len, device=starts.device)
    limits = (starts.unsqueeze(1) + steps).unsqueeze(2)  # (rows, q, 1)
    columns = torch.arange(keys, device=starts.device)
    mask = columns <= limits  # (rows, q, keys)
    return mask.repeat(1, groups, 1).unsqueeze(1)


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

    Returns:
        ``(rows, q, vocab)`` float32 logits (zeros at padded positions when packed), or
        ``(rows, vocab)`` for each row's last real token. The caller sets each row's new
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
    cos, sin = engine.rotary_emb(hidden, positions)
    end = max(starts) + q_len
    visible = ragged_mask(start_tensor, q_len, end, engine.kv_groups)
    heads, kv_heads, head_dim = engine.num_heads, engine.kv_heads, engine.head_dim
    for layer_index, layer in enumerate(engine.layers):
        if executed[2 * layer_index]:
            normed = layer.input_layernorm(hidden)
            query, key, value = engine._project_qkv(layer_index, normed, cos, sin)
            cache.write(layer_index, index, key, value)
            if packing is not None:  # scatter the (1, H, T, hd) queries onto the padding
                padded = query.new_zeros(rows, heads, q_len, head_dim)
                padded[packing[0], :, packing[1]] = query[0].transpose(0, 1)
                query = padded
            # Query heads sharing a K/V head are packed along the query axis (no repeat_kv).
            out = F.scaled_dot_product_attention(
                query.reshape(rows, kv_heads, engine.kv_groups * q_len, head_dim),
                cache.keys(layer_index, end),
                cache.values(layer_index, end),
                attn_mask=visible,
                scale=engine._scaling,
            ).reshape(rows, heads, q_len, head_dim)
            if packing is None:
                attended = out.transpose(1, 2).reshape(rows, q_len, heads * head_dim)
            else:  # gather the real tokens back: (1, T, H * hd)
                attended = out[packing[0], :, packing[1]].reshape(1, -1, heads * head_dim)
            hidden = hidden + engine._project(layer.self_attn.o_proj, attended)
        if executed[2 * layer_index + 1]:
            hidden = engine._mlp_item(layer_index, hidden)
    if packing is None:
        return engine.logits(hidden if all_logits else hidden[:, -1])
    if not all_logits:  # each row's last real token
        last = torch.tensor(list(widths or ()), device=device).cumsum(0) - 1
        return engine.logits(hidden[0, last])
    logits = engine.logits(hidden[0])  # (T, vocab)
    result = logits.new_zeros(rows, q_len, logits.shape[-1])
    result[packing] = logits
    return result


__all__ = ["forward_batch", "new_batch_cache", "ragged_mask"]
