"""The cost-model interface: predicted latencies that weigh knapsack items and price TPT."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from knapspec.components import Component
from knapspec.registry import Registry
from knapspec.types import SublayerMask

if TYPE_CHECKING:
    pass


@attrs.frozen
class LatencyObservation:
    """A step time measured by the decoder, fed to :meth:`CostModel.observe`.

    Attributes:
        kind: ``"draft"`` (one draft token with ``mask``) or ``"verify"`` (a full forward
            over ``tokens`` tokens).
        context_length: tokens in the cache before the step.
        seconds: measured wall time of the step (including per-step overhead).
        tokens: tokens processed in one forward (1 for a draft step).
        mask: the draft mask (None for verify).
    """

    kind: str
    context_length: int
    seconds: float
    tokens: int = 1
    mask: SublayerMask | None = None


def knapsack_weights(t_attn: float, t_mlp: float) -> tuple[int, int]:
    """Integer knapsack weights ``(w_attn, w_mlp)`` from item latencies.

    ``Δ = min(t_attn, t_mlp)``; ``w = round(t / Δ)`` (at least 1), so the lighter kind
    weighs 1 and the heavier kind its latency ratio (method spec §2).
    """
    if not (t_attn > 0 and t_mlp > 0):
        raise ValueError(f"item latencies must be positive, got t_attn={t_attn}, t_mlp={t_mlp}")
    delta = min(t_attn, t_mlp)
    return max(1, round(t_attn / delta)), max(1, round(t_mlp / delta))


class CostModel(Component, abc.ABC):
    """Predicts decode latencies (seconds) on the current machine.

    Subclasses implement the per-item times, the per-step overhead and the verify cost;
    the draft cost, the weights and the AR step cost derive from them.
    """

    @abc.abstractmethod
    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        """One attention item for one new token at ``context_length`` (layer None = mean)."""

    @abc.abstractmethod
    def t_mlp(self, layer: int | None = None) -> float:
        """One MLP item for one new token (constant in context)."""

    @abc.abstractmethod
    def overhead(self, context_length: int) -> float:
        """Fixed per-step time: embedding, final norm, LM head, sampling, Python."""

    @abc.abstractmethod
    def verify_cost(self, tokens: int, context_length: int) -> float:
        """Full forward over ``tokens`` new tokens at ``context_length``, overhead included."""

    def draft_cost(self, mask: SublayerMask, context_length: int) -> float:
        """One draft token with ``mask`` (overhead included)."""
        total = self.overhead(context_length)
        for layer in range(mask.num_layers):
            if mask.attention(layer):
                total += self.t_attn(context_length, layer)
            if mask.mlp(layer):
                total += self.t_mlp(layer)
        return total

    def step_cost(self, context_length: int) -> float:
        """One plain autoregressive step (the γ = 0 round)."""
        return self.verify_cost(1, context_length)

    def weights(self, context_length: int) -> tuple[int, int]:
        """Integer knapsack weights ``(w_attn, w_mlp)`` at ``context_length``."""
        return knapsack_weights(self.t_attn(context_length), self.t_mlp())

    def item_weights(self, context_length: int, windows: Sequence[int | None]) -> tuple[int, ...]:
        """``(2L,)`` integer knapsack weight of each engine item (attention ``2i``, MLP
        ``2i + 1``) at ``context_length`` for a model whose layer ``i`` attends over the
        sliding window ``windows[i]`` (None: every key).

        Without windows every attention item weighs ``w_attn`` and every MLP ``w_mlp``
        (:meth:`weights`). With them the attention items form one class per window (the
        global layers one more): a class's time is its layers' mean ``t_attn(n, i)``,
        ``Δ`` the least of the class times and ``t_mlp()``, and each weight
        ``round(t / Δ)`` (at least 1), so that past the window a local layer weighs less
        than a global one.
        """
        layers = len(windows)
        if all(window is None for window in windows):
            w_attn, w_mlp = self.weights(context_length)
            return (w_attn, w_mlp) * layers
        classes = {
            window: [i for i in range(layers) if windows[i] == window]
            for window in dict.fromkeys(windows)
        }
        times = {
            window: sum(self.t_attn(context_length, i) for i in members) / len(members)
            for window, members in classes.items()
        }
        t_mlp = self.t_mlp()
        if not (t_mlp > 0 and all(t > 0 for t in times.values())):
            raise ValueError(f"item latencies must be positive, got {times} and t_mlp={t_mlp}")
        delta = min(t_mlp, *times.values())
        attention = {window: max(1, round(t / delta)) for window, t in times.items()}
        w_mlp = max(1, round(t_mlp / delta))
        return tuple(w for window in windows for w in (attention[window], w_mlp))

    def observe(self, observation: LatencyObservation) -> None:
        """Learn from a measured step; static models ignore it."""


COST_MODELS: Registry[CostModel] = Registry("cost model")

__all__ = ["COST_MODELS", "CostModel", "LatencyObservation", "knapsack_weights"]
