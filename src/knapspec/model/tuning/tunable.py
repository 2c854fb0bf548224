"""What the kernel autotuner needs of an engine: :class:`TunableEngine`.

:mod:`knapspec.model.tuning.autotune` and :mod:`knapspec.model.tuning.timing` measure products
on an engine's own weights and time whole engine steps, and
:class:`~knapspec.model.engine.SublayerEngine` asks them for its kernel table when it is
built. Naming the engine class in the tuner would make the two modules know each other;
this protocol names only the members the tuner reads, so the engine depends on the tuner
and never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from knapspec.model.cache import KVCache
from knapspec.model.kernels.fusion import FusedProjection
from knapspec.model.kernels.table import KernelTable


class TunableEngine(Protocol):
    """The part of :class:`~knapspec.model.engine.SublayerEngine` kernel tuning uses.

    Attributes:
        config: the model's transformers config (``model_type`` keys the cached table).
        layers: the decoder layers, each with ``self_attn.{q,k,v,o}_proj`` and
            ``mlp.{gate,up,down}_proj``.
        lm_head: the output projection.
        num_layers, vocab_size, max_context: the model's depth, vocabulary and context.
        device, dtype: where and in what precision the weights live.
    """

    config: Any
    layers: list[Any]
    lm_head: nn.Module
    num_layers: int
    vocab_size: int
    max_context: int
    device: torch.device
    dtype: torch.dtype

    def use_kernels(self, table: KernelTable) -> None:
        """Run few-row products as ``table`` says from now on."""

    def fusions(self, group: str) -> list[FusedProjection | None]:
        """Per layer, the fused projection of ``group`` (``"qkv"`` or ``"gate_up"``)."""
        ...

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A fresh cache for ``capacity`` tokens."""
        ...

    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        cache: KVCache,
        *,
        all_logits: bool = True,
    ) -> Any:
        """The full model over ``token_ids (q,)`` at positions ``start ..``; the result's
        fields are not read (the tuner only times the call)."""


__all__ = ["TunableEngine"]
