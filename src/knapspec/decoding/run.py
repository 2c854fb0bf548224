"""One single-sequence ``generate`` call: prefill, then plan, draft, verify, commit.

All per-call state lives in :class:`Run`, so an exception mid-generation leaves the
decoder usable. :class:`~knapspec.decoding.decoder.SpeculativeDecoder` checks the
arguments into one :class:`~knapspec.request.Request` and builds a run per call from that
request and the pieces it holds (engine, cache, window, planner, drafters, cost model);
batches run in :mod:`knapspec.decoding.batch`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from knapspec.costmodels.base import LatencyObservation
from knapspec.decoding.greedy import greedy_ids
from knapspec.decoding.row import Row
from knapspec.decoding.sampler import TokenSampler
from knapspec.decoding.stats import GenerationStats, PlanRecord
from knapspec.decoding.tree_round import TreeRoundParts, verify_tree_round
from knapspec.drafters.base import (
    NO_DRAFT,
    Draft,
    Drafter,
    DraftRequest,
    DraftTarget,
    Verification,
)
from knapspec.errors import NonFiniteLogitsError
from knapspec.planners.base import Planner, PlanningContext
from knapspec.request import LogitsProcessor, Request, draft_room
from knapspec.types import DraftPlan, StepOutcome, SublayerMask
from knapspec.validators import check_finite

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.proxies.base import ValueProxy
    from knapspec.window import WindowBuffer


@attrs.frozen
class GenerationResult:
    """Output of :meth:`SpeculativeDecoder.generate`.

    Attributes:
        tokens: ``(new,)`` generated token ids.
        sequences: ``(1, prompt + new)`` prompt and generated ids, as ``model.generate``.
        stats: counters and timers of the call.
    """

    tokens: torch.Tensor
    sequences: torch.Tensor
    stats: GenerationStats


#: Prompt tokens whose hidden states seed the reference window after prefill, so the first
#: plan can be made right away instead of after several full-model rounds.
PREFILL_WINDOW_TOKENS = 8


class DecoderParts(Protocol):
    """The components of a decoder that a :class:`Run` plays with (what
    :class:`~knapspec.decoding.decoder.SpeculativeDecoder` holds)."""

    engine: SublayerEngine
    planner: Planner
    drafters: dict[str, Drafter]
    cost_model: CostModel | None
    proxy: ValueProxy | None
    max_draft_length: int
    confidence_threshold: float


class Run:
    """State of one ``generate`` call: a decoder's parts playing one :class:`Request`.
    Everything is reset per call, so an exception mid-generation leaves the decoder usable.

    Args:
        parts: the decoder's engine, planner (reset here), drafters (by registered name,
            every drafter the planner's plans may name; a round runs the one its plan
            names), cost model, proxy, D (the largest γ) and τ_conf (handed to drafters
            that run the model).
        cache: the decoder's single-sequence cache (reset here).
        window: the decoder's reference-window buffer (cleared here).
        request: the call (checked when it was built); an unseeded sampled request
            draws a fresh seed from torch's global RNG here.
        reused_tokens: the cache already holds the K/V of the prompt's first this-many
            tokens (a conversation's earlier turns, a cached prefix): only the rest is
            prefilled. ``0 <= reused_tokens < request.prompt_tokens``.
        proposers: the drafters that propose before planning, when the caller keeps
            their state across calls (a conversation's lookup index); None: the planner's
            ``proposal_drafters()`` among the decoder's drafters, reset with the prompt.
        indexed_tokens: with ``proposers``, how many of the prompt's first tokens they
            have already seen (they are extended with the rest); 0 resets them.
    """

    def __init__(
        self,
        parts: DecoderParts,
        cache: KVCache,
        window: WindowBuffer,
        request: Request,
        *,
        reused_tokens: int = 0,
        proposers: Sequence[Drafter] | None = None,
        indexed_tokens: int = 0,
    ) -> None:
        engine, planner = parts.engine, parts.planner
        if not 0 <= reused_tokens < request.prompt_tokens or cache.seq_length < reused_tokens:
            raise ValueError(
                f"reused_tokens={reused_tokens} must be in [0, {request.prompt_tokens}) and "
                f"held by every layer of the cache (it holds {cache.seq_length})"
            )
        self.request = request
        self.reused_tokens = reused_tokens
        self.indexed_tokens = indexed_tokens if proposers is not None else 0
        self.engine = engine
        self.cache = cache
        self.window = window
        self.planner = planner
        self.drafters: Mapping[str, Drafter] = parts.drafters
        self.cost_model = parts.cost_model
        self.proxy = parts.proxy
        self.max_draft_length = parts.max_draft_length
        self.confidence_threshold = parts.confidence_threshold
        self.logits_processor = request.logits_processor
        self.prompt = request.prompt.to(engine.device)
        self.streamer = request.streamer
        self.sampler = TokenSampler.for_request(request, engine.device)
        self.uses_window = planner.uses_window
        self.proposal_names = planner.proposal_drafters()
        self.proposers = (
            list(proposers)
            if proposers is not None
            else [self.drafters[name] for name in sorted(self.proposal_names)]
        )
        #: The sequence's request, output and counters (its commits).
        self.row = Row(request, self.sampler, self.proposers)
        self.stats: GenerationStats = self.row.stats
        self.output: list[int] = self.row.output
        self.synchronize = self.engine.device.type == "cuda"
        #: Token trees need the engine's tree pass, and a logits processor sees one
        #: sequence per row (a tree's rows follow different paths).
        self.trees = self.logits_processor is None and hasattr(engine, "forward_tree")

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def _process(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """``(rows, vocab)`` logits through the call's logits processor (unchanged without).

        Row ``j`` predicts the token after ``drafts[:j]``, so the processor sees the
        committed sequence followed by those drafts: a draft step and the verification
        row at the same position are processed identically.
        """
        if self.logits_processor is None:
            return logits
        committed = self.sequence[: self.prompt.numel() + len(self.output)]
        rows = []
        for j in range(logits.shape[0]):
            prefix = torch.cat([committed, torch.tensor(drafts[:j], dtype=torch.long)])
            row = logits[j : j + 1].float().clone()  # processors may write in place
            rows.append(self.logits_processor(prefix.unsqueeze(0).to(logits.device), row))
        return torch.cat(rows)

    def _choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The token at absolute ``position`` from ``logits (vocab,)``: argmax or a sample,
        with the processed distribution when sampling (:class:`TokenSampler`)."""
        return self.sampler.choose(logits, position)

    def execute(self) -> GenerationResult:
        engine, cache, stats, planner = self.engine, self.cache, self.stats, self.planner
        start_time = self._now()
        reused = self.reused_tokens
        cache.crop(reused)  # 0: an empty cache
        self.window.clear()
        planner.reset()
        if self.streamer is not None:
            self.streamer.put(  # type: ignore[no-untyped-call]
                self.prompt.unsqueeze(0).cpu()
            )
        n = self.prompt.numel()
        stats.cached_prompt_tokens = reused
        max_new_tokens = self.request.max_new_tokens
        cache.reserve(n + max_new_tokens + self.max_draft_length + 1)
        # The prompt and committed tokens, for planners that read the token ids.
        self.sequence = torch.empty(n + max_new_tokens, dtype=torch.long)
        self.sequence[:n] = self.prompt.cpu()

        capture = self._wants_window()
        seed = min(PREFILL_WINDOW_TOKENS, n - reused) if capture else None
        # Only the tokens past the reused prefix; an exact engine computes them bitwise as
        # a prefill of the whole prompt would (SublayerEngine.chunk_invariant).
        out = engine.forward(
            self.prompt[reused:],
            reused,
            cache,
            all_logits=False,
            capture_points=capture,
            capture_last=seed,
        )
        check_finite(out.logits, "prefill", error=NonFiniteLogitsError.during)
        if out.points is not None and seed:
            # Target tokens for the seed: the model's argmax after each seed token.
            seed_logits = engine.logits(out.hidden[-seed:])
            self.window.push(out.points, self.prompt[-seed:], seed_logits.argmax(-1), n - seed)
        pending, _ = self._choose(self._process(out.logits[-1:], [])[0], n)
        stats.prefill_time_s = self._now() - start_time
        self._commit([pending])

        round_index = 0
        last_plan: DraftPlan | None = None
        proposers = self.proposers
        for drafter in proposers:
            if self.indexed_tokens:
                drafter.extend(self.sequence[self.indexed_tokens : n + 1].tolist())
            else:
                drafter.reset(self.sequence[: n + 1].tolist())
        while not self._finished():
            plan_start = self._now()
            remaining = self.request.remaining(len(self.output))
            room = draft_room(self.max_draft_length, remaining, n, engine.max_context)
            proposals = self._propose(proposers, DraftRequest(room, pending, n))
            context = PlanningContext(
                engine=engine,
                cache=cache,
                context_length=n,
                window=self.window if self.uses_window else None,
                cost_model=self.cost_model,
                proxy=self.proxy,
                max_draft_length=self.max_draft_length,
                sampling=self.request.sampling,
                round_index=round_index,
                remaining_tokens=remaining,
                tokens=self.sequence[: self.prompt.numel() + len(self.output)],
                proposals=proposals,
                trees=self.trees,
            )
            plan = planner.plan(context)
            stats.plan_time_s += self._now() - plan_start
            if last_plan is None or _plan_key(plan) != _plan_key(last_plan):
                self._record_plan(plan, round_index, n)
                last_plan = plan
            if plan.draft_length == 0 and plan.best_draft_speedup is not None:
                best = stats.best_rejected_draft_speedup
                stats.best_rejected_draft_speedup = max(best or 0.0, plan.best_draft_speedup)
            budget = max(0, min(plan.draft_length, room))
            draft = self._draft(plan, proposals, pending, n, budget)
            verification = self._verify(pending, draft, n, self._wants_window())
            accepted = verification.accepted
            # Inputs at positions n .. n + accepted are now committed: keep their K/V only.
            cache.crop(n + accepted + 1)
            if verification.points is not None and verification.target_next is not None:
                inputs = torch.tensor(
                    [pending, *verification.tokens[:accepted]], device=engine.device
                )
                self.window.push(
                    verification.points[:, : accepted + 1],
                    inputs,
                    verification.target_next[: accepted + 1],
                    n,
                )
            n += accepted + 1
            committed = self._commit(verification.tokens)
            drafter_name = draft.drafter if draft.tokens else "none"
            stats.record_round(
                len(draft) if draft.tree is None else len(draft.tree),
                accepted,
                committed,
                drafter_name,
                plan.predicted_acceptance,
                depth=len(draft) if draft.tree is None else max(draft.tree.depths),
            )
            pending = verification.tokens[-1]
            kept = verification.tokens[:committed]
            for drafter in proposers:
                drafter.extend(kept)
            outcome = StepOutcome(
                plan,
                n,
                len(draft),
                accepted,
                draft.seconds,
                verification.seconds,
                proposals=proposals,
                committed_tokens=tuple(kept),
            )
            planner.update(outcome)
            round_index += 1

        stats.wall_time_s = self._now() - start_time
        stats.new_tokens = len(self.output)
        if self.streamer is not None:
            self.streamer.end()  # type: ignore[no-untyped-call]
        tokens = torch.tensor(self.output, dtype=torch.long)
        sequences = torch.cat([self.prompt.cpu(), tokens]).unsqueeze(0)
        return GenerationResult(tokens=tokens, sequences=sequences, stats=stats)

    def _wants_window(self) -> bool:
        """Whether the next full-model pass records the reference window."""
        if not self.uses_window:
            return False
        committed = self.prompt.numel() + len(self.output)
        return self.planner.wants_window(self.sequence[:committed])

    def _finished(self) -> bool:
        """Whether the sequence has stopped (:meth:`Row.commit` says why)."""
        return self.row.stopped

    def _commit(self, tokens: list[int]) -> int:
        """Append tokens up to the limit / first stop token; stream them. Returns the count."""
        kept = self.row.commit(tokens)
        end = self.prompt.numel() + len(self.output)
        self.sequence[end - len(kept) : end] = torch.tensor(kept, dtype=torch.long)
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor(kept, dtype=torch.long))  # type: ignore[no-untyped-call]
        return len(kept)

    def _propose(self, proposers: list[Drafter], request: DraftRequest) -> tuple[Draft, ...]:
        """This round's proposals by the drafters the planner prices before planning."""
        if not proposers:
            return ()
        started = self._now()
        proposals = tuple(drafter.propose(request) for drafter in proposers)
        self.stats.lookup_time_s += self._now() - started
        return proposals

    def _draft(
        self, plan: DraftPlan, proposals: tuple[Draft, ...], pending: int, n: int, budget: int
    ) -> Draft:
        """The plan's draft of up to ``budget`` tokens after ``pending`` (at position ``n``):
        the named drafter's proposal of this round cut to ``budget`` when it proposed
        before planning, else what the named drafter proposes now."""
        if budget == 0:
            return _NO_DRAFT
        drafter = self.drafters.get(plan.drafter)
        if drafter is None:
            raise RuntimeError(
                f"the planner chose drafter {plan.drafter!r}, which is not among its "
                f"plan_drafters() {sorted(self.drafters)}"
            )
        if drafter.proposes_before_planning:
            for proposal in proposals:
                if proposal.drafter == plan.drafter:
                    if plan.tree_nodes is not None and proposal.tree is not None:
                        depths = proposal.tree.depths
                        return proposal.branched(
                            [i for i in plan.tree_nodes if depths[i] <= budget]
                        )
                    return proposal.truncated(budget)
            raise RuntimeError(
                f"the planner chose drafter {plan.drafter!r}, which proposed nothing this "
                f"round (proposals: {[p.drafter for p in proposals]})"
            )
        target = DraftTarget(
            self.engine,
            self.cache,
            # The pending token sits at position n: the j-th draft token is at n + 1 + j.
            lambda logits, drafted: self._choose(
                self._process(logits[None], drafted)[0], n + 1 + len(drafted)
            ),
            self._now,
            cost_model=self.cost_model,
            confidence_threshold=self.confidence_threshold,
        )
        draft = drafter.propose(DraftRequest(budget, pending, n, plan.mask, target))
        self.stats.draft_time_s += draft.seconds
        return draft

    def _verify(self, pending: int, draft: Draft, n: int, capture: bool) -> Verification:
        """One full forward over ``[pending, *draft]`` and the acceptance test; with
        ``capture``, also the window data."""
        engine = self.engine
        if draft.tree is not None:
            parts = TreeRoundParts(
                engine, self.cache, self.sampler, self.stats, self.cost_model, self._now
            )
            return verify_tree_round(parts, draft.tree, pending, n, capture)
        verify_start = self._now()
        inputs = torch.tensor([pending, *draft.tokens], device=engine.device)
        out = engine.forward(inputs, n, self.cache, capture_points=capture)
        check_finite(out.logits, "verification", error=NonFiniteLogitsError.during)
        target_next = greedy_ids(out.logits) if capture else None
        drafts = list(draft.tokens)
        scores = self._process(out.logits, drafts)
        verdict = self.sampler.verify(draft, scores, n + 1)  # row 0 picks position n + 1
        elapsed = self._now() - verify_start
        self.stats.verify_time_s += elapsed
        if self.cost_model is not None:
            self.cost_model.observe(LatencyObservation("verify", n, elapsed, len(drafts) + 1))
        return Verification(verdict.accepted, verdict.tokens, elapsed, out.points, target_next)

    def _record_plan(self, plan: DraftPlan, round_index: int, n: int) -> None:
        skipped = plan.mask.skipped
        self.stats.plans.append(
            PlanRecord(
                round_index=round_index,
                context_length=n,
                draft_length=plan.draft_length,
                skipped_attention=sum(1 for i in skipped if i % 2 == 0),
                skipped_mlp=sum(1 for i in skipped if i % 2 == 1),
                skipped_items=skipped,
                source=plan.source,
                predicted_acceptance=plan.predicted_acceptance,
                drafter=plan.drafter_used,
            )
        )


#: The empty draft of a γ = 0 round.
_NO_DRAFT = Draft((), NO_DRAFT)


def _plan_key(plan: DraftPlan) -> tuple[str, int, SublayerMask]:
    """What makes a plan a different plan in the stats: who drafts, how many, which mask
    (a lookup plan's predictions change every round; recording each would flood them)."""
    return plan.drafter_used, plan.draft_length, plan.mask


__all__ = [
    "PREFILL_WINDOW_TOKENS",
    "DecoderParts",
    "GenerationResult",
    "LogitsProcessor",
    "Run",
]
