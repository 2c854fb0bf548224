"""The layer-skipping draft: the target with a sublayer mask, one token at a time."""

from __future__ import annotations

import attrs
import torch

from knapspec.costmodels.base import LatencyObservation
from knapspec.drafters.base import (
    DRAFTERS,
    SUBNETWORK,
    BatchDraftRequest,
    Draft,
    Drafter,
    DraftRequest,
    TokenChooser,
)
from knapspec.errors import NonFiniteLogitsError
from knapspec.model.passes.batched import forward_batch
from knapspec.validators import check_finite


@attrs.frozen
class SubnetworkConfig:
    """The sub-network drafter has no hyper-parameters of its own: the planner picks the
    mask and γ, the decoder's ``confidence_threshold`` the early exit."""


@DRAFTERS.register(SUBNETWORK)
class SubnetworkDrafter(Drafter):
    """Drafts with ``f^(S)``: the engine running only the plan's mask, writing the cache
    at the draft positions (verification overwrites them). Stateless, so a batch drafts
    all its rows with one instance, one batched masked pass per token."""

    config_class = SubnetworkConfig
    drafts_rows_together = True

    def __init__(self, config: SubnetworkConfig | None = None) -> None:
        self.config = config if config is not None else SubnetworkConfig()

    def propose(self, request: DraftRequest) -> Draft:
        """Up to ``request.budget`` tokens after ``request.pending``, stopping after the
        first token whose top-1 draft probability is below the target's
        ``confidence_threshold`` (that token is still drafted and verified). Every step's
        time feeds the target's cost model.

        Raises:
            ValueError: the request carries no target or no mask (this drafter runs the
                model under the plan's mask).
        """
        target, mask = request.target, request.mask
        if target is None or mask is None:
            raise ValueError("the sub-network drafter needs the request's target and mask")
        engine, clock, threshold = target.engine, target.clock, target.confidence_threshold
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        token = request.pending
        total = 0.0
        for step in range(request.budget):
            step_start = clock()
            position = request.position + step
            out = engine.forward(
                torch.tensor([token], device=engine.device), position, target.cache, mask
            )
            logits = out.logits[0]
            check_finite(logits, "drafting", error=NonFiniteLogitsError.during)
            token, q = target.choose(logits, drafts)
            if q is not None:
                probs.append(q)
            # The draft's top-1 probability; skipped when early exit is off (τ_conf = 0).
            confidence = 1.0
            if threshold > 0:
                confidence = float(q.max() if q is not None else torch.softmax(logits, -1).max())
            drafts.append(token)
            elapsed = clock() - step_start
            total += elapsed
            if target.cost_model is not None:
                target.cost_model.observe(LatencyObservation("draft", position, elapsed, 1, mask))
            if confidence < threshold:
                break
        return Draft(
            tuple(drafts),
            SUBNETWORK,
            probs=torch.stack(probs) if probs else None,
            seconds=total,
        )

    def propose_batch(self, request: BatchDraftRequest) -> list[Draft]:
        """``request.steps`` batched masked steps on every active row from its pending
        token: per row its tokens and, when sampled, their distributions ``(steps, vocab)``.

        Each step writes the executed layers' K/V one position further; the rows' lengths
        move with the steps and return to ``request.contexts`` afterwards (verification
        overwrites every drafted position). Each draft's ``seconds`` is the whole pass's.
        """
        engine, cache, clock = request.engine, request.cache, request.clock
        contexts = list(request.contexts)
        started = clock()
        current = list(request.pending)
        tokens: list[list[int]] = [[] for _ in current]
        probs: list[list[torch.Tensor]] = [[] for _ in current]
        try:
            for step in range(request.steps):
                step_start = clock()
                starts = [context + step for context in contexts]
                cache.set_lengths(starts)
                inputs = torch.tensor(current, dtype=torch.long).unsqueeze(1)
                logits = forward_batch(
                    engine, inputs, starts, cache, all_logits=False, mask=request.mask
                )
                check_finite(logits, "batched drafting", error=NonFiniteLogitsError.during)
                for slot in range(len(current)):
                    # The step's input sits at starts[slot]: it picks the next position.
                    current[slot], q = request.choose(slot, logits[slot], starts[slot] + 1)
                    if q is not None:
                        probs[slot].append(q)
                    tokens[slot].append(current[slot])
                if request.on_step is not None:
                    request.on_step(clock() - step_start)
        finally:
            cache.set_lengths(contexts)
        seconds = clock() - started
        return [
            Draft(tuple(row), SUBNETWORK, probs=torch.stack(q) if q else None, seconds=seconds)
            for row, q in zip(tokens, probs, strict=True)
        ]


__all__ = ["SubnetworkConfig", "SubnetworkDrafter", "TokenChooser"]
