"""CLaSp baseline: a cosine DP over whole layers, exactly M skipped, re-planned every round.

CLaSp (Chen et al., "CLaSp: In-Context Layer Skip for Self-Speculative Decoding",
ACL 2025) builds its draft by skipping whole decoder layers. After every verification it
runs a dynamic program whose table ``g[l, j]`` holds the best residual stream after the
first ``l`` layers with ``j`` of them skipped, choosing at each layer between running it on
``g[l-1, j]`` and skipping it from ``g[l-1, j-1]`` by cosine similarity to the full model's
stream after layer ``l``, as seen on the tokens of the *last verification*. Every layer
costs the same, and the draft skips exactly ``M`` layers.

Here the DP is the library's batched :func:`~knapspec.planners.dp.hidden_state_dp` with
one DP item per layer (:func:`~knapspec.planners.dp.layer_groups`), unit weights, no
τ-pruning (CLaSp has none) and a budget of ``M``; the plan is the backtracked mask of
budget ``M``. Unlike KnapSpec, CLaSp neither decouples attention from MLP, nor weighs
items by latency, nor chooses γ: the draft length is fixed by the config (the decoder's
confidence early exit still ends drafts sooner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Self

import attrs

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.dp import hidden_state_dp, layer_groups, trim_window
from knapspec.types import DraftPlan, StepOutcome
from knapspec.validators import at_least, open_unit_interval, optional

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine


@attrs.frozen
class CLaSpPlannerConfig:
    """Hyper-parameters of :class:`CLaSpPlanner`.

    Attributes:
        skip_layers: ``M``, the number of whole layers every draft skips. None means
            ``round(skip_fraction * L)``. The CLaSp paper tunes ``M`` per model; set it
            explicitly to reproduce a published configuration.
        skip_fraction: the fraction of layers skipped when ``skip_layers`` is None. The
            default 0.4 is this library's choice, not a number from the paper.
        draft_length: fixed γ cap of every round (the confidence early exit may stop sooner).
        last_verify_only: score against the tokens committed by the last verification only,
            as CLaSp does; False uses the whole reference window.
        max_window_tokens: at most this many reference tokens (the DP's cost grows with it;
            also bounds the prefill seed before the first verification).
    """

    skip_layers: int | None = attrs.field(default=None, validator=optional(at_least(1)))
    skip_fraction: float = attrs.field(default=0.4, validator=open_unit_interval)
    draft_length: int = attrs.field(default=10, validator=attrs.validators.ge(0))
    last_verify_only: bool = True
    max_window_tokens: int = attrs.field(default=32, validator=attrs.validators.ge(1))


@PLANNERS.register("clasp")
class CLaSpPlanner(Planner):
    """Whole-layer cosine DP with exactly ``M`` layers skipped, re-run before every round.

    Before the first reference window exists the plan is γ = 0 (one plain step). The cost
    of a plan is one batched layer call per layer over at most ``M + 1`` branches of the
    reference tokens.

    Args:
        num_layers: decoder layers ``L``.
        skip_layers: ``M`` in ``[1, L - 1]``.
        draft_length: fixed γ cap.
        last_verify_only: reference = the last verification's committed tokens.
        max_window_tokens: cap on the reference tokens.
    """

    config_class = CLaSpPlannerConfig

    def __init__(
        self,
        num_layers: int,
        skip_layers: int,
        draft_length: int,
        *,
        last_verify_only: bool = True,
        max_window_tokens: int = 32,
    ) -> None:
        if not 1 <= skip_layers < num_layers:
            raise ValueError(
                f"CLaSp must skip between 1 and {num_layers - 1} of the model's {num_layers} "
                f"layers, got skip_layers={skip_layers}"
            )
        self.config = CLaSpPlannerConfig(
            skip_layers=skip_layers,
            draft_length=draft_length,
            last_verify_only=last_verify_only,
            max_window_tokens=max_window_tokens,
        )
        self.num_layers = num_layers
        self.skip_layers = skip_layers
        self.draft_length = draft_length
        self.last_verify_only = last_verify_only
        self.max_window_tokens = max_window_tokens
        self.last_committed_: int | None = None

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        layers = engine.num_layers
        skip = config.skip_layers
        if skip is None:
            skip = min(max(1, round(config.skip_fraction * layers)), layers - 1)
        return cls(
            layers,
            skip,
            config.draft_length,
            last_verify_only=config.last_verify_only,
            max_window_tokens=config.max_window_tokens,
        )

    def plan(self, context: PlanningContext) -> DraftPlan:
        engine = context.engine
        if engine.num_layers != self.num_layers:
            raise ValueError(
                f"planner built for {self.num_layers} layers, the model has {engine.num_layers}"
            )
        if context.window is None:
            return DraftPlan.autoregressive(self.num_layers, source=self.registered_name)
        reference_tokens = self.max_window_tokens
        if self.last_verify_only and self.last_committed_ is not None:
            reference_tokens = min(reference_tokens, self.last_committed_)
        window = trim_window(context.window, reference_tokens)
        result = hidden_state_dp(
            engine,
            window,
            context.cache,
            (1,) * self.num_layers,
            max_budget=self.skip_layers,
            groups=layer_groups(self.num_layers),
            min_score=None,
        )
        # Without pruning every budget 0..M is reachable: exactly M skipped layers exist.
        chosen = result.table.index_of(self.skip_layers)
        return DraftPlan(
            result.masks[chosen],
            min(self.draft_length, context.max_draft_length),
            source=self.registered_name,
        )

    def update(self, outcome: StepOutcome) -> None:
        """Remember how many tokens the last verification committed (the next reference)."""
        self.last_committed_ = outcome.committed

    def reset(self) -> None:
        self.last_committed_ = None


__all__ = ["CLaSpPlanner", "CLaSpPlannerConfig"]
