"""Sliding-window attention layers (Gemma 3's local layers), exact.

In a sliding layer with window ``W`` the token at position ``p`` attends to the keys at
positions ``p - W + 1 .. p`` (transformers' ``create_sliding_window_causal_mask``: key
``j`` is visible iff ``p - W < j <= p``). In the engine's terms a query row that would see
the first ``L = p + 1`` keys sees keys ``[max(0, L - W), L)``.

The cache keeps the K/V of the whole sequence in every layer (so cropping, rollback and
compaction stay what they are for global layers, and a layer's K/V slot is its position);
a windowed row reads a slice of it. The row-invariant kernel
(:mod:`knapspec.model.kernels.row_attention`) computes a row from its query, the keys it is given
and their count alone, so a row past the window is attended alone over the slice
``[L - W, L)``: what a one-token step at that position runs too, hence bitwise the same in
a verification of any width. Rows still inside the window (``L <= W``) see keys
``[0, L)`` as in a global layer and share one call. Keeping only the window per local
layer would bound the cache's memory; it is not done yet (rollback and compaction would
then need the evicted keys back).

A lean exact pass (:mod:`knapspec.model.passes.exact_pass`) and the compiled layer loop
attend the same way, from one plan per pass (:func:`windowed_rows`): the rows inside the
window in the pass's one kernel call (a row past it sees one key there, its output
discarded), then each row past it alone over exactly the keys the general path gives it
(a slice of its cache row; in a token tree, its visible keys gathered in slot order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from knapspec.model.kernels.row_attention import BatchedAttention, attend_rows

__all__ = [
    "WindowedRows",
    "attend_rows_windowed",
    "layer_windows",
    "ragged_window_mask",
    "window_visible",
    "windowed_rows",
]


def layer_windows(config: Any) -> list[int | None]:
    """Per layer, its sliding window in tokens, or None for full causal attention
    (``config.layer_types`` with ``config.sliding_window``; every layer None without)."""
    layer_types: Sequence[str] | None = getattr(config, "layer_types", None)
    layers = int(config.num_hidden_layers)
    if layer_types is None:
        return [None] * layers
    window = getattr(config, "sliding_window", None)
    return [
        int(window) if kind == "sliding_attention" and window is not None else None
        for kind in layer_types
    ]


def attend_rows_windowed(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """:func:`~knapspec.model.kernels.row_attention.attend_rows` where row ``i`` sees keys
    ``[max(0, lengths[i] - window), lengths[i])`` (all of ``[0, lengths[i])`` when
    ``window`` is None).

    Args:
        query: ``(H, q, hd)``; keys, values: ``(kvH, N, hd)``; lengths: ``(q,)`` int64.

    Returns:
        ``(H, q, hd)``: row ``(h, i)`` bitwise what a one-token step at position
        ``lengths[i] - 1`` computes (rows past the window are each one kernel call over
        their slice, as a one-token step's is).
    """
    if window is None or int(lengths.max()) <= window:
        return attend_rows(query, keys, values, lengths, scale)
    ends = lengths.tolist()
    inside = [row for row, end in enumerate(ends) if end <= window]
    out = torch.empty_like(query)
    if inside:
        index = torch.tensor(inside)
        out[:, index] = attend_rows(query[:, index], keys, values, lengths[index], scale)
    full = torch.tensor([window], dtype=torch.int64)
    for row, end in enumerate(ends):
        if end > window:
            first = end - window
            out[:, row : row + 1] = attend_rows(
                query[:, row : row + 1], keys[:, first:end], values[:, first:end], full, scale
            )
    return out


def window_visible(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor | None:
    """``(q, k)`` bool: whether key position ``key_positions[j]`` lies inside query
    ``i``'s window (``query_positions[i] - window < key_positions[j]``); None when
    ``window`` is None (every key is inside). Combine it with the causal mask."""
    if window is None:
        return None
    return key_positions.unsqueeze(0) > query_positions.unsqueeze(1) - window


def ragged_window_mask(
    starts: torch.Tensor, q_len: int, keys: int, groups: int, window: int
) -> torch.Tensor:
    """``(rows, 1, groups * q, keys)`` bool, laid out as
    :func:`~knapspec.model.passes.batched.ragged_mask`: packed query ``(g, t)`` of row ``r`` (at
    position ``starts[r] + t``) has key ``k`` inside its window, ``k > starts[r] + t -
    window``. AND it with the causal mask."""
    steps = torch.arange(q_len, device=starts.device)
    floors = (starts.unsqueeze(1) + steps - window).unsqueeze(2)  # (rows, q, 1)
    inside = torch.arange(keys, device=starts.device) > floors  # (rows, q, keys)
    return inside.repeat(1, groups, 1).unsqueeze(1)


class WindowedRows:
    """The query rows of one exact pass that see past a sliding window, and how each is
    attended (:func:`windowed_rows` builds it; module docstring).

    Attributes:
        inside: the pass's kernel call with every row past the window cut to one key (its
            output is replaced), or None where no row shares a call (a token tree whose
            view crosses the window: every node is attended alone, as the general path's
            ``_attend_tree_windowed`` does).
        entries: ``(E, 6)`` int64, one row per query attended alone: its cache row, its
            query step, the first and end slot of its contiguous keys, and for a tree node
            the slot of node 0 and the bit mask of the tree slots it sees past those
            (0 and 0 otherwise). With a mask its keys are gathered (slots ``[first, end)``
            then ``base + t`` for each set bit ``t``), without it they are the slice
            ``[first, end)`` of its cache row.
        heads: query heads per row; scale: the softmax scale.
    """

    def __init__(
        self, inside: BatchedAttention | None, entries: torch.Tensor, heads: int, scale: float
    ) -> None:
        self.inside = inside
        self.entries = entries.contiguous()
        self.heads, self.scale = heads, scale

    def keys_of(self, entry: int) -> torch.Tensor | None:
        """Entry ``entry``'s gathered key slots ``(count,)`` int64, or None for a slice."""
        _, _, first, end, base, mask = (int(v) for v in self.entries[entry])
        if not mask:
            return None
        bits = [t for t in range(64) if (mask & _ALL_BITS) >> t & 1]
        return torch.cat([torch.arange(first, end), base + torch.tensor(bits, dtype=torch.int64)])

    def attend(
        self,
        folded: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        merged: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The pass's attention ``(rows * H, q, hd)`` of ``folded (rows * H, q, hd)``
        queries over each row's cache ``keys``/``values (slots, kvH, capacity, hd)``
        (``merged``: the same as ``(rows * kvH, end, hd)`` views for the shared call)."""
        if self.inside is not None:
            out = self.inside(folded, *merged)
            if out is None:  # lengths, not tree rows: the kernel refuses none
                raise RuntimeError("the attention kernel refused rows inside the window")
        else:
            out = torch.empty_like(folded)
        heads = self.heads
        for entry, (row, step, first, end, _, _) in enumerate(self.entries.tolist()):
            query = folded[row * heads : (row + 1) * heads, step : step + 1]
            slots = self.keys_of(entry)
            if slots is None:
                row_keys, row_values = keys[row, :, first:end], values[row, :, first:end]
            else:
                row_keys, row_values = keys[row][:, slots], values[row][:, slots]
            count = torch.tensor([row_keys.shape[1]], dtype=torch.int64)
            out[row * heads : (row + 1) * heads, step : step + 1] = attend_rows(
                query, row_keys, row_values, count, self.scale
            )
        return out


_ALL_BITS = (1 << 64) - 1


def windowed_rows(
    inside: Callable[[torch.Tensor], BatchedAttention],
    window: int,
    heads: int,
    scale: float,
    lengths: torch.Tensor | None,
    tree: tuple[int, torch.Tensor, torch.Tensor] | None = None,
) -> WindowedRows | None:
    """The rows of one exact pass that see past ``window`` and how the general path attends
    them (:class:`WindowedRows`), or None where none does (the pass's call serves them all).

    Args:
        inside: lengths ``(rows, q)`` -> the pass's kernel call over those lengths.
        window: the layers' window in tokens; heads: query heads; scale: softmax scale.
        lengths: ``(rows, q)`` int64 keys each query sees (padding: 1), or None with ``tree``.
        tree: ``(start, positions, visible)`` of a token tree: node 0's slot, each node's
            position ``(q,)`` and visibility masks ``(q,)`` (as
            :class:`~knapspec.model.passes.tree.TreeLayout` holds them).
    """
    entries: list[list[int]] = []
    if tree is not None:
        start, positions, visible = tree
        at = positions.tolist()
        if max(at) + 1 <= window:
            return None
        for node, (position, signed) in enumerate(zip(at, visible.tolist(), strict=True)):
            floor = position - window + 1  # the first position inside the node's window
            mask = sum(1 << t for t in range(len(at)) if (signed >> t) & 1 and at[t] >= floor)
            first = min(max(floor, 0), start)
            entries.append([0, node, first, start, start, mask - (1 << 64) if mask >> 63 else mask])
        return WindowedRows(None, torch.tensor(entries, dtype=torch.int64), heads, scale)
    assert lengths is not None
    if int(lengths.max()) <= window:
        return None
    past = (lengths > window).nonzero().tolist()
    for row, step in past:
        end = int(lengths[row, step])
        entries.append([row, step, end - window, end, 0, 0])
    cut = torch.where(lengths > window, 1, lengths)
    return WindowedRows(inside(cut), torch.tensor(entries, dtype=torch.int64), heads, scale)
