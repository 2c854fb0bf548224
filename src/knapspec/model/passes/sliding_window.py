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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from knapspec.model.kernels.row_attention import attend_rows

__all__ = ["attend_rows_windowed", "layer_windows", "ragged_window_mask", "window_visible"]


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
