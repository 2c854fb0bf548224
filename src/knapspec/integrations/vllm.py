"""knapspec inside vLLM: a TPT-priced lookup proposer for vLLM's ``custom_class`` method.

vLLM (0.32) loads a user proposer class named in its speculative config::

    vllm serve MODEL --speculative-config '{"method": "custom_class",
        "model": "knapspec.integrations.vllm.KnapspecProposer", "num_speculative_tokens": 16}'

``vllm/v1/spec_decode/custom_class_proposer.py`` builds the class with the ``VllmConfig``;
the model runner (the CPU runner inherits the GPU runner's path) calls ``load_model(model)``
once and, after every step's bookkeeping, ``propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)``: row ``i`` of the input batch committed the tokens
``sampled_token_ids[i]`` (empty while it is still in prefill), its whole sequence is
``token_ids_cpu[i, :num_tokens_no_spec[i]]``, and the answer is one list of draft ids per
row, of any length up to ``num_speculative_tokens`` (empty: no draft). vLLM verifies the
drafts with its rejection sampler, so the output is vLLM's own whatever is drafted.

The proposer keeps one :class:`~knapspec.integrations.vllm_row.ProposerRow` per row: the
row's request as knapspec's :class:`~knapspec.request.Request` (the prompt it first saw, the
limit the model's length sets), its lookup index and its last proposal. What it does on
each call:

1. **Drafts** each row with knapspec's lookup index (:class:`~knapspec.drafters.lookup.
   LookupIndex`: the longest earlier-seen suffix of the prompt and the row's own output,
   continued by a vote of its most recent occurrences), and, with ``history_tokens > 0``,
   the sequences of earlier requests and of the other rows.
2. **Learns acceptance** in hindsight: the proposal a row got last call against the tokens
   it committed since (:class:`~knapspec.drafters.acceptance.LookupAcceptance`, per
   match-length bucket and position, shared by all requests).
3. **Learns the cost of vLLM's step** on this machine: the wall time between two calls is
   one whole engine step (schedule, forward over ``N`` tokens, sample, bookkeep, propose),
   and ``N`` is known when the batch did not change in between (every row decoded
   ``1 + γ_r`` tokens). :class:`StepCostCurve` keeps a smoothed time per ``N``, is read
   from a profile file or knapspec's cache at start-up and written back to the cache.
4. **Prices the whole batch** by tokens per time: a row's drafted token ``j`` adds its
   probability of being reached (the product of the conditional acceptances up to ``j``)
   to the step's expected tokens and one token to ``N``. For each count ``m`` of drafted
   tokens the best set is the ``m`` most likely ones (within a row they come in order), so
   the proposer drafts the ``m`` maximising ``(rows + Σ reach) / T(rows + m)``; ``m = 0``
   (no drafts at all) is one of the options, so a batch that is compute-bound, or rows
   with nothing worth copying, get ``γ = 0``.

Configuration: ``num_speculative_tokens`` of vLLM's speculative config caps γ; the rest is a
:class:`VllmProposerConfig`, read from the TOML file named by ``$KNAPSPEC_VLLM_CONFIG``
(top level or a ``[vllm]`` table) and then from ``$KNAPSPEC_VLLM_<FIELD>`` variables
(``KNAPSPEC_VLLM_HISTORY_TOKENS=16384``). The model runner's process is vLLM's worker, so
the variables must be set where ``vllm serve`` starts.

What does not carry over: knapspec's layer-skip drafts need to run the target with chosen
sublayers skipped, which the proposer interface cannot do (it gets the model, not the
runner's attention metadata and KV cache); token trees need a tree verifier vLLM's CPU
runner does not have. docs/serving.md ("Moving to vLLM") has the details,
results/serve/HISTORY.md the runs.

This module never imports vLLM: the class only reads attributes of the config it is given,
so it is tested without vLLM installed.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from knapspec.drafters.acceptance import LookupAcceptance, LookupAcceptanceConfig
from knapspec.drafters.lookup import LookupIndex
from knapspec.integrations.vllm_config import (
    CONFIG_ENV,
    ENV_PREFIX,
    VllmProposerConfig,
    VllmProposerError,
)
from knapspec.integrations.vllm_pricing import curve_key, load_curve, price_batch
from knapspec.integrations.vllm_row import ProposerRow
from knapspec.model import cachefiles
from knapspec.planners.objective import FloatArray

_LOG = logging.getLogger("knapspec.vllm")


@attrs.define
class ProposerStats:
    """Counters since start-up (the trace and the log's summary).

    Attributes:
        calls: propose() calls.
        row_steps: decoding rows over all calls.
        proposed_rows: rows that had a lookup proposal.
        drafted_rows: rows given a draft (γ >= 1).
        drafted_tokens: draft tokens handed to vLLM.
        accepted_tokens: of those, accepted (learned at the next call).
        timed_steps: steps whose wall time taught the cost curve.
        propose_seconds: time spent inside propose().
    """

    calls: int = 0
    row_steps: int = 0
    proposed_rows: int = 0
    drafted_rows: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    timed_steps: int = 0
    propose_seconds: float = 0.0


class KnapspecProposer:
    """A vLLM ``custom_class`` proposer: lookup drafts cut by the batch's tokens per time.

    Args:
        vllm_config: vLLM's ``VllmConfig`` (read: ``speculative_config.
            num_speculative_tokens``, ``model_config.max_model_len``, ``model_config.model``
            and ``dtype``, ``scheduler_config.max_num_seqs``,
            ``parallel_config.tensor_parallel_size``).
        config: knapspec's settings; None reads them from the environment
            (:meth:`VllmProposerConfig.from_environment`).
        clock: the timer (tests pass a fake one).

    Raises:
        VllmProposerError: no speculative config or ``num_speculative_tokens < 1``, or bad
            knapspec settings (the message names the fix).
    """

    def __init__(
        self,
        vllm_config: Any,
        config: VllmProposerConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        k = getattr(spec, "num_speculative_tokens", None)
        if spec is None or not isinstance(k, int) or k < 1:
            raise VllmProposerError(
                "KnapspecProposer needs vLLM's speculative config with num_speculative_tokens "
                '(the cap on γ) >= 1: --speculative-config \'{"method": "custom_class", '
                '"model": "knapspec.integrations.vllm.KnapspecProposer", '
                '"num_speculative_tokens": 16}\''
            )
        self.config = config if config is not None else VllmProposerConfig.from_environment()
        self.k = k
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(getattr(model_config, "max_model_len", 1 << 30) or (1 << 30))
        self.acceptance = LookupAcceptance(LookupAcceptanceConfig())
        self.rows: list[ProposerRow | None] = []
        self.history: deque[LookupIndex] = deque()
        self.stats = ProposerStats()
        self._clock = clock
        self._last_call: float | None = None
        self._last_width: int | None = None  # tokens the step after the last call ran
        self._last_batch = 0
        self._observed_since_save = 0
        self._lock = threading.Lock()
        self.curve, self._curve_path = load_curve(self.config, curve_key(vllm_config))
        # Held open for the server's life (one line per call), so not a ``with`` block.
        self._trace = (
            open(self.config.trace, "a", encoding="utf-8")  # noqa: SIM115
            if self.config.trace
            else None
        )
        if self._curve_path is not None:
            # Keep what was learned when the server stops (a weak reference: a discarded
            # proposer is not kept alive by the hook).
            this = weakref.ref(self)
            atexit.register(lambda: (p := this()) is not None and p.save_curve())
        _LOG.info(
            "knapspec proposer: cap %d, pricing %s, history %d tokens, step costs %s",
            self.k,
            self.config.pricing,
            self.config.history_tokens,
            self._describe_curve(),
        )

    # -- vLLM's interface ---------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM hands over the target model; lookup drafting needs none."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
        **kwargs: Any,
    ) -> list[list[int]]:
        """Draft ids for every row of the batch (see the module docstring).

        Args:
            sampled_token_ids: per row, the tokens committed by the step that just ran
                (empty: the row is in prefill, or was discarded).
            num_tokens_no_spec: ``(max_num_reqs,)`` tokens of each row's sequence.
            token_ids_cpu: ``(max_num_reqs, max_model_len)`` the rows' token ids.
            slot_mappings: unused (the KV slots of the step).
        """
        with self._lock:
            return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    # -- the work -----------------------------------------------------------------------

    def _propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
    ) -> list[list[int]]:
        started = self._clock()
        batch = len(sampled_token_ids)
        continued = self._sync_rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        measured = self._observe_step(started, continued, batch)

        drafts: list[list[int]] = [[] for _ in range(batch)]
        decoding = [i for i in range(batch) if self.rows[i] is not None and sampled_token_ids[i]]
        reaches: list[FloatArray] = []
        for i in decoding:
            row = self.rows[i]
            assert row is not None
            self._make_proposal(row, row.draft_room(self.k, self.max_model_len))
            if row.proposal:
                self.stats.proposed_rows += 1
            reaches.append(row.reach(self.acceptance))
        if self.config.pricing != "tpt":  # the ablations: the whole proposal, or nothing
            whole = self.config.pricing == "fixed"
            gammas = [len(r) if whole else 0 for r in reaches]
            tpt = plain = float("nan")
        else:
            gammas, tpt, plain = price_batch(reaches, self.curve)
        for i, gamma in zip(decoding, gammas, strict=True):
            row = self.rows[i]
            assert row is not None
            row.drafted = gamma
            drafts[i] = row.proposal[:gamma]
        # The next step's width is known only when every row decodes (no prefill chunk).
        full = bool(decoding) and len(decoding) == batch
        self._last_width = len(decoding) + sum(gammas) if full else None
        self._last_batch = batch
        self._last_call = started

        stats = self.stats
        stats.calls += 1
        stats.row_steps += len(decoding)
        stats.drafted_rows += sum(1 for g in gammas if g > 0)
        stats.drafted_tokens += sum(gammas)
        stats.propose_seconds += self._clock() - started
        if self._trace is not None:
            self._write_trace(batch, decoding, gammas, tpt, plain, measured)
        return drafts

    def _sync_rows(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
    ) -> bool:
        """Bring every row's index up to its sequence; learn acceptance in hindsight.

        Returns whether the batch is the one the last call drafted for, every row having
        committed tokens since (then the last step's width is known)."""
        batch = len(sampled_token_ids)
        continued = self._last_width is not None and batch == self._last_batch
        for i in range(batch, len(self.rows)):  # rows that left the batch
            self._retire(i)
        del self.rows[batch:]
        self.rows.extend([None] * (batch - len(self.rows)))
        for i, sampled in enumerate(sampled_token_ids):
            committed = [int(t) for t in sampled]
            if not committed:  # prefill chunk or discarded row: nothing decoded
                continued = False
                continue
            length = int(num_tokens_no_spec[i])
            row = self.rows[i]
            if row is not None and row.extends(committed, token_ids_cpu[i], length):
                self._learn(row, committed)
                row.index.extend(committed)
                continue
            continued = False
            self._retire(i)
            sequence = [int(t) for t in token_ids_cpu[i, :length]]
            self.rows[i] = ProposerRow.admit(sequence, self.config.max_ngram, self.max_model_len)
        return continued

    def _learn(self, row: ProposerRow, committed: list[int]) -> None:
        """Hindsight: how much of the last proposal the committed tokens confirm."""
        proposal = row.proposal
        matched = 0
        limit = min(len(proposal), len(committed))
        while matched < limit and proposal[matched] == committed[matched]:
            matched += 1
        rejected = matched < limit
        if proposal:
            self.acceptance.observe(row.bucket, matched, rejected)
        self.stats.accepted_tokens += min(matched, row.drafted)
        row.streak = bool(proposal) and not rejected

    def _make_proposal(self, row: ProposerRow, cap: int) -> None:
        config = self.config
        row.proposal, row.match_length = [], 0
        if cap < 1:
            return
        history: list[LookupIndex] = []
        if config.history_tokens > 0:
            history = [
                *self.history,
                *(r.index for r in self.rows if r is not None and r is not row),
            ]
        tokens, _support, match = row.index.propose(
            cap,
            max_candidates=config.max_candidates,
            max_match=config.max_match,
            history=history,
        )
        row.proposal, row.match_length = tokens, match
        row.bucket = self.acceptance.bucket(match, row.streak)

    def _retire(self, i: int) -> None:
        """Row ``i``'s request left: keep its sequence in the history (if on)."""
        if i >= len(self.rows) or self.rows[i] is None:
            return
        row = self.rows[i]
        self.rows[i] = None
        budget = self.config.history_tokens
        assert row is not None
        if budget <= 0 or not 2 <= len(row.index) <= budget:
            return
        self.history.append(row.index)
        size = sum(len(index) for index in self.history)
        while size > budget:
            size -= len(self.history.popleft())

    # -- step costs ----------------------------------------------------------------------

    def _observe_step(self, now: float, continued: bool, batch: int) -> float | None:
        """Teach the curve the last step's wall time when its width is known."""
        if not continued or self._last_call is None or self._last_width is None or batch == 0:
            return None
        seconds = now - self._last_call
        if not self.curve.observe(self._last_width, seconds):
            return None
        self.stats.timed_steps += 1
        self._observed_since_save += 1
        if self._observed_since_save >= 512:
            self.save_curve()
        return seconds

    def save_curve(self) -> bool:
        """Write the learned step costs to the cache (atomically); whether it was written."""
        self._observed_since_save = 0
        if self._curve_path is None or not self.curve.seconds:
            return False
        return cachefiles.store(self._curve_path, self.curve.to_json(), "vLLM step-cost profile")

    def _describe_curve(self) -> str:
        if not self.curve.seconds:
            where = self._curve_path or "memory only"
            return f"not measured yet (learned online, cached at {where})"
        widths = sorted(self.curve.seconds)
        return f"{len(widths)} widths measured ({widths[0]}..{widths[-1]} tokens)"

    def _write_trace(
        self,
        batch: int,
        decoding: list[int],
        gammas: list[int],
        tpt: float,
        plain: float,
        measured: float | None,
    ) -> None:
        assert self._trace is not None
        rows = []
        for i, gamma in zip(decoding, gammas, strict=True):
            row = self.rows[i]
            assert row is not None
            rows.append(
                {
                    "row": i,
                    "length": len(row.index),
                    "proposed": len(row.proposal),
                    "match": row.match_length,
                    "gamma": gamma,
                }
            )
        record = {
            "call": self.stats.calls,
            "batch": batch,
            "rows": rows,
            "width": self._last_width,
            "tpt": None if math.isnan(tpt) else tpt,
            "plain_tpt": None if math.isnan(plain) else plain,
            "measured_step_s": measured,
            "accepted_total": self.stats.accepted_tokens,
            "drafted_total": self.stats.drafted_tokens,
        }
        self._trace.write(json.dumps(record) + "\n")
        self._trace.flush()


__all__ = [
    "CONFIG_ENV",
    "ENV_PREFIX",
    "KnapspecProposer",
    "ProposerStats",
    "VllmProposerConfig",
    "VllmProposerError",
]
