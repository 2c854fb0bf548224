"""Batched decoding: several prompts at once, per-row drafts, ragged acceptance.

One round over the active rows::

    proposals = each row's proposal (e.g. its lookup)      # per-row drafter copies
    plan      = policy.plan_round(...)                     # batch-level TPT: γ_r, drafter_r
    drafts    = lookup rows: their proposal's first γ_r tokens;
                sub-network rows: G = max γ_r batched steps of the shared mask
    logits    = full model on [pending_r, drafts_r] per row (products packed over the
                Σ (1 + γ_r) real tokens, attention padded to 1 + max γ_r)
    each row keeps its accepted prefix + one target token; its cache length moves to
    exactly its committed tokens (a row that accepts 0 and one that accepts all coexist)

Drafters take part as they declare (:mod:`knapspec.drafters.base`), never by name: each
drafter the planner reads proposals of (its ``proposal_drafters()``) gets one copy per row
(``Drafter.for_row``) that proposes before every round, and a row offers the policy its
longest proposal. The shared draft (a layer-skipping mask) is chosen once per call: the
decoder's planner plans on the first row right after its prefill
(:class:`SubnetworkPlanner`); when the drafter it names drafts rows together
(``Drafter.drafts_rows_together``), the policy prices it every round against the rows'
proposals and γ = 0. Its batched steps (``Drafter.propose_batch``) run on every active row
(one product over all rows; a row that drafts its proposal ignores them) and write K/V
only past the rows' committed lengths, where the verification overwrites them. A plan
naming a drafter that drafts row by row and runs the model has no batch form: the batch
then drafts the rows' proposals only.

Rows that stop (EOS or ``max_new_tokens``) leave the batch: the cache packs the remaining
rows to the front and later steps compute only those. Each row's prefill runs alone
through the engine's single-sequence path (compute-bound, so batching it gains nothing),
and its K/V is copied into the batch cache. With fewer slots than prompts
(``generate_batch(..., max_batch_rows=S)``) the rest wait in input order and a finished
row's slot goes to the next one, prefilled between two rounds (continuous batching), so
a batch does not idle behind its slowest row while prompts wait.

Greedy rows equal their prompt decoded alone; sampled rows use their own seed
(:class:`~knapspec.decoding.sampler.TokenSampler`), and under position-keyed sampling
(the default) equal their prompt decoded alone with that seed too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.decoding.arguments import batch_prompts
from knapspec.decoding.row import Row
from knapspec.decoding.run import PREFILL_WINDOW_TOKENS
from knapspec.decoding.sampler import TokenSampler
from knapspec.decoding.stats import GenerationStats
from knapspec.drafters.base import NO_DRAFT, BatchDraftRequest, Draft, Drafter, DraftRequest
from knapspec.errors import NonFiniteLogitsError
from knapspec.model.passes.batched import forward_batch, new_batch_cache
from knapspec.planners.batch.policy import BatchDraftPolicy, BatchSubnetwork, RoundPlan
from knapspec.request import Request
from knapspec.validators import check_finite

if TYPE_CHECKING:
    from knapspec.decoding.prefix_cache import PrefixCache
    from knapspec.model.batch_cache import BatchKVCache
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import ForwardOutput, SublayerEngine

#: ``(prompt (n,), its prefill in the single-sequence cache, the prefill's output) ->`` the
#: sub-network the batch may draft with (None: none). Called once, after the first row's
#: prefill; the output carries the item points when :attr:`capture_points` asks for them.
SubnetworkPlanner = Callable[[torch.Tensor, "KVCache", "ForwardOutput"], BatchSubnetwork | None]


@attrs.frozen
class BatchGenerationResult:
    """Output of a batched :meth:`~knapspec.SpeculativeDecoder.generate`.

    Attributes:
        tokens: per row, ``(new_r,)`` generated token ids.
        sequences: per row, ``(1, prompt_r + new_r)`` prompt and generated ids (unpadded).
        stats: per row, its counters; ``stop_reason`` is ``"eos"`` or ``"max_new_tokens"``;
            ``wall_time_s`` runs from the call's start to the row's last token, and the
            batch's verify time is charged to every row it verified.
        wall_time_s: the whole call.
    """

    tokens: list[torch.Tensor]
    sequences: list[torch.Tensor]
    stats: list[GenerationStats]
    wall_time_s: float

    @property
    def stop_reasons(self) -> list[str]:
        """Per row, why it stopped."""
        return [stats.stop_reason for stats in self.stats]

    @property
    def new_tokens(self) -> int:
        """New tokens over all rows."""
        return sum(stats.new_tokens for stats in self.stats)

    @property
    def tokens_per_second(self) -> float:
        """New tokens over all rows per second of the call (throughput)."""
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def padded_sequences(self, pad_token_id: int) -> torch.Tensor:
        """``(B, max_len)`` sequences right-padded with ``pad_token_id``."""
        width = max(seq.shape[1] for seq in self.sequences)
        out = torch.full((len(self.sequences), width), pad_token_id, dtype=torch.long)
        for row, seq in enumerate(self.sequences):
            out[row, : seq.shape[1]] = seq[0]
        return out


class BatchRun:
    """State of one batched ``generate`` call (rebuilt per call: an exception leaves the
    decoder usable).

    Args:
        engine: the decoder's engine.
        scratch: a single-sequence cache each prompt is prefilled in, one at a time.
        requests: per row, what it decodes (prompt, ``max_new_tokens``, sampling, stop
            ids, seed); each becomes a :class:`~knapspec.decoding.row.Row` here (its
            sampler, its drafter copies), in row order.
        policy: chooses each row's γ per round.
        drafters: by registered name, the decoder's drafters: those in ``proposers`` are
            copied per row (``for_row``), the one the sub-network plan names drafts the
            rows together (``propose_batch``).
        proposers: the drafters that propose before every round (the planner's
            ``proposal_drafters()``).
        plan_subnetwork: chooses the sub-network on the first row (None: lookup only).
        capture_points: the first row's prefill records the item points (the planner
            reads them as its reference window).
        slots: rows decoded at once (None: all). With fewer slots than prompts the rest
            wait in input order, and each row that finishes hands its slot to the next
            prompt, prefilled between two rounds (continuous batching): the batch never
            idles behind its slowest row while prompts wait.
        prefix_cache: where each row's prefill looks up the longest cached prefix of its
            prompt (and keeps the prompt's K/V for later calls); None: none.
    """

    def __init__(
        self,
        engine: SublayerEngine,
        scratch: KVCache,
        requests: list[Request],
        *,
        policy: BatchDraftPolicy,
        max_draft_length: int,
        drafters: Mapping[str, Drafter],
        proposers: Iterable[str] = (),
        plan_subnetwork: SubnetworkPlanner | None = None,
        capture_points: bool = False,
        slots: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.engine = engine
        self.prefix_cache = prefix_cache
        self.scratch = scratch
        self.policy = policy
        self.max_draft_length = max_draft_length
        self.plan_subnetwork = plan_subnetwork
        self.capture_points = capture_points
        self.subnetwork: BatchSubnetwork | None = None
        count = len(requests)
        self.slots = count if slots is None else max(1, min(slots, count))
        self.shared_drafters = drafters
        names = sorted(proposers)
        #: Per row (a lane of a continuous batch), its request and all it has done.
        self.rows = [
            Row(
                request,
                TokenSampler.for_request(request, engine.device),
                [drafters[name].for_row(engine) for name in names],
            )
            for request in requests
        ]
        columns = zip(*(row.drafters for row in self.rows), strict=True)
        for column in columns:  # one drafter kind, every row
            for drafter in column:
                drafter.share_rows(column)
        self.synchronize = engine.device.type == "cuda"

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def _choose(self, row: int, logits: torch.Tensor, position: int) -> int:
        """``row``'s token at absolute ``position`` from ``logits (vocab,)``."""
        return self._choose_with_q(row, logits, position)[0]

    def _choose_with_q(
        self, row: int, logits: torch.Tensor, position: int
    ) -> tuple[int, torch.Tensor | None]:
        """``row``'s token at ``position`` and, when sampled, its distribution."""
        return self.rows[row].sampler.choose(logits, position)

    def _failed_rows(self, active: list[int], logits: torch.Tensor, widths: list[int]) -> set[int]:
        """Slots of ``active`` whose verification ``logits`` (packed, ``widths`` per row)
        are not finite and leave the round uncommitted. Here every such pass raises
        :class:`NonFiniteLogitsError` (the call fails); a server fails those rows alone."""
        check_finite(logits, "batched verification", error=NonFiniteLogitsError.during)
        return set()

    def execute(self) -> BatchGenerationResult:
        engine, rows = self.engine, self.rows
        start_time = self._now()
        longest = max(row.request.prompt_tokens + row.request.max_new_tokens for row in rows)
        cache = new_batch_cache(engine, self.slots, longest + self.max_draft_length)
        cache.keep([])  # no active row yet: each prompt enters through _admit
        self.policy.reset(len(rows))
        self.policy.use_subnetwork(None)
        waiting = deque(range(len(rows)))
        active: list[int] = []  # batch rows, in cache order
        while True:
            self._retire(active, cache, start_time)
            if waiting and len(active) < self.slots:
                self._admit(waiting.popleft(), cache, active)
                continue  # a row may stop on its first token: retire before the next
            if not active:
                break
            self._round(active, cache)
        wall = self._now() - start_time
        for row in rows:
            row.stats.new_tokens = len(row.output)
        tokens = [torch.tensor(row.output, dtype=torch.long) for row in rows]
        sequences = [
            torch.cat([row.request.prompt, t]).unsqueeze(0)
            for row, t in zip(rows, tokens, strict=True)
        ]
        return BatchGenerationResult(tokens, sequences, [row.stats for row in rows], wall)

    def _admit(self, index: int, cache: BatchKVCache, active: list[int]) -> None:
        """Prefill row ``index``'s prompt alone, move its K/V into a free slot of ``cache``
        and commit its first token; the first row admitted also plans the sub-network."""
        engine, row = self.engine, self.rows[index]
        prompt = row.request.prompt
        started = self._now()
        prefixes = self.prefix_cache
        reused = prefixes.restore(prompt, self.scratch) if prefixes is not None else 0
        self.scratch.crop(reused)  # 0: empty
        planning = index == 0 and self.plan_subnetwork is not None
        capture = planning and self.capture_points
        new = prompt.numel() - reused
        out = engine.forward(
            prompt[reused:],
            reused,
            self.scratch,
            all_logits=False,
            capture_points=capture,
            capture_last=min(PREFILL_WINDOW_TOKENS, new) if capture else None,
        )
        row.stats.cached_prompt_tokens = reused
        if prefixes is not None:
            prefixes.store(prompt, self.scratch, prompt.numel())
        check_finite(out.logits, f"prefill of row {index}", error=NonFiniteLogitsError.during)
        cache.append_row(self.scratch, prompt.numel())
        active.append(index)
        token = self._choose(index, out.logits[-1], prompt.numel())
        row.pending = token
        row.commit([token])
        for drafter in row.drafters:
            drafter.reset([*prompt.tolist(), token])
        row.stats.prefill_time_s = self._now() - started
        if planning and self.plan_subnetwork is not None:
            # The scratch cache still holds this row's prefill: the planner reads it.
            plan_start = self._now()
            self.subnetwork = self.plan_subnetwork(prompt, self.scratch, out)
            self.policy.use_subnetwork(self.subnetwork)
            row.stats.plan_time_s += self._now() - plan_start

    def _retire(self, active: list[int], cache: BatchKVCache, start_time: float) -> None:
        """Drop rows that stopped; pack the cache onto the rows still running. The last
        running rows move into the freed slots (the others stay put), so a retirement
        copies one row's K/V per freed slot, not every row behind it."""
        running = [slot for slot, index in enumerate(active) if not self.rows[index].stopped]
        if len(running) == len(active):
            return
        now = self._now()
        for index in active:
            if self.rows[index].stopped:
                self.rows[index].stats.wall_time_s = now - start_time
        count = len(running)
        staying = set(running)
        movers = iter(slot for slot in running if slot >= count)
        keep = [slot if slot in staying else next(movers) for slot in range(count)]
        active[:] = [active[slot] for slot in keep]
        cache.keep(keep)

    def _round(self, active: list[int], cache: BatchKVCache) -> None:
        """Draft per row, verify the batch once, commit each row's accepted tokens."""
        engine = self.engine
        started = self._now()
        rows = [self.rows[index] for index in active]
        proposals: list[Draft] = []
        rooms: list[int] = []
        for row in rows:
            rooms.append(row.draft_room(self.max_draft_length, engine.max_context))
            # A batched round verifies chains: no drafter should build a tree for it.
            request = DraftRequest(rooms[-1], row.pending, row.length, chain_only=True)
            proposals.append(_longest(d.propose(request) for d in row.drafters))
        contexts = [row.length for row in rows]
        plan = self.policy.plan_round(active, proposals, contexts, rooms)
        lookup_time = self._now() - started
        drafts = self._drafts(active, cache, contexts, proposals, plan)
        width = 1 + max(len(d) for d in drafts)
        inputs = torch.zeros(len(active), width, dtype=torch.long)
        for slot, row in enumerate(rows):
            row_inputs = [row.pending, *drafts[slot].tokens]
            inputs[slot, : len(row_inputs)] = torch.tensor(row_inputs)
        widths = [1 + len(d) for d in drafts]
        verify_start = self._now()
        # (Σ widths, vocab): row after row, only the real tokens' logits.
        logits = forward_batch(engine, inputs, contexts, cache, widths=widths, packed_logits=True)
        failed = self._failed_rows(active, logits, widths)
        new_lengths = []
        offset = 0
        for slot, (index, row) in enumerate(zip(active, rows, strict=True)):
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
            self.policy.observe(index, proposals[slot], kept)
            if self.subnetwork is not None and draft.drafter == self.subnetwork.drafter and tokens:
                self.policy.observe_subnetwork(index, len(tokens), verdict.accepted)
            row.pending = verdict.tokens[-1]
            row.stats.lookup_time_s += lookup_time
            row.stats.record_round(
                len(tokens), verdict.accepted, len(kept), draft.drafter if tokens else NO_DRAFT
            )
        cache.set_lengths(new_lengths)
        # Not fed to the cost model: a batched pass is not a single sequence's verification
        # of that width (every row reads its own cache), and would skew its estimates; the
        # policy learns the batched passes' own correction instead.
        elapsed = self._now() - verify_start
        mean_context = round(sum(contexts) / len(contexts))
        self.policy.observe_pass(len(active), width, mean_context, elapsed, widths=widths)
        for row in rows:
            row.stats.verify_time_s += elapsed

    def _drafts(
        self,
        active: list[int],
        cache: BatchKVCache,
        contexts: list[int],
        proposals: list[Draft],
        plan: RoundPlan,
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
        if steps <= 0 or self.subnetwork is None:
            return drafts
        mean_context = round(sum(contexts) / len(contexts))
        request = BatchDraftRequest(
            self.engine,
            cache,
            [self.rows[index].pending for index in active],
            contexts,
            steps,
            self.subnetwork.mask,
            lambda slot, logits, position: self._choose_with_q(active[slot], logits, position),
            self._now,
            on_step=lambda seconds: self.policy.observe_draft_pass(
                len(active), mean_context, seconds
            ),
        )
        shared = self.shared_drafters[self.subnetwork.drafter].propose_batch(request)
        for slot, (gamma, sub) in enumerate(
            zip(plan.draft_lengths, plan.subnetwork_rows, strict=True)
        ):
            if sub and min(gamma, steps):
                drafts[slot] = shared[slot].truncated(min(gamma, steps))
        for index in active:
            self.rows[index].stats.draft_time_s += shared[0].seconds
        return drafts


#: The empty draft of a row that drafts nothing this round.
_NO_DRAFT = Draft((), NO_DRAFT)


def _longest(proposals: Iterable[Draft]) -> Draft:
    """The longest of a row's proposals (the first on a tie; empty when none)."""
    best = _NO_DRAFT
    for proposal in proposals:
        if len(proposal) > len(best):
            best = proposal
    return best


__all__ = ["BatchGenerationResult", "BatchRun", "SubnetworkPlanner", "batch_prompts"]
