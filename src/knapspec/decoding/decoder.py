"""The speculative decoding loop: plan, draft with a sub-network, verify, commit.

One round (batch size 1)::

    plan  = planner.plan(context)                  # mask S and draft length γ
    draft = up to γ tokens with f^(S), stopping when the draft's top-1 prob < τ_conf
    logits = full model on [pending token, drafts]  # one forward, writes all layers
    commit the accepted prefix + one target token; crop every layer's cache

A plan with γ = 0 is a plain autoregressive step. Greedy output equals the target's greedy
output token for token; sampled output is distributed exactly as the target's.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from knapspec.config import DecoderConfig, as_decoder_config, build_components, build_drafters
from knapspec.costmodels.base import CostModel, LatencyObservation
from knapspec.decoding.stats import GenerationStats, PlanRecord
from knapspec.decoding.verify import check_finite, verify_greedy, verify_sampling
from knapspec.drafters.base import NO_DRAFT, SUBNETWORK, Draft, Drafter, Verification
from knapspec.drafters.subnetwork import SubnetworkDrafter
from knapspec.model.engine import ContextLengthError, SublayerEngine
from knapspec.planners.base import Planner, PlanningContext
from knapspec.proxies.base import ValueProxy
from knapspec.sampling import SamplingParams, processed_probs, sample_token
from knapspec.types import DraftPlan, StepOutcome, SublayerMask
from knapspec.window import WindowBuffer

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer


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


#: ``(input_ids (1, t), scores (1, vocab)) -> scores``: a transformers ``LogitsProcessorList``
#: or any callable of that shape.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Prompt tokens whose hidden states seed the reference window after prefill, so the first
#: plan can be made right away instead of after several full-model rounds.
PREFILL_WINDOW_TOKENS = 8


class SpeculativeDecoder:
    """Self-speculative decoder over a Hugging Face causal LM.

    Every setting comes from ``config`` (:class:`~knapspec.config.DecoderConfig`, whose
    defaults are the library's); a keyword argument given here overrides its field, and a
    component instance given here replaces the one the config names. Components not
    given are built by :func:`~knapspec.config.build_components`, the one factory, so a
    planner that does not read the reference window gets no cost model or proxy.

    Args:
        model: a loaded model of a supported family (Llama, Mistral, Qwen2, Qwen3) or a
            :class:`SublayerEngine` wrapping one.
        config: a :class:`~knapspec.config.DecoderConfig`, its dict form, or a TOML / JSON
            file path (None: the defaults: the ``knapsack`` planner, the ``online`` cost
            model seeded by a cached or quick profile of this machine, the
            ``montecarlo`` proxy).
        planner: chooses the draft mask and γ each round (replaces ``config.planner``).
        cost_model: latency predictions (replaces ``config.cost_model``).
        proxy: value proxy for the planner (replaces ``config.proxy``).
        max_draft_length: D, the largest γ (>= 1).
        window_rounds: m, rounds of committed tokens kept in the reference window (>= 1).
        window_max_tokens: upper bound on the window's token count (>= 1).
        confidence_threshold: τ_conf in [0, 1]; drafting stops when the draft's top-1
            probability falls below it (the plan's γ is the cap). 0 disables early exit.
        sampling: default sampling parameters (greedy by default).

    Attributes:
        config: the effective configuration (``config`` with the keyword overrides).

    Thread safety: a decoder holds one KV cache and one reference window, so calls to
    :meth:`generate` on the same decoder are serialised by a lock (a second thread waits
    for the first call to finish). To serve several requests at once, build one decoder
    per thread (they may share the model: ``SpeculativeDecoder(model)`` copies no weights).

    Raises:
        ValueError: a setting out of range (the message names it).
    """

    def __init__(
        self,
        model: nn.Module | SublayerEngine,
        config: DecoderConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        *,
        planner: Planner | None = None,
        cost_model: CostModel | None = None,
        proxy: ValueProxy | None = None,
        max_draft_length: int | None = None,
        window_rounds: int | None = None,
        window_max_tokens: int | None = None,
        confidence_threshold: float | None = None,
        sampling: SamplingParams | None = None,
    ) -> None:
        overrides: dict[str, Any] = {
            name: value
            for name, value in (
                ("max_draft_length", max_draft_length),
                ("window_rounds", window_rounds),
                ("window_max_tokens", window_max_tokens),
                ("confidence_threshold", confidence_threshold),
                ("sampling", sampling),
            )
            if value is not None
        }
        settings = as_decoder_config(config)
        self.config = attrs.evolve(settings, **overrides) if overrides else settings
        self.engine = model if isinstance(model, SublayerEngine) else SublayerEngine(model)
        self.planner, self.cost_model, self.proxy = build_components(
            self.config, self.engine, planner=planner, cost_model=cost_model, proxy=proxy
        )
        self.max_draft_length = self.config.max_draft_length
        self.confidence_threshold = self.config.confidence_threshold
        self.sampling = self.config.sampling
        self._window = WindowBuffer(self.config.window_rounds, self.config.window_max_tokens)
        self._cache = self.engine.new_cache(256)
        self._subnetwork = SubnetworkDrafter()
        #: The drafters whose proposals the planner reads before planning (its
        #: ``proposal_drafters()``), built from their ``[drafters.NAME]`` params.
        self.drafters: list[Drafter] = build_drafters(
            self.config, self.engine, self.planner.proposal_drafters()
        )
        # generate() uses the cache and window above: one call at a time.
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        model: nn.Module | SublayerEngine,
        config: DecoderConfig | Mapping[str, Any] | str | os.PathLike[str],
    ) -> SpeculativeDecoder:
        """Build every component from a :class:`~knapspec.config.DecoderConfig`, its dict
        form or a TOML / JSON file path (the same as ``SpeculativeDecoder(model, config)``).
        """
        return cls(model, config)

    # ------------------------------------------------------------------ API
    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids``.

        Args:
            input_ids: ``(n,)`` or ``(1, n)`` prompt token ids (batch size 1).
            max_new_tokens: an integer >= 1 (numpy integers too).
            eos_token_id: token id(s) that end generation (included in the output): an
                integer (numpy integers too), a sequence of them or a tensor.
            sampling: overrides the decoder's sampling parameters for this call: a
                :class:`SamplingParams` or its fields as a dict
                (``{"do_sample": True, "temperature": 0.7}``).
            streamer: a transformers ``BaseStreamer``; receives the prompt, then every
                committed token in order, then ``end()``.
            logits_processor: applied to the draft's and the target's logits alike before
                argmax / sampling (a transformers ``LogitsProcessorList``, e.g. a
                repetition penalty). At each position it sees the prompt, the committed
                tokens and the drafts before that position, so greedy output stays the
                target's processed greedy output and sampling stays lossless. None (the
                default) costs nothing.

        Thread safety: calls on one decoder run one at a time (see the class docstring).

        Raises:
            TypeError: an argument of the wrong type (the message names it).
            ValueError: batch > 1, empty prompt, ``max_new_tokens < 1``.
            ContextLengthError: prompt + ``max_new_tokens`` exceeds the model's context.
            NonFiniteLogitsError: the model produced NaN/inf logits.
        """
        prompt = self._validate_prompt(input_ids)
        if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
            raise TypeError(
                f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__} "
                f"{max_new_tokens!r}"
            )
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.engine.check_context(prompt.numel() + max_new_tokens)
        params = _sampling_params(sampling) if sampling is not None else self.sampling
        stop_ids = _stop_set(eos_token_id)
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError(
                "logits_processor must be a callable (input_ids, scores) -> scores, such as a "
                f"transformers LogitsProcessorList; got {type(logits_processor).__name__}"
            )
        with self._lock:
            return self._generate(
                prompt, max_new_tokens, stop_ids, params, streamer, logits_processor
            )

    def _generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        params: SamplingParams,
        streamer: BaseStreamer | None,
        logits_processor: LogitsProcessor | None,
    ) -> GenerationResult:
        generator = None
        if params.do_sample:
            generator = torch.Generator(device=self.engine.device)
            # No seed: draw one from torch's global RNG, so that torch.manual_seed(s) makes
            # the call reproducible, as model.generate's sampling is.
            seed = params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
            generator.manual_seed(seed)
        run = _Run(
            self, prompt, max_new_tokens, stop_ids, params, generator, streamer, logits_processor
        )
        return run.execute()

    def _validate_prompt(self, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(
                    f"batch size {ids.shape[0]} is not supported: SpeculativeDecoder decodes one "
                    f"sequence at a time (pass input_ids of shape (1, n))"
                )
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"input_ids must have shape (n,) or (1, n), got {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.engine.vocab_size:
            raise ValueError(
                f"token ids must be in [0, {self.engine.vocab_size}); got out-of-range ids"
            )
        return ids.to(device=self.engine.device, dtype=torch.long)


def _sampling_params(sampling: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    """``sampling`` as :class:`SamplingParams` (a dict gives its fields)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        fields = {field.name for field in attrs.fields(SamplingParams)}
        unknown = sorted(str(key) for key in sampling if key not in fields)
        if unknown:
            raise TypeError(
                f"sampling: unknown field(s) {', '.join(unknown)}; valid: {', '.join(fields)}"
            )
        return SamplingParams(**sampling)
    raise TypeError(
        f"sampling must be a SamplingParams or a dict of its fields, got {type(sampling).__name__}"
    )


def _stop_set(eos_token_id: int | Sequence[int] | torch.Tensor | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        values: list[Any] = eos_token_id.flatten().tolist()
    elif isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, Sequence):
        values = [eos_token_id]
    else:
        values = list(eos_token_id)
    for value in values:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(
                f"eos_token_id must be a token id (an integer), a sequence of them or a "
                f"tensor; got {type(value).__name__} {value!r}"
            )
    return frozenset(int(value) for value in values)


class _Run:
    """State of one ``generate`` call. Everything is reset per call, so an exception
    mid-generation leaves the decoder usable."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        prompt: torch.Tensor,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        streamer: BaseStreamer | None,
        logits_processor: LogitsProcessor | None = None,
    ) -> None:
        self.decoder = decoder
        self.logits_processor = logits_processor
        self.engine = decoder.engine
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.params = params
        self.generator = generator
        self.streamer = streamer
        self.stats = GenerationStats(prompt_tokens=prompt.numel())
        self.output: list[int] = []
        self.cache = decoder._cache
        self.uses_window = decoder.planner.uses_window
        self.proposal_names = decoder.planner.proposal_drafters()
        self.synchronize = self.engine.device.type == "cuda"

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

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Pick a token from ``logits (vocab,)``: argmax, or a sample from the processed p."""
        if not self.params.do_sample:
            return int(logits.argmax()), None
        probs = processed_probs(logits, self.params)
        return sample_token(probs, self.generator), probs

    def execute(self) -> GenerationResult:
        decoder, engine, cache, stats = self.decoder, self.engine, self.cache, self.stats
        start_time = self._now()
        cache.reset()
        decoder._window.clear()
        decoder.planner.reset()
        if self.streamer is not None:
            self.streamer.put(  # type: ignore[no-untyped-call]
                self.prompt.unsqueeze(0).cpu()
            )
        n = self.prompt.numel()
        cache.reserve(n + self.max_new_tokens + decoder.max_draft_length + 1)
        # The prompt and committed tokens, for planners that read the token ids.
        self.sequence = torch.empty(n + self.max_new_tokens, dtype=torch.long)
        self.sequence[:n] = self.prompt.cpu()

        capture = self._wants_window()
        seed = min(PREFILL_WINDOW_TOKENS, n) if capture else None
        out = engine.forward(
            self.prompt,
            0,
            cache,
            all_logits=False,
            capture_points=capture,
            capture_last=seed,
        )
        check_finite(out.logits, "prefill")
        if out.points is not None and seed:
            # Target tokens for the seed: the model's argmax after each seed token.
            seed_logits = engine.logits(out.hidden[-seed:])
            decoder._window.push(out.points, self.prompt[-seed:], seed_logits.argmax(-1), n - seed)
        pending, _ = self._choose(self._process(out.logits[-1:], [])[0])
        stats.prefill_time_s = self._now() - start_time
        self._commit([pending])

        round_index = 0
        last_plan: DraftPlan | None = None
        proposers = [d for d in decoder.drafters if d.registered_name in self.proposal_names]
        for drafter in proposers:
            drafter.reset(self.sequence[: n + 1].tolist())
        while not self._finished():
            plan_start = self._now()
            room = min(
                decoder.max_draft_length,
                self.max_new_tokens - len(self.output) - 1,
                engine.max_context - n - 1,
            )
            proposals = self._propose(proposers, max(0, room))
            context = PlanningContext(
                engine=engine,
                cache=cache,
                context_length=n,
                window=decoder._window if self.uses_window else None,
                cost_model=decoder.cost_model,
                proxy=decoder.proxy,
                max_draft_length=decoder.max_draft_length,
                sampling=self.params,
                round_index=round_index,
                remaining_tokens=self.max_new_tokens - len(self.output),
                tokens=self.sequence[: self.prompt.numel() + len(self.output)],
                proposals=proposals,
            )
            plan = decoder.planner.plan(context)
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
                inputs = torch.tensor([pending, *draft.tokens[:accepted]], device=engine.device)
                decoder._window.push(
                    verification.points[:, : accepted + 1],
                    inputs,
                    verification.target_next[: accepted + 1],
                    n,
                )
            n += accepted + 1
            committed = self._commit(verification.tokens)
            drafter_name = draft.drafter if draft.tokens else "none"
            stats.record_round(
                len(draft), accepted, committed, drafter_name, plan.predicted_acceptance
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
            decoder.planner.update(outcome)
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
        return self.decoder.planner.wants_window(self.sequence[:committed])

    def _finished(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            self.stats.stop_reason = self.stats.stop_reason or "max_new_tokens"
            return True
        return bool(self.stats.stop_reason)

    def _commit(self, tokens: list[int]) -> int:
        """Append tokens up to the limit / first stop token; stream them. Returns the count."""
        room = self.max_new_tokens - len(self.output)
        kept: list[int] = []
        for token in tokens[:room]:
            kept.append(token)
            if token in self.stop_ids:
                self.stats.stop_reason = "eos"
                break
        start = self.prompt.numel() + len(self.output)
        self.sequence[start : start + len(kept)] = torch.tensor(kept, dtype=torch.long)
        self.output.extend(kept)
        if self.streamer is not None and kept:
            self.streamer.put(torch.tensor(kept, dtype=torch.long))  # type: ignore[no-untyped-call]
        return len(kept)

    def _propose(self, proposers: list[Drafter], room: int) -> tuple[Draft, ...]:
        """This round's proposals by the drafters the planner prices before planning."""
        if not proposers:
            return ()
        started = self._now()
        proposals = tuple(
            drafter.propose(room)  # type: ignore[attr-defined]
            for drafter in proposers
        )
        self.stats.lookup_time_s += self._now() - started
        return proposals

    def _draft(
        self, plan: DraftPlan, proposals: tuple[Draft, ...], pending: int, n: int, budget: int
    ) -> Draft:
        """The plan's draft of up to ``budget`` tokens after ``pending`` (at position ``n``):
        the chosen proposal cut to ``budget``, or the sub-network run under the plan's mask."""
        if budget == 0:
            return _NO_DRAFT
        if plan.drafter != SUBNETWORK:
            for proposal in proposals:
                if proposal.drafter == plan.drafter:
                    return proposal.truncated(budget)
            raise RuntimeError(
                f"the planner chose drafter {plan.drafter!r}, which proposed nothing this "
                f"round (proposals: {[p.drafter for p in proposals]})"
            )
        draft = self.decoder._subnetwork.propose(
            self.engine,
            self.cache,
            plan.mask,
            pending,
            n,
            budget,
            lambda logits, drafted: self._choose(self._process(logits[None], drafted)[0]),
            confidence_threshold=self.decoder.confidence_threshold,
            cost_model=self.decoder.cost_model,
            clock=self._now,
        )
        self.stats.draft_time_s += draft.seconds
        return draft

    def _verify(self, pending: int, draft: Draft, n: int, capture: bool) -> Verification:
        """One full forward over ``[pending, *draft]`` and the acceptance test; with
        ``capture``, also the window data."""
        engine = self.engine
        verify_start = self._now()
        inputs = torch.tensor([pending, *draft.tokens], device=engine.device)
        out = engine.forward(inputs, n, self.cache, capture_points=capture)
        check_finite(out.logits, "verification")
        target_next = out.logits.argmax(dim=-1) if capture else None
        drafts = list(draft.tokens)
        scores = self._process(out.logits, drafts)
        if self.params.do_sample:
            target_probs = processed_probs(scores, self.params)
            draft_probs = draft.draft_probs(target_probs.shape[-1], target_probs.device)
            verdict = verify_sampling(drafts, draft_probs, target_probs, self.generator)
        else:
            verdict = verify_greedy(drafts, scores)
        elapsed = self._now() - verify_start
        self.stats.verify_time_s += elapsed
        if self.decoder.cost_model is not None:
            self.decoder.cost_model.observe(
                LatencyObservation("verify", n, elapsed, len(drafts) + 1)
            )
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


__all__ = ["ContextLengthError", "GenerationResult", "SpeculativeDecoder"]
