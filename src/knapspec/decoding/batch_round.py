"""One batched speculative round: per-row drafts, one verification, ragged acceptance.

A round over the active rows of a batch (:class:`~knapspec.decoding.continuous.ContinuousBatch`
holds the rows and runs one per :meth:`~knapspec.decoding.continuous.ContinuousBatch.step`)::

    proposals = each row's proposal (e.g. its lookup)      # per-row drafter copies
    plan      = policy.plan_round(...)                     # batch-level TPT: γ_r, drafter_r
    drafts    = lookup rows: their proposal's first γ_r tokens;
                sub-network rows: G = max γ_r batched steps of the shared mask
    logits    = full model on [pending_r, drafts_r] per row (products packed over the
                Σ (1 + γ_r) real tokens, attention padded to 1 + max γ_r)
    each row keeps its accepted prefix + one target token; its cache length moves to
    exactly its committed tokens (a row that accepts 0 and one that accepts all coexist)

Drafters take part as they declare (:mod:`knapspec.drafters.base`), never by name: a row's
own drafters (its copies of those the planner reads proposals of) propose before every
round, and the row offers the policy its longest proposal. When the batch has a shared
sub-network (:class:`~knapspec.planners.batch.policy.BatchSubnetwork`, planned on its
first row), the policy prices it every round against the rows' proposals and γ = 0; its
batched steps (``Drafter.propose_batch``) run on every active row (one product over all
rows; a row that drafts its proposal ignores them) and write K/V only past the rows'
committed lengths, where the verification overwrites them.

Verification logits that are not finite either fail the whole call
(:class:`~knapspec.errors.NonFiniteLogitsError`) or stop only the rows they belong to
(``"error"``; a row's logits depend on its own tokens and K/V only), as the batch's owner
chose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from knapspec.decoding.row import FAILED, Row
from knapspec.drafters.base import NO_DRAFT, BatchDraftRequest, Draft, Drafter, DraftRequest
from knapspec.errors import NonFiniteLogitsError
from knapspec.model.passes.batched import forward_batch
from knapspec.validators import all_finite, check_finite

if TYPE_CHECKING:
    from knapspec.model.batch_cache import BatchKVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.batch.policy import BatchDraftPolicy, BatchSubnetwork, RoundPlan


class BatchRound:
    """What every round of one batch uses, and the round itself (:meth:`run`).

    Args:
        engine: the decoder's engine.
        policy: chooses each row's γ and drafter per round, and learns from the rounds.
        max_draft_length: the most tokens a row drafts in one round.
        shared_drafters: by registered name, the decoder's drafters (the one a sub-network
            plan names drafts the rows together).
        clock: seconds now (the device synchronised).
        rows_fail_alone: non-finite verification logits stop their rows alone
            (``"error"``); False: they raise :class:`NonFiniteLogitsError`.
    """

    def __init__(
        self,
        engine: SublayerEngine,
        policy: BatchDraftPolicy,
        *,
        max_draft_length: int,
        shared_drafters: Mapping[str, Drafter],
        clock: Callable[[], float],
        rows_fail_alone: bool,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.max_draft_length = max_draft_length
        self.shared_drafters = shared_drafters
        self.clock = clock
        self.rows_fail_alone = rows_fail_alone

    def run(
        self,
        lanes: Sequence[int],
        rows: Sequence[Row],
        cache: BatchKVCache,
        subnetwork: BatchSubnetwork | None,
    ) -> None:
        """Draft per row, verify the batch once, commit each row's accepted tokens.

        Args:
            lanes: the active rows' lanes, in cache order (the policy's row keys).
            rows: the active rows, in the same order.
            cache: the batch cache, one row per active row, in that order.
            subnetwork: the batch's shared sub-network (None: lookup drafts only).
        """
        engine, policy = self.engine, self.policy
        started = self.clock()
        proposals: list[Draft] = []
        rooms: list[int] = []
        for row in rows:
            rooms.append(row.draft_room(self.max_draft_length, engine.max_context))
            # A batched round verifies chains: no drafter should build a tree for it.
            request = DraftRequest(rooms[-1], row.pending, row.length, chain_only=True)
            proposals.append(_longest(d.propose(request) for d in row.drafters))
        contexts = [row.length for row in rows]
        plan = policy.plan_round(lanes, proposals, contexts, rooms)
        lookup_time = self.clock() - started
        drafts = self._drafts(rows, cache, contexts, proposals, plan, subnetwork)
        width = 1 + max(len(d) for d in drafts)
        inputs = torch.zeros(len(rows), width, dtype=torch.long)
        for slot, row in enumerate(rows):
            row_inputs = [row.pending, *drafts[slot].tokens]
            inputs[slot, : len(row_inputs)] = torch.tensor(row_inputs)
        widths = [1 + len(d) for d in drafts]
        verify_start = self.clock()
        # (Σ widths, vocab): row after row, only the real tokens' logits.
        logits = forward_batch(engine, inputs, contexts, cache, widths=widths, packed_logits=True)
        failed = self._failed_rows(rows, logits, widths)
        new_lengths = []
        offset = 0
        for slot, (lane, row) in enumerate(zip(lanes, rows, strict=True)):
            draft = drafts[slot]
            tokens = list(draft.tokens)
            scores = logits[offset : offset + len(tokens) + 1]
            offset += widths[slot]
            if slot in failed:  # nothing committed; the row has stopped and leaves
                new_lengths.append(row.length)
                continue
            # The pending token sits at position row.length; logits row 0 picks the next one.
            verdict = row.sampler.verify(draft, scores, row.length + 1)
            # Inputs at positions n .. n + accepted are now this row's: keep their K/V only.
            row.length += verdict.accepted + 1
            new_lengths.append(row.length)
            kept = row.commit(verdict.tokens)
            for drafter in row.drafters:
                drafter.extend(kept)
            policy.observe(lane, proposals[slot], kept)
            if subnetwork is not None and draft.drafter == subnetwork.drafter and tokens:
                policy.observe_subnetwork(lane, len(tokens), verdict.accepted)
            row.pending = verdict.tokens[-1]
            row.stats.lookup_time_s += lookup_time
            row.stats.record_round(
                len(tokens), verdict.accepted, len(kept), draft.drafter if tokens else NO_DRAFT
            )
        cache.set_lengths(new_lengths)
        # Not fed to the cost model: a batched pass is not a single sequence's verification
        # of that width (every row reads its own cache), and would skew its estimates; the
        # policy learns the batched passes' own correction instead.
        elapsed = self.clock() - verify_start
        mean_context = round(sum(contexts) / len(contexts))
        policy.observe_pass(len(rows), width, mean_context, elapsed, widths=widths)
        for row in rows:
            row.stats.verify_time_s += elapsed

    def _drafts(
        self,
        rows: Sequence[Row],
        cache: BatchKVCache,
        contexts: list[int],
        proposals: list[Draft],
        plan: RoundPlan,
        subnetwork: BatchSubnetwork | None,
    ) -> list[Draft]:
        """Each active row's draft under ``plan``: its proposal cut to γ_r, or its first
        γ_r tokens of the shared drafter's batched steps."""
        drafts = [
            _NO_DRAFT if sub else proposal.truncated(gamma)
            for proposal, gamma, sub in zip(
                proposals, plan.draft_lengths, plan.subnetwork_rows, strict=True
            )
        ]
        # Every active row takes the steps: none may step past the model's context.
        headroom = min(self.engine.max_context - context - 1 for context in contexts)
        steps = min(plan.draft_steps, headroom)
        if steps <= 0 or subnetwork is None:
            return drafts
        mean_context = round(sum(contexts) / len(contexts))
        request = BatchDraftRequest(
            self.engine,
            cache,
            [row.pending for row in rows],
            contexts,
            steps,
            subnetwork.mask,
            lambda slot, logits, position: rows[slot].sampler.choose(logits, position),
            self.clock,
            on_step=lambda seconds: self.policy.observe_draft_pass(
                len(rows), mean_context, seconds
            ),
        )
        shared = self.shared_drafters[subnetwork.drafter].propose_batch(request)
        for slot, (gamma, sub) in enumerate(
            zip(plan.draft_lengths, plan.subnetwork_rows, strict=True)
        ):
            if sub and min(gamma, steps):
                drafts[slot] = shared[slot].truncated(min(gamma, steps))
        for row in rows:
            row.stats.draft_time_s += shared[0].seconds
        return drafts

    def _failed_rows(
        self, rows: Sequence[Row], logits: torch.Tensor, widths: list[int]
    ) -> set[int]:
        """Slots whose verification ``logits`` (packed, ``widths`` per row) are not finite:
        they commit nothing and stop with ``"error"`` (when rows fail alone; else any such
        logits raise :class:`NonFiniteLogitsError`)."""
        if not self.rows_fail_alone:
            check_finite(logits, "batched verification", error=NonFiniteLogitsError.during)
            return set()
        # Usually all finite: one reduction first (the element-wise mask below costs a few
        # per cent of a large round).
        if all_finite(logits):
            return set()
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        failed: set[int] = set()
        offset = 0
        for slot, width in enumerate(widths):
            if not all(finite[offset : offset + width]):
                failed.add(slot)
                rows[slot].stats.stop_reason = FAILED
            offset += width
        return failed


#: The empty draft of a row that drafts nothing this round.
_NO_DRAFT = Draft((), NO_DRAFT)


def _longest(proposals: Iterable[Draft]) -> Draft:
    """The longest of a row's proposals (the first on a tie; empty when none)."""
    best = _NO_DRAFT
    for proposal in proposals:
        if len(proposal) > len(best):
            best = proposal
    return best


__all__ = ["BatchRound"]
