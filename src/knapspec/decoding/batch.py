"""Batched decoding: several prompts at once, per-row lookup drafts, ragged acceptance.

One round over the active rows::

    proposals = each row's lookup continuation            # per-row n-gram index
    γ_r       = policy.draft_lengths(...)                  # batch-level TPT, 0 allowed
    logits    = full model on [pending_r, drafts_r] per row, padded to 1 + max γ_r
    each row keeps its accepted prefix + one target token; its cache length moves to
    exactly its committed tokens (a row that accepts 0 and one that accepts all coexist)

Rows that stop (EOS or ``max_new_tokens``) leave the batch: the cache packs the remaining
rows to the front and later steps compute only those. Each row's prefill runs alone
through the engine's single-sequence path (compute-bound, so batching it gains nothing),
and its K/V is copied into the batch cache.

Greedy rows equal their prompt decoded alone; sampled rows use their own generator and
lossless rejection sampling, so each is distributed as the target.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.decoding.batch_policy import BatchDraftPolicy
from knapspec.decoding.stats import GenerationStats
from knapspec.decoding.verify import check_finite, verify_greedy, verify_sampling
from knapspec.drafters.base import LOOKUP, Draft
from knapspec.drafters.lookup import LookupDrafter
from knapspec.model.batched import forward_batch, new_batch_cache
from knapspec.sampling import SamplingParams, processed_probs, sample_token

if TYPE_CHECKING:
    from knapspec.model.batch_cache import BatchKVCache
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine


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


def batch_prompts(
    input_ids: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    attention_mask: torch.Tensor | None,
    vocab_size: int,
) -> list[torch.Tensor]:
    """The rows of a batch as 1-D ``long`` tensors, padding removed.

    Args:
        input_ids: ``(B, n)`` left-padded ids, or a list of ``B`` token sequences.
        attention_mask: ``(B, n)`` 1 for tokens, 0 for (left) padding; only with a tensor.

    Raises:
        ValueError: naming the row: a mask of another shape, padding that is not on the
            left, an empty row, ids out of ``[0, vocab_size)``.
    """
    rows: list[torch.Tensor] = []
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"batched input_ids must be (B, n), got {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; they must match"
            )
        for row in range(input_ids.shape[0]):
            keep = mask[row].bool()
            count = int(keep.sum())
            if count and not bool(keep[-count:].all()):
                raise ValueError(
                    f"row {row}: attention_mask must be left padding (zeros, then ones); "
                    "pad on the left or pass a list of sequences"
                )
            rows.append(input_ids[row, keep])
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only for a (B, n) tensor; a list has no padding")
        rows = [torch.as_tensor(row) for row in input_ids]
    if not rows:
        raise ValueError("the batch is empty: give at least one prompt")
    checked = []
    for row, ids in enumerate(rows):
        if ids.dim() != 1:
            raise ValueError(f"row {row}: a prompt must be 1-D token ids, got {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError(f"row {row}: the prompt is empty: give at least one token")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"row {row}: token ids must be integers, got dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"row {row}: token ids must be in [0, {vocab_size})")
        checked.append(ids.to(torch.long).cpu())
    return checked


class BatchRun:
    """State of one batched ``generate`` call (rebuilt per call: an exception leaves the
    decoder usable).

    Args:
        engine: the decoder's engine.
        scratch: a single-sequence cache each prompt is prefilled in, one at a time.
        prompts: the rows' prompts (checked by :func:`batch_prompts`).
        policy: chooses each row's γ per round.
        lookup: a drafter whose config every row's own lookup drafter copies.
        generators: per row, its sampling generator (None when greedy).
    """

    def __init__(
        self,
        engine: SublayerEngine,
        scratch: KVCache,
        prompts: list[torch.Tensor],
        *,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        params: SamplingParams,
        policy: BatchDraftPolicy,
        max_draft_length: int,
        lookup: LookupDrafter | None,
        generators: list[torch.Generator | None],
    ) -> None:
        self.engine = engine
        self.scratch = scratch
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.params = params
        self.policy = policy
        self.max_draft_length = max_draft_length
        self.generators = generators
        count = len(prompts)
        self.drafters = [
            LookupDrafter(lookup.config if lookup is not None else None) for _ in range(count)
        ]
        self.stats = [GenerationStats(prompt_tokens=p.numel()) for p in prompts]
        self.outputs: list[list[int]] = [[] for _ in range(count)]
        self.synchronize = engine.device.type == "cuda"

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter()

    def _choose(self, row: int, logits: torch.Tensor) -> int:
        """One token from ``logits (vocab,)`` for ``row``: argmax or a sample."""
        if not self.params.do_sample:
            return int(logits.argmax())
        return sample_token(processed_probs(logits, self.params), self.generators[row])

    def _commit(self, row: int, tokens: list[int]) -> int:
        """Append up to the limit / first stop token; returns how many were kept."""
        output, stats = self.outputs[row], self.stats[row]
        kept: list[int] = []
        for token in tokens[: self.max_new_tokens - len(output)]:
            kept.append(token)
            if token in self.stop_ids:
                stats.stop_reason = "eos"
                break
        output.extend(kept)
        if not stats.stop_reason and len(output) >= self.max_new_tokens:
            stats.stop_reason = "max_new_tokens"
        return len(kept)

    def execute(self) -> BatchGenerationResult:
        engine, prompts = self.engine, self.prompts
        start_time = self._now()
        capacity = max(p.numel() for p in prompts) + self.max_new_tokens + self.max_draft_length
        cache = new_batch_cache(engine, len(prompts), capacity)
        self.policy.reset(len(prompts))
        pending: list[int] = []
        for row, prompt in enumerate(prompts):
            started = self._now()
            self.scratch.reset()
            out = engine.forward(prompt, 0, self.scratch, all_logits=False)
            check_finite(out.logits, f"prefill of row {row}")
            cache.load_row(row, self.scratch, prompt.numel())
            token = self._choose(row, out.logits[-1])
            pending.append(token)
            self._commit(row, [token])
            self.drafters[row].reset([*prompt.tolist(), token])
            self.stats[row].prefill_time_s = self._now() - started
        active = list(range(len(prompts)))  # batch rows, in cache order
        lengths = [p.numel() for p in prompts]  # committed tokens with K/V cached
        while True:
            self._retire(active, cache, start_time)
            if not active:
                break
            self._round(active, cache, pending, lengths)
        wall = self._now() - start_time
        for row, stats in enumerate(self.stats):
            stats.new_tokens = len(self.outputs[row])
        tokens = [torch.tensor(out, dtype=torch.long) for out in self.outputs]
        sequences = [torch.cat([p, t]).unsqueeze(0) for p, t in zip(prompts, tokens, strict=True)]
        return BatchGenerationResult(tokens, sequences, self.stats, wall)

    def _retire(self, active: list[int], cache: BatchKVCache, start_time: float) -> None:
        """Drop rows that stopped; pack the cache onto the rows still running."""
        keep = [slot for slot, row in enumerate(active) if not self.stats[row].stop_reason]
        if len(keep) == len(active):
            return
        now = self._now()
        for row in active:
            if self.stats[row].stop_reason:
                self.stats[row].wall_time_s = now - start_time
        active[:] = [active[slot] for slot in keep]
        if active:
            cache.keep(keep)

    def _round(
        self, active: list[int], cache: BatchKVCache, pending: list[int], lengths: list[int]
    ) -> None:
        """Draft per row, verify the batch once, commit each row's accepted tokens."""
        engine = self.engine
        started = self._now()
        proposals: list[Draft] = []
        for row in active:
            room = min(
                self.max_draft_length,
                self.max_new_tokens - len(self.outputs[row]) - 1,
                engine.max_context - lengths[row] - 1,
            )
            proposals.append(self.drafters[row].propose(max(0, room)))
        contexts = [lengths[row] for row in active]
        gammas = self.policy.draft_lengths(active, proposals, contexts)
        drafts = [p.tokens[:g] for p, g in zip(proposals, gammas, strict=True)]
        lookup_time = self._now() - started
        width = 1 + max(len(d) for d in drafts)
        inputs = torch.zeros(len(active), width, dtype=torch.long)
        for slot, row in enumerate(active):
            row_inputs = [pending[row], *drafts[slot]]
            inputs[slot, : len(row_inputs)] = torch.tensor(row_inputs)
        verify_start = self._now()
        logits = forward_batch(engine, inputs, contexts, cache)
        check_finite(logits, "batched verification")
        new_lengths = []
        for slot, row in enumerate(active):
            draft = list(drafts[slot])
            scores = logits[slot, : len(draft) + 1]
            if self.params.do_sample:
                target = processed_probs(scores, self.params)
                one_hot = Draft(tuple(draft), LOOKUP).draft_probs(target.shape[-1], target.device)
                verdict = verify_sampling(draft, one_hot, target, self.generators[row])
            else:
                verdict = verify_greedy(draft, scores)
            # Inputs at positions n .. n + accepted are now this row's: keep their K/V only.
            lengths[row] += verdict.accepted + 1
            new_lengths.append(lengths[row])
            committed = self._commit(row, verdict.tokens)
            kept = verdict.tokens[:committed]
            self.drafters[row].extend(kept)
            self.policy.observe(row, proposals[slot], kept)
            pending[row] = verdict.tokens[-1]
            self.stats[row].lookup_time_s += lookup_time
            self.stats[row].record_round(
                len(draft), verdict.accepted, committed, LOOKUP if draft else "none"
            )
        cache.set_lengths(new_lengths)
        # Not fed to the cost model: a batched pass is not a single sequence's verification
        # of that width (every row reads its own cache), and would skew its estimates; the
        # policy learns the batched passes' own correction instead.
        elapsed = self._now() - verify_start
        self.policy.observe_pass(len(active), width, round(sum(contexts) / len(contexts)), elapsed)
        for row in active:
            self.stats[row].verify_time_s += elapsed


__all__ = ["BatchGenerationResult", "BatchRun", "batch_prompts"]
