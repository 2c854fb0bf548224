"""Sliding-window (local) layers in the cost models: the context an item's attention pays for.

A local layer with window ``W`` (Gemma 3: five of every six layers, ``W = 512``) attends
only the last ``W`` keys (:mod:`knapspec.model.passes.sliding_window`), so its attention item
stops getting dearer once the context passes the window. The cost models therefore price
layer ``i``'s attention against its *effective context* ``min(n, W_i)`` (``n`` for a
global layer), and a full forward's context-dependent part against the layers' mean
effective context (its attention is the sum of every layer's). A line ``a + b·n`` fitted
over a ladder reaching past the window would price a local layer too low below it and far
too high above it.

Windows are stored per layer as ``(L,)`` window-or-None; a model without any window (Llama,
Qwen, Mistral as loaded) is the empty tuple ``()``, so that profiles written before windows
were recorded, and every windowless model's prices, stay what they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

Windows = tuple[int | None, ...]
"""Per layer, its sliding window in tokens or None (global); ``()``: no layer has one."""


def normalized_windows(value: Any) -> Windows:
    """``value`` as :data:`Windows`: a tuple, ``()`` when no layer has a window."""
    windows = tuple(None if w is None else int(w) for w in (value or ()))
    return windows if any(w is not None for w in windows) else ()


def engine_windows(engine: SublayerEngine) -> Windows:
    """The sliding windows ``engine`` attends with (its public ``windows``), normalized."""
    return normalized_windows(getattr(engine, "windows", None))


def check_windows(windows: Windows, num_layers: int) -> str | None:
    """Why ``windows`` cannot describe a model of ``num_layers`` layers, or None."""
    if not windows:
        return None
    if len(windows) != num_layers:
        return f"windows has {len(windows)} entries for {num_layers} layers"
    bad = [w for w in windows if w is not None and w < 1]
    return f"windows must be positive token counts or None, got {bad}" if bad else None


def effective_context(context_length: int, window: int | None) -> int:
    """Keys-worth of context one attention item pays for: ``min(n, window)``, ``n`` if global."""
    return context_length if window is None else min(context_length, window)


def mean_effective_context(context_length: int, windows: Windows) -> float:
    """The layers' mean effective context at ``n`` (``n`` itself when ``windows == ()``):
    the context a full forward's attention pays for, per layer."""
    if not windows:
        return context_length
    return sum(effective_context(context_length, w) for w in windows) / len(windows)


def executed_attention_context(
    executed: Sequence[bool], context_length: int, windows: Windows
) -> float:
    """``Σ min(n, W_i)`` over the layers whose attention item ``executed[2i]`` runs."""
    return float(
        sum(
            effective_context(context_length, window)
            for layer, window in enumerate(windows)
            if executed[2 * layer]
        )
    )


__all__ = [
    "Windows",
    "check_windows",
    "effective_context",
    "engine_windows",
    "executed_attention_context",
    "mean_effective_context",
    "normalized_windows",
]
