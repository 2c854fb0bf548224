"""The layer-skipping draft: the target with a sublayer mask, one token at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.costmodels.base import LatencyObservation
from knapspec.decoding.verify import check_finite
from knapspec.drafters.base import DRAFTERS, SUBNETWORK, Draft, Drafter

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.types import SublayerMask

#: ``(logits (vocab,), drafts so far) -> (token, q)``: argmax with ``q = None``, or a sample
#: and its processed distribution ``q (vocab,)`` (the caller applies its logits processor).
TokenChooser = Callable[[torch.Tensor, list[int]], tuple[int, "torch.Tensor | None"]]


@attrs.frozen
class SubnetworkConfig:
    """The sub-network drafter has no hyper-parameters of its own: the planner picks the
    mask and γ, the decoder's ``confidence_threshold`` the early exit."""


@DRAFTERS.register(SUBNETWORK)
class SubnetworkDrafter(Drafter):
    """Drafts with ``f^(S)``: the engine running only the plan's mask, writing the cache
    at the draft positions (verification overwrites them)."""

    config_class = SubnetworkConfig

    def __init__(self, config: SubnetworkConfig | None = None) -> None:
        self.config = config if config is not None else SubnetworkConfig()

    def propose(
        self,
        engine: SublayerEngine,
        cache: KVCache,
        mask: SublayerMask,
        pending: int,
        position: int,
        budget: int,
        choose: TokenChooser,
        *,
        confidence_threshold: float,
        cost_model: CostModel | None,
        clock: Callable[[], float],
    ) -> Draft:
        """Up to ``budget`` tokens after ``pending`` (at ``position``), stopping after the
        first token whose top-1 draft probability is below ``confidence_threshold`` (that
        token is still drafted and verified). Every step's time feeds ``cost_model``."""
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        token = pending
        total = 0.0
        for step in range(budget):
            step_start = clock()
            out = engine.forward(
                torch.tensor([token], device=engine.device), position + step, cache, mask
            )
            logits = out.logits[0]
            check_finite(logits, "drafting")
            token, q = choose(logits, drafts)
            if q is not None:
                probs.append(q)
            # The draft's top-1 probability; skipped when early exit is off (τ_conf = 0).
            confidence = 1.0
            if confidence_threshold > 0:
                confidence = float(q.max() if q is not None else torch.softmax(logits, -1).max())
            drafts.append(token)
            elapsed = clock() - step_start
            total += elapsed
            if cost_model is not None:
                cost_model.observe(LatencyObservation("draft", position + step, elapsed, 1, mask))
            if confidence < confidence_threshold:
                break
        return Draft(
            tuple(drafts),
            SUBNETWORK,
            probs=torch.stack(probs) if probs else None,
            seconds=total,
        )


__all__ = ["SubnetworkConfig", "SubnetworkDrafter", "TokenChooser"]
