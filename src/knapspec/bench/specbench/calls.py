"""One timed ``generate`` call of a Spec-Bench turn: our decoders and ``model.generate``.

Both are timed whole, as a user waits for them. Our decoders report their own prefill time,
verify rounds and accepted lengths. ``model.generate`` reports none of these, so a forward
pre-hook reads where each model call starts (its first position): the first call is the
prefill (timed by a pair of hooks), and every later call committed the tokens up to where
the next one starts. For plain ``model.generate`` that is one token per call; for
transformers' prompt lookup, the accepted candidates plus one. The hooks cost a Python
call per forward, well under a percent of a 135M-parameter step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from knapspec.bench.methods import SupportsGenerate, forget_earlier_calls

if TYPE_CHECKING:
    from knapspec.decoding.conversation import Conversation


@attrs.frozen
class CallResult:
    """What one timed call produced (see :class:`~knapspec.bench.specbench.answers.Turn`)."""

    output_ids: tuple[int, ...]
    wall_time: float
    prefill_time: float
    decoding_steps: int
    accept_lengths: tuple[int, ...]

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_call(
    decoder: SupportsGenerate,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos: Sequence[int] | None,
) -> CallResult:
    """One greedy call of one of our decoders (``input_ids``: ``(n,)``), as a first call
    (:func:`~knapspec.bench.methods.forget_earlier_calls`)."""
    forget_earlier_calls(decoder)
    return _call_result(
        decoder.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
    )


def _call_result(result: Any) -> CallResult:
    """A :class:`CallResult` from one of our ``GenerationResult`` s."""
    stats = result.stats
    return CallResult(
        output_ids=tuple(int(t) for t in result.tokens.cpu().tolist()),
        wall_time=stats.wall_time_s,
        prefill_time=stats.prefill_time_s,
        decoding_steps=stats.decoding_steps,
        accept_lengths=tuple(stats.accept_lengths),
    )


class _ForwardProbe:
    """Forward hooks on ``model``: each call's first position and the first call's time."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.starts: list[int] = []
        self.prefill_started = 0.0
        self.prefill_seconds = 0.0
        self.handles: list[Any] = []

    def __enter__(self) -> _ForwardProbe:
        self.handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        if positions is not None:
            start = int(positions.reshape(-1)[0])
        else:  # no position ids: the cache's length is where this call starts
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            start = int(cache.get_seq_length()) if cache is not None else len(self.starts)
        if not self.starts:
            _synchronize(self.device)
            self.prefill_started = time.perf_counter()
        self.starts.append(start)

    def _after(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if len(self.starts) == 1 and not self.prefill_seconds:
            _synchronize(self.device)
            self.prefill_seconds = time.perf_counter() - self.prefill_started


def commits_after_prefill(starts: Sequence[int], final_length: int) -> list[int]:
    """Tokens each model call after the first committed, from where every call started.

    Once call ``i + 1`` starts at position ``s``, the sequence holds ``s + 1`` tokens (its
    last one not yet in the cache); after the last call it holds ``final_length``.
    """
    ends = [start + 1 for start in starts[1:]] + [final_length]
    return [ends[i] - ends[i - 1] for i in range(1, len(ends))]


def conversation_call(
    conversation: Conversation,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos: Sequence[int] | None,
) -> CallResult:
    """One greedy turn of a conversation: ``input_ids`` ``(n,)`` is the whole conversation
    so far; the part the conversation's cache already holds is not prefilled again."""
    turn = conversation.generate(input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
    return _call_result(turn.result)


@torch.inference_mode()
def generate_call(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    extra: Mapping[str, Any] | None = None,
) -> CallResult:
    """``model.generate`` as users call it, greedy, with ``extra`` keyword arguments (e.g.
    ``prompt_lookup_num_tokens``)."""
    device = next(model.parameters()).device
    batch = input_ids.unsqueeze(0).to(device)
    with _ForwardProbe(model) as probe:
        _synchronize(device)
        start = time.perf_counter()
        output = model.generate(
            batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **(extra or {}),
        )
        _synchronize(device)
        wall = time.perf_counter() - start
    tokens = tuple(int(t) for t in output[0, batch.shape[1] :].cpu().tolist())
    commits = commits_after_prefill(probe.starts, int(output.shape[1]))
    return CallResult(
        output_ids=tokens,
        wall_time=wall,
        prefill_time=probe.prefill_seconds,
        decoding_steps=len(commits),
        accept_lengths=tuple(commits),
    )


__all__ = [
    "CallResult",
    "commits_after_prefill",
    "conversation_call",
    "engine_call",
    "generate_call",
]
