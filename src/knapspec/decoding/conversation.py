"""Conversations: a chat whose turns reuse the KV cache and lookup index of the earlier ones.

A :class:`Conversation` (from :meth:`SpeculativeDecoder.conversation
<knapspec.decoding.decoder.SpeculativeDecoder.conversation>`) owns a KV cache and the
lookup drafters' index for the tokens of the conversation so far. Each turn renders the
whole conversation with the tokenizer's chat template (as ``apply_chat_template`` with
``add_generation_prompt=True``), tokenizes it, and compares it with the tokens the cache
holds: the longest common prefix is reused and only the rest is prefilled. When the
template re-renders an earlier turn differently (a template that drops earlier reasoning,
a reply that tokenizes differently once decoded to text) the prefix is shorter and the
tail is prefilled again; :attr:`ConversationTurn.dropped_tokens` says how many cached
tokens that discarded.

A conversation makes its engine's prefills chunk-invariant
(:meth:`~knapspec.model.engine.SublayerEngine.enable_chunk_invariance`): a token's K/V and
logits then depend only on the tokens up to it, however the sequence was split into calls,
so each turn's greedy output equals a cold ``generate`` on the whole conversation (by the
same decoder), token for token.

Misuse raises and loses nothing: a conversation in use by another thread raises
:class:`ConversationBusyError`; a decoder over another engine raises
:class:`ConversationError`; a turn that would exceed the context raises
:class:`~knapspec.model.engine.ContextLengthError` before anything changes. Any other
error mid-turn leaves the conversation as it was before the turn; an interrupt
(``KeyboardInterrupt``, Ctrl-C) keeps the tokens committed so far as the reply.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from knapspec.decoding.arguments import single_prompt
from knapspec.decoding.run import GenerationResult, LogitsProcessor, Run
from knapspec.request import Request
from knapspec.window import WindowBuffer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from transformers.generation.streamers import BaseStreamer

    from knapspec.config import DecoderConfig
    from knapspec.costmodels.base import CostModel
    from knapspec.drafters.base import Drafter
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import Planner
    from knapspec.proxies.base import ValueProxy
    from knapspec.sampling import SamplingParams

Message = dict[str, Any]


class SpeculativeDecoder(Protocol):
    """What a conversation uses of :class:`~knapspec.decoding.decoder.SpeculativeDecoder`
    (named here so that this module does not import the decoder, which imports it)."""

    config: DecoderConfig
    engine: SublayerEngine
    planner: Planner
    drafters: dict[str, Drafter]
    cost_model: CostModel | None
    proxy: ValueProxy | None
    max_draft_length: int
    confidence_threshold: float
    sampling: SamplingParams

    @property
    def lock(self) -> threading.Lock: ...


class ConversationError(RuntimeError):
    """A conversation used in a way it cannot serve (another model's decoder)."""


class ConversationBusyError(ConversationError):
    """A conversation used by a second thread while a turn is running."""


@attrs.frozen
class ConversationTurn:
    """One turn of a :class:`Conversation`.

    Attributes:
        result: the call's tokens ``(new,)``, its ``(1, prompt + new)`` sequences and
            stats (``stats.cached_prompt_tokens``: prompt tokens reused from the cache;
            ``stats.prefill_time_s``: time to the first token).
        text: the reply decoded (skipping special tokens); "" without a tokenizer.
        dropped_tokens: cached tokens past the reused prefix, discarded: the new prompt
            differs there (its chat template rendered an earlier turn differently), or it
            ends there (its last token is always run, for its logits).
    """

    result: GenerationResult
    text: str = ""
    dropped_tokens: int = 0

    @property
    def tokens(self) -> torch.Tensor:
        return self.result.tokens


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    size = min(a.numel(), b.numel())
    if size == 0:
        return 0
    differ = (a[:size].cpu() != b[:size].cpu()).nonzero()
    return int(differ[0, 0]) if differ.numel() else size


class Conversation:
    """A multi-turn chat on one decoder that keeps its KV cache between turns.

    Args:
        decoder: the decoder whose model, planner and drafters run the turns (its
            per-call lock is held during each turn).
        tokenizer: a tokenizer with a chat template, for :meth:`send` with text or
            messages; None allows only :meth:`generate` with token ids.
        system: an optional system message that opens the conversation.

    Attributes:
        messages: the conversation so far (``{"role": ..., "content": ...}`` dicts).

    Thread safety: one turn at a time; a second thread gets :class:`ConversationBusyError`
    at once rather than waiting (a conversation has one history: two threads would race
    on which reply comes first).
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        system: str | None = None,
    ) -> None:
        self._decoder = decoder
        self._engine = decoder.engine
        # Turns prefill only their new tokens: chunk-invariant prefills make that bitwise a
        # cold prefill of the whole conversation (on this engine, from now on).
        self._engine.enable_chunk_invariance()
        self.tokenizer = tokenizer
        self.messages: list[Message] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self._cache = decoder.engine.new_cache(256)
        self._window = WindowBuffer(decoder.config.window_rounds, decoder.config.window_max_tokens)
        # The conversation's tokens (prompts and replies as the model saw them); the cache
        # holds the K/V of the first ``_cached`` of them, the proposers saw ``_indexed``.
        self._tokens = torch.empty(0, dtype=torch.long)
        self._cached = 0
        self._indexed = 0
        self._proposers: list[Drafter] = []
        self._proposer_names: tuple[str, ...] = ()
        self._busy = threading.Lock()
        self._partial: list[int] = []  # the reply an interrupted turn committed

    # ------------------------------------------------------------ properties
    @property
    def decoder(self) -> SpeculativeDecoder:
        return self._decoder

    @decoder.setter
    def decoder(self, other: SpeculativeDecoder) -> None:
        """Move the conversation to another decoder over the same engine (its cache is
        that engine's); another engine raises :class:`ConversationError`."""
        with self._turn():
            self._check_engine(other)
            self._decoder = other
            self._proposer_names = ()  # its drafters may differ: rebuild them

    @property
    def tokens(self) -> torch.Tensor:
        """``(t,)`` the conversation's tokens so far, as the model saw them."""
        return self._tokens.clone()

    @property
    def cached_tokens(self) -> int:
        """How many of :attr:`tokens` have their K/V in the conversation's cache."""
        return self._cached

    def cache_bytes(self) -> int:
        """Memory held by the conversation's KV cache buffers."""
        return self._cache.memory_bytes()

    # ------------------------------------------------------------------ turns
    def add_turn(self, role: str, content: str) -> None:
        """Append a message without generating (a reply written by hand, a tool result);
        the next turn prefills it."""
        with self._turn():
            self.messages.append({"role": role, "content": content})

    def send(
        self,
        message: str | Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> ConversationTurn:
        """Add a user message (a string, one message dict or a list of them) and generate
        the assistant's reply, which joins :attr:`messages`.

        Args:
            message: the user's text, or messages to append before the reply.
            eos_token_id: stop tokens (None: the tokenizer's EOS token).
            max_new_tokens, sampling, streamer, logits_processor: as
                :meth:`SpeculativeDecoder.generate`.

        Raises:
            ValueError: no tokenizer, or one without a chat template.
            ContextLengthError: the conversation + ``max_new_tokens`` exceeds the context
                (the conversation is unchanged).
            ConversationBusyError, ConversationError: see the class docstring.
        """
        tokenizer = self._chat_tokenizer()
        if isinstance(message, str):
            added: list[Message] = [{"role": "user", "content": message}]
        elif isinstance(message, Mapping):
            added = [dict(message)]
        else:
            added = [dict(m) for m in message]
        with self._turn():
            messages = [*self.messages, *added]
            text = str(
                tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if eos_token_id is None:
                eos_token_id = tokenizer.eos_token_id
            try:
                turn = self._run(
                    self._request(
                        ids, max_new_tokens, eos_token_id, sampling, streamer, logits_processor
                    )
                )
            except KeyboardInterrupt:
                # The tokens committed before the interrupt stay as the reply.
                if self._partial:
                    reply = str(tokenizer.decode(self._partial, skip_special_tokens=True))
                    self.messages = [*messages, {"role": "assistant", "content": reply}]
                raise
            reply = str(tokenizer.decode(turn.result.tokens.tolist(), skip_special_tokens=True))
            self.messages = [*messages, {"role": "assistant", "content": reply}]
            return attrs.evolve(turn, text=reply)

    def generate(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        streamer: BaseStreamer | None = None,
        logits_processor: LogitsProcessor | None = None,
    ) -> ConversationTurn:
        """Generate after ``input_ids``, the *whole* conversation so far as token ids
        (``(n,)``, ``(1, n)`` or a list), reusing the cache for its longest common prefix
        with :attr:`tokens`: what ``model.generate(ids, past_key_values=cache)`` does in
        transformers. :attr:`messages` is not touched.

        Raises: as :meth:`send`.
        """
        with self._turn():
            return self._run(
                self._request(
                    input_ids, max_new_tokens, eos_token_id, sampling, streamer, logits_processor
                )
            )

    def reset(self) -> None:
        """Forget the conversation (the system message stays); the cache's buffers are
        kept for the next one."""
        with self._turn():
            self.messages = [m for m in self.messages[:1] if m.get("role") == "system"]
            self._tokens = torch.empty(0, dtype=torch.long)
            self._cached = self._indexed = 0
            self._cache.reset()

    # -------------------------------------------------------------- internals
    def _turn(self) -> _Exclusive:
        return _Exclusive(self._busy)

    def _chat_tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(
                "this conversation has no tokenizer: pass one to decoder.conversation("
                "tokenizer) to send text, or call generate() with token ids"
            )
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template: a conversation renders its turns with "
                "it; call generate() with token ids you render yourself"
            )
        return tokenizer

    def _check_engine(self, decoder: SpeculativeDecoder) -> None:
        if decoder.engine is not self._engine:
            raise ConversationError(
                f"this conversation's KV cache belongs to the engine of "
                f"{self._engine.model_name!r}; the decoder runs "
                f"{decoder.engine.model_name!r} (another engine): start a new conversation "
                "with that decoder's conversation()"
            )

    def _proposers_for(self, decoder: SpeculativeDecoder) -> list[Drafter]:
        """The conversation's own copies of the drafters that propose before planning
        (their index follows the conversation, not the decoder's last call)."""
        names = tuple(sorted(decoder.planner.proposal_drafters()))
        if names != self._proposer_names:
            self._proposers = [decoder.drafters[name].for_row(decoder.engine) for name in names]
            self._proposer_names = names
            self._indexed = 0
        return self._proposers

    def _request(
        self,
        input_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        sampling: SamplingParams | Mapping[str, Any] | None,
        streamer: BaseStreamer | None,
        logits_processor: LogitsProcessor | None,
    ) -> Request:
        """A turn's :class:`~knapspec.request.Request` (sampling: the decoder's default)."""
        decoder = self._decoder
        self._check_engine(decoder)
        return Request(
            single_prompt(input_ids, decoder.engine),
            max_new_tokens,
            decoder.sampling if sampling is None else sampling,
            eos_token_id,
            streamer=streamer,
            logits_processor=logits_processor,
        )

    def _run(self, request: Request) -> ConversationTurn:
        decoder = self._decoder
        self._partial = []
        self._check_engine(decoder)
        prompt = request.prompt
        # Before anything changes.
        decoder.engine.check_context(prompt.numel() + request.max_new_tokens)
        shared = common_prefix_length(self._tokens, prompt)
        reused = min(shared, self._cached, prompt.numel() - 1)
        dropped = self._cached - reused
        with decoder.lock:
            proposers = self._proposers_for(decoder)
            indexed = self._indexed if shared >= self._indexed else 0
            run = Run(
                decoder,
                self._cache,
                self._window,
                request,
                reused_tokens=reused,
                proposers=proposers,
                indexed_tokens=indexed,
            )
            try:
                result = run.execute()
            except KeyboardInterrupt:
                self._keep(prompt, run.output, interrupted=True)
                self._partial = list(run.output)
                raise
            except BaseException:
                # The turn never happened; the K/V before its prefill stay valid.
                self._tokens = self._tokens[:reused]
                self._cached = min(self._cached, reused)
                self._indexed = 0  # the index saw the failed turn's tokens
                self._cache.crop(self._cached)
                raise
        self._keep(prompt, run.output, interrupted=False)
        return ConversationTurn(result, dropped_tokens=dropped)

    def _keep(self, prompt: torch.Tensor, output: list[int], *, interrupted: bool) -> None:
        """Record the turn's tokens and how many of them the cache holds K/V for.

        After a finished call every committed token but possibly the last was fed through
        the full model; an interrupted one may have stopped inside a draft pass, whose K/V
        (a sub-network's) is not the model's, so the last committed token is not trusted.
        """
        committed = prompt.numel() + len(output)
        valid = committed - 1 if interrupted else committed
        self._tokens = torch.cat([prompt.cpu(), torch.tensor(output, dtype=torch.long)])
        self._cached = max(0, min(self._cache.seq_length, valid))
        self._cache.crop(self._cached)
        self._indexed = 0 if interrupted else committed


class _Exclusive:
    """Holds a conversation's lock for one call; a held lock is an error, not a wait."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConversationBusyError(
                "this conversation is already running a turn in another thread; a "
                "conversation has one history, so use it from one thread at a time (or "
                "start one conversation per thread)"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


__all__ = [
    "Conversation",
    "ConversationBusyError",
    "ConversationError",
    "ConversationTurn",
    "Message",
    "common_prefix_length",
]
