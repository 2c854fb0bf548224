"""DEL baseline: choose the exit layer and draft length by Tokens-per-Layer.

DEL ("Dynamic Exit Layer", Zarch et al., 2025) drafts with the first ``E`` layers of the
model followed by the LM head (a LayerSkip-style early exit) and picks ``E`` and the draft
length ``γ`` that maximise the expected committed tokens per executed layer,

    TPL(E, γ) = (1 - α_E^(γ+1)) / (1 - α_E) / (γ·E + L),

where ``α_E`` is the per-token acceptance rate of exit ``E``, estimated from "shadow"
tokens: the early-exit prediction at every candidate layer for tokens the full model has
already committed. TPL is KnapSpec's TPT with every layer costing the same time.

Estimating ``α_E`` needs no extra transformer work here: with teacher forcing, the first
``E`` layers of the full model compute exactly the early-exit draft's states, so exit
``E``'s final state on a window token is the window's point ``2E``. Only the final norm and
LM head run, once per (new window token, candidate exit). ``α_E`` is the plain agreement
rate over the last ``history_tokens`` shadow tokens, and no choice is made before
``min_shadow_tokens`` of them were seen.

TPL counts layers only: it ignores the LM head and the per-step overhead, which on a small
model are a large share of a step, and it treats a verify pass as costing ``L`` layers
whatever its width. That is DEL's published objective; KnapSpec's TPT is its time-weighted
form.

γ = 0 (a plain step, TPL = 1/L) wins whenever no exit beats it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Self

import attrs
import numpy as np
import torch

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.types import DraftPlan, SublayerMask
from knapspec.validators import at_least, optional, unit_interval

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow


@attrs.frozen
class DELPlannerConfig:
    """Hyper-parameters of :class:`DELPlanner`.

    Attributes:
        min_exit_layer: smallest candidate exit ``E`` (the draft runs layers ``0..E-1``).
        max_exit_layer: largest candidate exit; None = ``L - 1`` (``E = L`` is the full
            model, never faster than a plain step).
        max_draft_length: γ cap of DEL's own search; the search also respects the
            decoder's ``max_draft_length`` D.
        replan_interval: re-estimate α and re-choose ``(E, γ)`` every this many rounds.
            The window spans the last few rounds, so an interval no longer than the
            decoder's ``window_rounds`` sees every committed token.
        history_tokens: α is the agreement rate over the last this-many shadow tokens.
        max_new_tokens_per_update: at most this many new window tokens are scored per
            re-plan, which bounds the LM-head work (one head call per token and exit).
        min_shadow_tokens: plans stay γ = 0 until this many shadow tokens were scored, so
            that a few lucky tokens cannot claim α = 1.
        prior_alpha, prior_tokens: a prior belief about every exit's α, worth
            ``prior_tokens`` shadow tokens: α = (agreements + prior_alpha · prior_tokens) /
            (scored + prior_tokens) (Beta-prior smoothing). ``prior_tokens = 0`` (the default)
            is DEL's plain agreement rate. A strong optimistic prior makes DEL draft before
            the evidence says it pays (the lossless-drafting tests use it to force drafting).
    """

    min_exit_layer: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_exit_layer: int | None = attrs.field(default=None, validator=optional(at_least(1)))
    max_draft_length: int = attrs.field(default=10, validator=attrs.validators.ge(0))
    replan_interval: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    history_tokens: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_new_tokens_per_update: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    min_shadow_tokens: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    prior_alpha: float = attrs.field(default=0.5, validator=unit_interval)
    prior_tokens: int = attrs.field(default=0, validator=attrs.validators.ge(0))


@attrs.frozen
class ExitChoice:
    """The Tokens-per-Layer optimum.

    Attributes:
        exit_layer: ``E``, or None when γ = 0 (no draft).
        draft_length: γ.
        tokens_per_layer: TPL of the choice (``1 / L`` for γ = 0).
        alpha: α of the chosen exit (None for γ = 0).
    """

    exit_layer: int | None
    draft_length: int
    tokens_per_layer: float
    alpha: float | None


def tokens_per_layer(alpha: float, draft_length: int, exit_layer: int, num_layers: int) -> float:
    """``(1 - α^(γ+1)) / (1 - α) / (γ·E + L)``; with α = 1 the numerator is ``γ + 1``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    expected = (
        float(draft_length + 1)
        if alpha >= 1.0
        else (1.0 - alpha ** (draft_length + 1)) / (1.0 - alpha)
    )
    return expected / (draft_length * exit_layer + num_layers)


