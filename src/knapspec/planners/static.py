"""Fixed drafts: a static mask and γ, LayerSkip-style early exit, and plain autoregression."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

import attrs

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.types import DraftPlan, SublayerMask
from knapspec.validators import at_least

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class StaticPlannerConfig:
    """Hyper-parameters of :class:`StaticPlanner`.

    Attributes:
        skipped_items: items (``2i`` = attention of layer ``i``, ``2i+1`` = its MLP) the
            draft skips.
        draft_length: γ used every round (0 = plain autoregressive decoding).
    """

    skipped_items: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    draft_length: int = attrs.field(default=4, validator=at_least(0))


@PLANNERS.register("static")
class StaticPlanner(Planner):
    """Always proposes the same mask and γ (from config, a saved plan, or another planner).

    Args:
        mask: the draft mask.
        draft_length: γ; 0 turns speculation off.
    """

    config_class = StaticPlannerConfig
    uses_window = False

    def __init__(self, mask: SublayerMask, draft_length: int) -> None:
        self.config = StaticPlannerConfig(mask.skipped, draft_length)
        self.mask = mask
        self.draft_length = draft_length

    @classmethod
    def from_plan(cls, plan: DraftPlan) -> StaticPlanner:
        """Freeze a plan found by any planner."""
        return cls(plan.mask, plan.draft_length)

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        mask = SublayerMask.from_skipped(engine.num_layers, config.skipped_items)
        return cls(mask, config.draft_length)

    def plan(self, context: PlanningContext) -> DraftPlan:
        if self.mask.num_items != context.engine.num_items:
            raise ValueError(
                f"static mask has {self.mask.num_items} items, the model {context.engine.num_items}"
            )
        length = min(self.draft_length, context.max_draft_length)
        return DraftPlan(self.mask, length, source=self.registered_name or "static")


@attrs.frozen
class EarlyExitPlannerConfig:
    """Hyper-parameters of :class:`EarlyExitPlanner`.

    Attributes:
        exit_layer: the draft runs layers ``0 .. exit_layer - 1`` (LayerSkip-style).
        draft_length: γ used every round.
    """

    exit_layer: int = attrs.field(default=8, validator=at_least(1))
    draft_length: int = attrs.field(default=4, validator=at_least(0))


@PLANNERS.register("early-exit")
class EarlyExitPlanner(StaticPlanner):
    """LayerSkip-style draft: the first ``exit_layer`` layers, then the LM head."""

    config_class = EarlyExitPlannerConfig  # type: ignore[assignment]

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        if config.exit_layer > engine.num_layers:
            raise ValueError(
                f"exit_layer={config.exit_layer} exceeds the model's {engine.num_layers} layers"
            )
        return cls(
            SublayerMask.early_exit(engine.num_layers, config.exit_layer), config.draft_length
        )


@attrs.frozen
class AutoregressivePlannerConfig:
    """:class:`AutoregressivePlanner` has no hyper-parameters."""


@PLANNERS.register("autoregressive")
class AutoregressivePlanner(Planner):
    """Never speculates: every round is a plain full-model step (γ = 0)."""

    config_class = AutoregressivePlannerConfig
    uses_window = False

    def __init__(self, config: AutoregressivePlannerConfig | None = None) -> None:
        self.config = self.checked_config(config)

    def plan(self, context: PlanningContext) -> DraftPlan:
        return DraftPlan.autoregressive(context.engine.num_layers, source="autoregressive")


__all__ = [
    "AutoregressivePlanner",
    "AutoregressivePlannerConfig",
    "EarlyExitPlanner",
    "EarlyExitPlannerConfig",
    "StaticPlanner",
    "StaticPlannerConfig",
]
