"""The speculative decoder: settings, components, and ``generate``.

One round of a single sequence (the loop lives in :mod:`knapspec.decoding.run`)::

    plan  = planner.plan(context)                  # mask S and draft length γ
    draft = up to γ tokens with f^(S), stopping when the draft's top-1 prob < τ_conf
    logits = full model on [pending token, drafts]  # one forward, writes all layers
    commit the accepted prefix + one target token; crop every layer's cache

A plan with γ = 0 is a plain autoregressive step. Greedy output equals the target's greedy
output token for token; sampled output is distributed exactly as the target's. Several
prompts at once run in the batch loop, :mod:`knapspec.decoding.continuous` (lookup or
shared sub-network drafts per row, ragged acceptance), which ``generate_batch`` drives
through :mod:`knapspec.decoding.batch`; a single prompt never takes that path. A conversation
(:mod:`knapspec.decoding.conversation`) runs its turns on a decoder's components with
its own KV cache.

Size: over 450 lines because ``generate``'s three typed overloads, ``generate_batch`` and
``conversation`` carry the public API's documentation; the loops live in
:mod:`~knapspec.decoding.run` and :mod:`~knapspec.decoding.continuous`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

import attrs
import torch
from torch import nn

from knapspec.config import DecoderConfig, as_decoder_config, build_components, build_drafters
from knapspec.costmodels.base import CostModel
from knapspec.decoding.arguments import (
    batch_prompts,
    batch_rows_limit,
    check_batch_context,
    is_batch,
    new_token_limit,
    row_seeds,
    sampling_params,
    single_prompt,
    stop_set,
)
from knapspec.decoding.batch import BatchGenerationResult, decode_requests
from knapspec.decoding.continuous import ContinuousBatch, SubnetworkPlanner
from knapspec.decoding.conversation import Conversation
from knapspec.decoding.prefix_cache import PrefixCache
from knapspec.decoding.run import GenerationResult, LogitsProcessor, Run
from knapspec.drafters.base import Drafter
from knapspec.model.engine import ContextLengthError, SublayerEngine
from knapspec.planners.base import Planner, PlanningContext
from knapspec.planners.batch.policy import (
    BatchDraftPolicy,
    BatchPassCalibration,
    BatchSubnetwork,
    CostModelBatchPolicy,
    DraftRealism,
    PlainBatchPolicy,
)
from knapspec.proxies.base import ValueProxy
from knapspec.request import Request
from knapspec.sampling import SamplingParams
from knapspec.window import WindowBuffer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.generation.streamers import BaseStreamer

    from knapspec.model.cache import KVCache
    from knapspec.model.engine import ForwardOutput


class SpeculativeDecoder:
    """Self-speculative decoder over a Hugging Face causal LM.

    Every setting comes from ``config`` (:class:`~knapspec.config.DecoderConfig`, whose
    defaults are the library's); a keyword argument given here overrides its field, and a
    component instance given here replaces the one the config names. Components not
    given are built by :func:`~knapspec.config.build_components`, the one factory, so a
    planner that does not read the reference window gets no cost model or proxy.

    Args:
        model: a loaded model of a supported family (Llama, Mistral, Qwen2, Qwen3,
            Gemma 3) or a :class:`SublayerEngine` wrapping one.
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
        # What batched passes really cost against this cost model's prices, kept across
        # generate_batch calls (it describes the machine, not the prompts).
        self._batch_calibration = BatchPassCalibration()
        self._batch_draft_calibration = BatchPassCalibration()
        # How the chosen lookup drafts delivered against their estimates, kept likewise.
        self._batch_realism = DraftRealism()
        self._calibrated_cost_model = self.cost_model
        #: By registered name, every drafter the planner's plans may name (its
        #: ``plan_drafters()``), built from their ``[drafters.NAME]`` params.
        self.drafters: dict[str, Drafter] = build_drafters(
            self.config,
            self.engine,
            self.planner.plan_drafters(),
            proposers=self.planner.proposal_drafters(),
        )
        #: The prompt-prefix cache (``config.prefix_cache_mib``; None when off, or when
        #: the engine cannot be chunk-invariant and reuse could change the output). With
        #: it, every prefill of this engine is chunk-invariant: a cold one and one resumed
        #: from a cached prefix then compute the same bits.
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.config.prefix_cache_mib)
            if self.config.prefix_cache_mib > 0 and self.engine.enable_chunk_invariance()
            else None
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

    @property
    def lock(self) -> threading.Lock:
        """Held while a call uses this decoder's planner, drafters and caches (every
        ``generate`` and each :class:`Conversation` turn): calls run one at a time."""
        return self._lock

    def conversation(
        self, tokenizer: PreTrainedTokenizerBase | None = None, *, system: str | None = None
    ) -> Conversation:
        """A new :class:`~knapspec.decoding.conversation.Conversation` on this decoder:
        a chat whose turns keep the KV cache and lookup index of the earlier ones, so that
        each turn prefills only its new tokens.

        Args:
            tokenizer: renders the turns with its chat template (:meth:`Conversation.send`);
                None allows only token ids (:meth:`Conversation.generate`).
            system: an optional system message.
        """
        return Conversation(self, tokenizer, system=system)

    def clear_history(self) -> None:
        """Forget what earlier calls left to draft from (the lookup drafter's history,
        ``drafters.lookup.history_tokens``): the next call drafts as a first call would."""
        with self._lock:
            for drafter in self.drafters.values():
                drafter.clear_history()

    # ------------------------------------------------------------------ API
    @overload
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        attention_mask: None = None,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        input_ids: Sequence[Sequence[int] | torch.Tensor],
        *,
        attention_mask: None = None,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> BatchGenerationResult: ...

    @overload
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> BatchGenerationResult: ...

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int] | torch.Tensor],
        *,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> GenerationResult | BatchGenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids``.

        Args:
            input_ids: ``(n,)`` or ``(1, n)`` prompt token ids; or a batch (then the result
                is a :class:`BatchGenerationResult`, see :meth:`generate_batch`): a
                ``(B, n)`` tensor with ``attention_mask``, or a list of token sequences.
            attention_mask: ``(B, n)``, 1 for tokens and 0 for left padding: marks
                ``input_ids`` as a batch.
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
            ValueError: a ``(B, n)`` tensor with ``B > 1`` and no ``attention_mask``, empty
                prompt, ``max_new_tokens < 1``; streamer or logits processor with a batch.
            ContextLengthError: prompt + ``max_new_tokens`` exceeds the model's context.
            NonFiniteLogitsError: the model produced NaN/inf logits.
        """
        if attention_mask is not None or is_batch(input_ids):
            if streamer is not None or logits_processor is not None:
                raise ValueError(
                    "streamer and logits_processor are not supported for a batch; decode "
                    "one prompt at a time to use them"
                )
            return self.generate_batch(
                input_ids,  # type: ignore[arg-type]
                attention_mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                sampling=sampling,
            )
        request = Request(
            single_prompt(input_ids, self.engine),  # type: ignore[arg-type]
            max_new_tokens,
            self.sampling if sampling is None else sampling,
            eos_token_id,
            streamer=streamer,
            logits_processor=logits_processor,
        )
        self.engine.check_context(request.prompt_tokens + request.max_new_tokens)
        with self._lock:
            return self._generate(request)

    @torch.inference_mode()
    def generate_batch(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        seeds: Sequence[int] | None = None,
        policy: BatchDraftPolicy | None = None,
        max_batch_rows: int | None = None,
    ) -> BatchGenerationResult:
        """Generate for several prompts at once (:mod:`knapspec.decoding.batch`).

        Each row drafts its own lookup tokens or the batch's shared layer-skipping
        sub-network (0 allowed) and keeps exactly its accepted ones; rows that stop leave
        the batch's compute. Greedy rows equal each prompt decoded alone. The sub-network
        is the one the planner chooses on the first row after its prefill; the batch
        policy prices it against lookup drafts and γ = 0 every round.

        Args:
            input_ids: a ``(B, n)`` tensor (left-padded when ``attention_mask`` has zeros)
                or a list of ``B`` token sequences of any lengths.
            attention_mask: ``(B, n)``, 1 for tokens and 0 for left padding (tensor input
                only; None: no padding).
            max_new_tokens, eos_token_id, sampling: as :meth:`generate`, for every row.
            seeds: per row, its sampling seed (default: ``sampling.seed + row``, or a
                fresh seed per row from torch's global RNG when no seed is set). A row
                gives the tokens its prompt gives alone with ``sampling.seed`` = its seed.
            policy: each row's draft length and drafter per round (default: the batch
                TPT search :class:`~knapspec.planners.batch.policy.CostModelBatchPolicy`
                when a cost model exists, over lookup drafts if the planner prices them
                and its sub-network if it chose one; else plain batched decoding).
            max_batch_rows: rows decoded at once (None: every prompt). With fewer, the
                other prompts wait in order and each finished row's slot goes to the next
                (continuous batching); results stay in input order.

        Raises:
            ValueError: naming the row: mask shape, right padding, an empty row, ids out
                of range; ``max_new_tokens < 1``, ``max_batch_rows < 1``.
            ContextLengthError: naming the row whose prompt + ``max_new_tokens`` is too long.
        """
        prompts = batch_prompts(input_ids, attention_mask, self.engine.vocab_size)
        max_new_tokens = new_token_limit(max_new_tokens)
        slots = batch_rows_limit(max_batch_rows)
        check_batch_context(prompts, max_new_tokens, self.engine.max_context)
        params = sampling_params(sampling) if sampling is not None else self.sampling
        stop_ids = stop_set(eos_token_id)
        requests = [
            Request(prompt, max_new_tokens, params, stop_ids, seed=seed)
            for prompt, seed in zip(prompts, row_seeds(params, len(prompts), seeds), strict=True)
        ]
        if policy is None:
            policy = self._default_batch_policy()
        with self._lock:
            return decode_requests(
                self.engine,
                self._cache,
                requests,
                policy=policy,
                max_draft_length=self.max_draft_length,
                drafters=self.drafters,
                proposers=self.planner.proposal_drafters(),
                plan_subnetwork=self._batch_subnetwork_planner(params, max_new_tokens),
                capture_points=self.planner.uses_window,
                slots=slots,
                prefix_cache=self.prefix_cache,
            )

    def continuous_batch(self, lanes: int, capacity: int) -> ContinuousBatch:
        """A :class:`~knapspec.decoding.continuous.ContinuousBatch` on this decoder: rows
        added and cancelled between rounds by one owner (a server's scheduler), each with
        its own limit, stop ids and sampling, decoded by the batch loop that
        :meth:`generate_batch` drives too (the same policy, drafters and prefix cache). Its
        lanes are reused (a lane's drafters keep their history across requests), a row
        whose logits are not finite fails alone, and the sub-network is planned once, on
        the first row admitted.

        Args:
            lanes: rows decoded at once.
            capacity: tokens per row (prompt + new tokens + draft room), capped by the
                model's context; the batch K/V cache holds ``lanes × capacity`` tokens.
        """
        return ContinuousBatch(
            self.engine,
            self._cache,
            lanes=lanes,
            capacity=capacity,
            policy=self._default_batch_policy(),
            max_draft_length=self.max_draft_length,
            drafters=self.drafters,
            proposers=sorted(self.planner.proposal_drafters()),
            plan_subnetwork=self._batch_subnetwork_planner(self.sampling, capacity),
            capture_points=self.planner.uses_window,
            prefix_cache=self.prefix_cache,
            lock=self._lock,
        )

    def _default_batch_policy(self) -> BatchDraftPolicy:
        """The batch TPT search over this decoder's cost model (lookup drafts if the
        planner prices them, its sub-network if it chose one), or plain batched decoding
        when there is no cost model. Its calibration of batched passes is kept across
        calls (it describes the machine), until the cost model changes."""
        if self._calibrated_cost_model is not self.cost_model:  # a new cost model: new prices
            self._batch_calibration = BatchPassCalibration()
            self._batch_draft_calibration = BatchPassCalibration()
            self._calibrated_cost_model = self.cost_model
        if self.cost_model is None:
            return PlainBatchPolicy()
        return CostModelBatchPolicy(
            self.cost_model,
            self.max_draft_length,
            calibration=self._batch_calibration,
            draft_calibration=self._batch_draft_calibration,
            lookup=bool(self.planner.proposal_drafters()),
            realism=self._batch_realism,
        )

    def _batch_subnetwork_planner(
        self, params: SamplingParams, max_new_tokens: int
    ) -> SubnetworkPlanner:
        """What a batch asks the planner after its first row's prefill: the drafter and
        mask it would draft that row with, when that drafter drafts a batch's rows
        together (None when it plans γ = 0 or a drafter that drafts row by row). The
        planner's single-sequence state is reset first, as every ``generate`` does."""

        def plan(
            prompt: torch.Tensor, cache: KVCache, out: ForwardOutput
        ) -> BatchSubnetwork | None:
            planner, window = self.planner, self._window
            window.clear()
            planner.reset()
            n = prompt.numel()
            if out.points is not None:
                seed = out.points.shape[1]  # the prefill kept the last ``seed`` tokens
                target = self.engine.logits(out.hidden[-seed:]).argmax(-1)
                window.push(out.points, prompt[-seed:].to(self.engine.device), target, n - seed)
            decision = planner.plan(
                PlanningContext(
                    engine=self.engine,
                    cache=cache,
                    context_length=n,
                    window=window if planner.uses_window else None,
                    cost_model=self.cost_model,
                    proxy=self.proxy,
                    max_draft_length=self.max_draft_length,
                    sampling=params,
                    round_index=0,
                    remaining_tokens=max_new_tokens,
                    tokens=prompt,
                    proposals=(),
                )
            )
            drafter = self.drafters.get(decision.drafter)
            if drafter is None or not drafter.drafts_rows_together or not decision.draft_length:
                return None
            prior = decision.predicted_acceptance
            prior = 0.5 if prior is None else min(max(prior, 0.01), 0.99)
            return BatchSubnetwork(
                decision.mask, prior, source=decision.source, drafter=decision.drafter
            )

        return plan

    def _generate(self, request: Request) -> GenerationResult:
        prefixes = self.prefix_cache
        prompt = request.prompt
        reused = prefixes.restore(prompt, self._cache) if prefixes is not None else 0
        # Unseeded: a fresh seed from torch's global RNG (torch.manual_seed repeats it).
        run = Run(self, self._cache, self._window, request, reused_tokens=reused)
        result = run.execute()
        if prefixes is not None:
            # Every committed token whose K/V the cache holds (all but perhaps the last).
            sequence = result.sequences[0]
            prefixes.store(sequence, self._cache, min(self._cache.seq_length, sequence.numel()))
        return result


__all__ = ["ContextLengthError", "Conversation", "GenerationResult", "SpeculativeDecoder"]
