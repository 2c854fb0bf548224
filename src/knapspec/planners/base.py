"""The planner interface: propose a draft (``plan``), learn from the result (``update``)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from knapspec.components import Component
from knapspec.registry import Registry
from knapspec.sampling import SamplingParams
from knapspec.types import SUBNETWORK, DraftPlan, StepOutcome
from knapspec.window import ReferenceWindow, WindowBuffer

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.drafters.base import Draft
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.proxies.base import ValueProxy


@attrs.frozen
class PlanningContext:
    """Everything a planner may read. Planners never write the cache.

    Attributes:
        engine: the sublayer engine (run items functionally with ``run_item``/``run_masks``).
        cache: the verified KV cache; read-only for planners.
        context_length: committed tokens in the cache.
        window: the reference window, or None before the first commit. The decoder passes
            its :class:`~knapspec.window.WindowBuffer`, and the window is assembled only
            when a planner reads it (most rounds do not: a search is rare), then reused.
        cost_model, proxy: the decoder's components.
        max_draft_length: D, the largest γ a plan may use.
        sampling: the decoder's sampling parameters (the proxy's α depends on them).
        round_index: speculation rounds done in this generation call.
        remaining_tokens: tokens still to generate in this call (None = unknown); lets a
            planner judge whether an expensive search can pay for itself.
        tokens: ``(m,)`` the prompt and every token committed so far, oldest first (None =
            not given); e.g. for the knapsack planner's copy-evidence gate.
        proposals: drafts already proposed for this round by the drafters the planner
            named in :meth:`Planner.proposal_drafters` (e.g. the lookup continuation);
            the planner prices them and may choose one, cut to a γ.
        trees: whether this round may verify a proposal's token tree (a single sequence
            on an engine that verifies trees, no logits processor); False: chains only.
    """

    engine: SublayerEngine
    cache: KVCache
    context_length: int
    window_source: ReferenceWindow | WindowBuffer | None = attrs.field(alias="window")
    cost_model: CostModel | None
    proxy: ValueProxy | None
    max_draft_length: int
    sampling: SamplingParams
    round_index: int = 0
    remaining_tokens: int | None = None
    tokens: torch.Tensor | None = None
    proposals: tuple[Draft, ...] = ()
    trees: bool = False

    def proposal(self, drafter: str) -> Draft | None:
        """This round's proposal by ``drafter`` (None when it proposed nothing)."""
        for draft in self.proposals:
            if draft.drafter == drafter:
                return draft
        return None

    @property
    def window(self) -> ReferenceWindow | None:
        """The reference window (built from the decoder's buffer on first read)."""
        source = self.window_source
        if isinstance(source, WindowBuffer):
            return source.window()
        return source

    @property
    def has_window(self) -> bool:
        """Whether a window exists, without assembling it. From the decoder's buffer, only
        a window that ends at the current context counts: one left from before rounds the
        planner did not capture (:meth:`Planner.wants_window`) is still valid but stale."""
        source = self.window_source
        if isinstance(source, WindowBuffer):
            return source.end == self.context_length
        return source is not None


class Planner(Component, abc.ABC):
    """Chooses the draft mask and draft length γ for each speculation round.

    ``plan`` is called before every round and should return its current plan cheaply when
    it decides not to re-plan; the decoder times every call and reports it as plan time.
    """

    #: Whether the planner reads the reference window (and so needs a cost model and a
    #: proxy); the decoder skips capturing hidden states for planners that do not.
    uses_window: ClassVar[bool] = True

    @abc.abstractmethod
    def plan(self, context: PlanningContext) -> DraftPlan:
        """The draft plan for the next round (γ = 0 means a plain autoregressive step)."""

    def wants_window(self, tokens: torch.Tensor) -> bool:
        """Whether the next full-model pass should record the reference window.

        The decoder asks before the prefill and before every verify pass, with ``tokens
        (m,)``: the prompt and every committed token. Recording costs about 1 % of a decode
        step on a small model, so a planner that searches rarely may decline while no
        search is near. After a gap the buffer starts over (it keeps contiguous rounds
        only). Default: :attr:`uses_window`.
        """
        return self.uses_window

    def proposal_drafters(self) -> frozenset[str]:
        """Drafters whose proposals this planner reads before every plan (the decoder runs
        them and passes the drafts in :attr:`PlanningContext.proposals`). Default: none."""
        return frozenset()

    def plan_drafters(self) -> frozenset[str]:
        """Every drafter this planner's plans may name (:attr:`DraftPlan.drafter`); the
        decoder builds each once and runs the one a plan names. Default: the proposal
        drafters and ``"subnetwork"``, the drafter of a plan's sublayer mask."""
        return self.proposal_drafters() | {SUBNETWORK}

    def update(self, outcome: StepOutcome) -> None:
        """Feedback after a round (accepted count, timings). Default: ignore."""

    def reset(self) -> None:
        """Forget per-generation state; called at the start of every ``generate``."""


PLANNERS: Registry[Planner] = Registry("planner")

__all__ = ["PLANNERS", "Planner", "PlanningContext"]
