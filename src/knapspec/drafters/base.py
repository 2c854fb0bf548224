"""Drafters: the proposers a speculation round can draft with, and the one call they answer.

A round drafts with one drafter, then the full model verifies, so any drafter is lossless.
Three ship:

* ``subnetwork``: the target itself with some sublayers skipped (KnapSpec's masked draft);
  its tokens come with the draft distributions ``q`` it sampled them from;
* ``lookup``: a continuation of an earlier occurrence of the context's suffix (prompt
  lookup); free to run, deterministic, so its ``q`` is one-hot;
* ``none``: no draft, a plain autoregressive step (γ = 0).

Every drafter answers one call, :meth:`Drafter.propose` with a :class:`DraftRequest`, in a
single sequence and in a batch alike (the shape of transformers' candidate generators
and vLLM's proposers: the state it keeps is its own, the request says where to draft).
What differs is declared, never looked up by name or class:

* :attr:`Drafter.proposes_before_planning`: cheap enough to run every round before
  planning, so the planner prices the actual proposal (lookup); otherwise it runs once a
  plan named it (the sub-network);
* :attr:`Drafter.drafts_rows_together`: in a batch, one instance drafts every row at once
  (:meth:`Drafter.propose_batch`, the sub-network's batched masked steps); otherwise each
  row gets its own copy (:meth:`Drafter.for_row`) and :meth:`Drafter.propose` per row.

The planner prices them with the cost model and picks (drafter, γ) by one tokens-per-time
search; the decoder runs the chosen one and verifies.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Self

import attrs
import torch

from knapspec.components import Component
from knapspec.registry import Registry
from knapspec.types import LOOKUP, NO_DRAFT, SUBNETWORK, Draft, SublayerMask, Verification

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.model.batch_cache import BatchKVCache
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine

#: ``(logits (vocab,), drafts so far) -> (token, q)``: argmax with ``q = None``, or a sample
#: and its processed distribution ``q (vocab,)`` (the caller applies its logits processor).
TokenChooser = Callable[[torch.Tensor, list[int]], tuple[int, "torch.Tensor | None"]]

#: ``(slot, logits (vocab,), position) -> (token, q)``: as :data:`TokenChooser`, for the
#: batch row in ``slot``, picking the token at absolute ``position`` (each row samples with
#: its own seed, keyed by position).
RowChooser = Callable[[int, torch.Tensor, int], tuple[int, "torch.Tensor | None"]]


@attrs.frozen
class DraftTarget:
    """The target model, for drafters that run it (the sub-network); a drafter that reads
    token ids only (lookup) never looks.

    Attributes:
        engine: the sublayer engine.
        cache: the sequence's verified KV cache; a drafter may write past the committed
            tokens (verification overwrites those positions) and must not touch the rest.
        choose: picks each draft token (argmax or a sample) from the draft's logits.
        clock: the decoder's clock (synchronises the device first on CUDA).
        cost_model: fed one ``LatencyObservation("draft", ...)`` per draft step (None:
            nothing to feed).
        confidence_threshold: τ_conf; a drafter stops after the first token whose top-1
            draft probability is below it (0 disables early exit).
    """

    engine: SublayerEngine
    cache: KVCache
    choose: TokenChooser
    clock: Callable[[], float]
    cost_model: CostModel | None = None
    confidence_threshold: float = 0.0


@attrs.frozen
class DraftRequest:
    """Where and how much one sequence drafts this round.

    Attributes:
        budget: the most tokens to propose (>= 0; the planner's γ once planned, the room
            left before planning).
        pending: the last committed token, whose K/V is not cached yet (-1 when unknown).
        position: the position of ``pending`` (the committed tokens before it).
        mask: the plan's sublayer mask (None before planning).
        target: the model, for drafters that run it (None where the caller offers none).
        chain_only: the caller verifies chains only (the batched rounds): a drafter
            that could also offer a token tree (:attr:`Draft.tree`) need not build one.
    """

    budget: int
    pending: int = -1
    position: int = 0
    mask: SublayerMask | None = None
    target: DraftTarget | None = None
    chain_only: bool = False


@attrs.frozen
class BatchDraftRequest:
    """Where every active row of a batch drafts this round, for a drafter that drafts the
    rows together (:attr:`Drafter.drafts_rows_together`).

    Attributes:
        engine: the sublayer engine.
        cache: the batch's cache, its rows in slot order; the drafter may write past each
            row's committed tokens and must leave every row's length at ``contexts``.
        pending: per active row (slot order), its last committed token.
        contexts: per active row, its committed tokens (the position of ``pending``).
        steps: draft tokens per row (every row drafts them; the batch keeps each row's γ).
        mask: the sublayer mask the batch drafts with.
        choose: picks row ``slot``'s token from its draft logits.
        clock: the decoder's clock.
        on_step: called after every batched step with its seconds (the policy learns what
            a batched draft step costs); None: nobody listens.
    """

    engine: SublayerEngine
    cache: BatchKVCache
    pending: Sequence[int]
    contexts: Sequence[int]
    steps: int
    mask: SublayerMask
    choose: RowChooser
    clock: Callable[[], float]
    on_step: Callable[[float], None] | None = None


class Drafter(Component, abc.ABC):
    """A proposer of draft tokens. Subclasses register in :data:`DRAFTERS`.

    ``reset(tokens)`` starts a generation with the prompt, ``extend(tokens)`` sees every
    committed token once (an incremental index must cost O(1) amortised per token), and
    :meth:`propose` drafts. Both hooks default to no-ops.
    """

    #: Whether proposing is cheap enough to run every round before planning (the planner
    #: then prices the actual proposal); False for drafters run only once chosen.
    proposes_before_planning: ClassVar[bool] = False
    #: Whether, in a batch, one instance drafts every row in one call
    #: (:meth:`propose_batch`); False: each row drafts with its own :meth:`for_row` copy.
    drafts_rows_together: ClassVar[bool] = False

    def reset(self, tokens: list[int]) -> None:
        """Forget the last generation; ``tokens`` is the new prompt."""

    def extend(self, tokens: list[int]) -> None:
        """Tokens committed after everything seen so far."""

    @abc.abstractmethod
    def propose(self, request: DraftRequest) -> Draft:
        """Up to ``request.budget`` draft tokens after the committed ones (may be none)."""

    def propose_batch(self, request: BatchDraftRequest) -> list[Draft]:
        """Per active row (slot order), its ``request.steps`` draft tokens, in one pass per
        step over the batch. Only for :attr:`drafts_rows_together` drafters.

        Raises:
            NotImplementedError: the drafter drafts row by row (the default).
        """
        raise NotImplementedError(
            f"{type(self).__name__} drafts row by row (drafts_rows_together is False)"
        )

    def for_row(self, engine: SublayerEngine) -> Self:
        """A fresh drafter with this one's settings, for one row of a batch (each row keeps
        its own state: its index, its last token)."""
        return type(self).from_config(self.config, engine)

    def clear_history(self) -> None:
        """Forget what earlier calls left to draft from (nothing, by default)."""

    def share_rows(self, rows: Sequence[Self]) -> None:
        """Called on each row's copy with every row's copy of one batch (this one among
        them): a drafter that can read the other rows' tokens keeps them (the lookup
        drafter with history on). The default ignores them."""


DRAFTERS: Registry[Drafter] = Registry("drafter")

__all__ = [
    "DRAFTERS",
    "LOOKUP",
    "NO_DRAFT",
    "SUBNETWORK",
    "BatchDraftRequest",
    "Draft",
    "DraftRequest",
    "DraftTarget",
    "Drafter",
    "RowChooser",
    "TokenChooser",
    "Verification",
]