def best_exit_and_length(
    alphas: dict[int, float], num_layers: int, max_draft_length: int
) -> ExitChoice:
    """Maximise TPL over the candidate exits ``alphas`` (exit layer -> α) and γ in ``0..D``.

    Ties go to γ = 0, then to the shallower exit and the shorter draft, so the result is
    deterministic. All ``len(alphas) × (D + 1)`` values are computed in one numpy grid.
    """
    if max_draft_length < 0:
        raise ValueError(f"max_draft_length must be >= 0, got {max_draft_length}")
    choice = ExitChoice(None, 0, 1.0 / num_layers, None)
    if not alphas or max_draft_length == 0:
        return choice
    exits = np.array(sorted(alphas), dtype=np.float64)  # (X,)
    alpha = np.array([alphas[int(e)] for e in exits], dtype=np.float64)[:, None]  # (X, 1)
    if np.any((alpha < 0) | (alpha > 1)):
        raise ValueError(f"every alpha must be in [0, 1], got {alphas}")
    gamma = np.arange(1, max_draft_length + 1, dtype=np.float64)[None, :]  # (1, D)
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.where(
            alpha >= 1.0, gamma + 1.0, (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)
        )
    value = expected / (gamma * exits[:, None] + num_layers)  # (X, D)
    # argmax returns the first maximum in row-major order: shallowest exit, then shortest γ.
    flat = int(np.argmax(value))
    row, column = divmod(flat, value.shape[1])
    best = float(value[row, column])
    if best <= choice.tokens_per_layer:
        return choice
    return ExitChoice(int(exits[row]), column + 1, best, float(alpha[row, 0]))


@PLANNERS.register("del")
class DELPlanner(Planner):
    """Early-exit draft with ``(E, γ)`` maximising Tokens-per-Layer, re-chosen periodically.

    Before any window exists, and until ``min_shadow_tokens`` shadow tokens were scored,
    the plan is γ = 0.

    Learned state: ``alphas_`` (exit -> α at the last re-plan) and ``choice_``.

    Args:
        num_layers: decoder layers ``L``.
        config: the validated hyper-parameters.
    """

    config_class = DELPlannerConfig

    def __init__(self, num_layers: int, config: DELPlannerConfig | None = None) -> None:
        self.config = config if config is not None else DELPlannerConfig()
        top = num_layers - 1 if self.config.max_exit_layer is None else self.config.max_exit_layer
        if not 1 <= self.config.min_exit_layer <= top <= num_layers:
            raise ValueError(
                f"exit layers [{self.config.min_exit_layer}, {top}] are not a range inside the "
                f"model's {num_layers} layers"
            )
        self.num_layers = num_layers
        self.exit_layers = tuple(range(self.config.min_exit_layer, top + 1))
        self.reset()

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        return cls(engine.num_layers, config)

    def reset(self) -> None:
        """Forget the shadow-token history (it describes the previous generation's text)."""
        self._agreements: deque[torch.Tensor] = deque(maxlen=self.config.history_tokens)
        self._next_position = 0
        self._rounds_since_plan = 0
        self.alphas_: dict[int, float] = {}
        self.choice_: ExitChoice | None = None

    def plan(self, context: PlanningContext) -> DraftPlan:
        if context.engine.num_layers != self.num_layers:
            raise ValueError(
                f"planner built for {self.num_layers} layers, the model has "
                f"{context.engine.num_layers}"
            )
        due = self.choice_ is None or self._rounds_since_plan >= self.config.replan_interval
        if context.window is not None and due:
            self._observe(context.engine, context.window)
            if len(self._agreements) >= self.config.min_shadow_tokens:
                # Optimise γ within the decoder's cap too: a clipped optimum is not optimal.
                cap = min(self.config.max_draft_length, context.max_draft_length)
                self.choice_ = best_exit_and_length(self.alphas_, self.num_layers, cap)
                self._rounds_since_plan = 0
        self._rounds_since_plan += 1
        return self._to_plan(context.max_draft_length)

    def _to_plan(self, max_draft_length: int) -> DraftPlan:
        choice = self.choice_
        if choice is None or choice.exit_layer is None:
            return DraftPlan.autoregressive(self.num_layers, source=self.registered_name)
        return DraftPlan(
            SublayerMask.early_exit(self.num_layers, choice.exit_layer),
            min(choice.draft_length, max_draft_length),
            predicted_acceptance=choice.alpha,
            source=self.registered_name,
        )

    @torch.inference_mode()
    def _observe(self, engine: SublayerEngine, window: ReferenceWindow) -> None:
        """Score the window tokens not seen yet at every candidate exit; refresh ``alphas_``."""
        end = window.start + window.size
        if end < self._next_position:
            # The sequence went backwards (a new prompt): the history no longer applies.
            self._agreements.clear()
            self._next_position = 0
        first = max(self._next_position, window.start, end - self.config.max_new_tokens_per_update)
        if first < end:
            offset = first - window.start
            points = window.points[[2 * e for e in self.exit_layers], offset:]  # (X, t, d)
            predicted = engine.logits(points).argmax(dim=-1)  # (X, t)
            target = window.target_tokens[offset:].to(predicted.device)
            agree = (predicted == target.unsqueeze(0)).T.cpu()  # (t, X)
            self._agreements.extend(agree)
            self._next_position = end
        if self._agreements:
            counts = torch.stack(list(self._agreements)).sum(dim=0).tolist()
            prior = self.config.prior_alpha * self.config.prior_tokens
            seen = len(self._agreements) + self.config.prior_tokens
            self.alphas_ = {
                exit_layer: (count + prior) / seen
                for exit_layer, count in zip(self.exit_layers, counts, strict=True)
            }


__all__ = [
    "DELPlanner",
    "DELPlannerConfig",
    "ExitChoice",
    "best_exit_and_length",
    "tokens_per_layer",
]
