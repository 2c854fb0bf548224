"""The record of one call: what to decode and how.

A :class:`Request` is what ``generate``, a batch row, a conversation turn and a server's
request all hand to the decoding loop: the prompt's token ids, the token limit
(``max_new_tokens``, its one name from the public call to the round), the sampling
settings, the stop ids, the seed and the stream sink. The vLLM proposer holds one per batch
row too, with what vLLM shows it (the prompt and the model length's limit). It is the shape
of vLLM's ``Request`` with its ``SamplingParams``: the decoder's parts (engine, caches,
planner, drafters) are never in it, so one decoder plays many requests and a scheduler
holds many at once.

The two rooms a row's decoding needs are computed here, once: how many new tokens fit a
row of a given size (:func:`completion_room`, what a server admits) and how many tokens a
round may draft (:func:`draft_room`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import attrs
import torch

from knapspec.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer

#: ``(input_ids (1, t), scores (1, vocab)) -> scores``: a transformers ``LogitsProcessorList``
#: or any callable of that shape.
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sampling_params(sampling: SamplingParams | Mapping[str, Any]) -> SamplingParams:
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


def stop_set(
    eos_token_id: int | Sequence[int] | Set[int] | torch.Tensor | None,
) -> frozenset[int]:
    """The stop token ids as a set (None: no stop token)."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        values: list[Any] = eos_token_id.flatten().tolist()
    elif isinstance(eos_token_id, Set):
        values = list(eos_token_id)
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


def new_token_limit(max_new_tokens: object) -> int:
    """``max_new_tokens`` checked: an integer (numpy integers too) >= 1."""
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise TypeError(
            f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__} "
            f"{max_new_tokens!r}"
        )
    limit = int(max_new_tokens)
    if limit < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {limit}")
    return limit


def prompt_ids(prompt: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """``prompt`` as ``(n,)`` long token ids, on the device it is on (a list: the CPU).

    Raises:
        ValueError: not 1-D, empty, or not integer ids.
    """
    ids = prompt if isinstance(prompt, torch.Tensor) else torch.tensor(list(prompt))
    if ids.dim() != 1:
        raise ValueError(f"a prompt must be 1-D token ids, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"a prompt must be integer token ids, got dtype {ids.dtype}")
    return ids.to(torch.long)


def _seed(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"seed must be an integer or None, got {type(value).__name__} {value!r}")


def _callable_or_none(instance: Request, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(
            "logits_processor must be a callable (input_ids, scores) -> scores, such as a "
            f"transformers LogitsProcessorList; got {type(value).__name__}"
        )


@attrs.frozen(eq=False)
class Request:
    """One call's record: a prompt and how to continue it (module docstring).

    Compared by identity (a scheduler tells two requests for the same prompt apart).

    Attributes:
        prompt: ``(n,)`` long token ids (a sequence of ints is converted; a tensor keeps
            its device).
        max_new_tokens: the token limit (an integer >= 1; numpy integers too).
        sampling: how tokens are picked (greedy unless ``do_sample``); a dict gives its
            fields.
        stop_ids: token ids that end generation (kept in the output); an integer, a
            sequence or a tensor of them is converted.
        seed: the sampling seed (taken mod ``2**64``); None: ``sampling.seed``, else a
            fresh one drawn from torch's global RNG when the request starts.
        streamer: the stream sink, a transformers ``BaseStreamer``: receives the prompt,
            then every committed token in order, then ``end()`` (a single sequence only).
        logits_processor: applied to the draft's and the target's logits alike before
            argmax / sampling (a single sequence only; None costs nothing).

    Raises:
        TypeError, ValueError: a field out of range (the message names it).
    """

    prompt: torch.Tensor = attrs.field(converter=prompt_ids)
    max_new_tokens: int = attrs.field(default=128, converter=new_token_limit)
    sampling: SamplingParams = attrs.field(factory=SamplingParams, converter=sampling_params)
    stop_ids: frozenset[int] = attrs.field(factory=frozenset, converter=stop_set)
    seed: int | None = attrs.field(default=None, converter=_seed)
    streamer: BaseStreamer | None = None
    logits_processor: LogitsProcessor | None = attrs.field(
        default=None, validator=_callable_or_none
    )

    @property
    def prompt_tokens(self) -> int:
        """How many tokens the prompt has."""
        return self.prompt.numel()

    def remaining(self, generated: int) -> int:
        """How many more tokens may be committed after ``generated`` new ones."""
        return self.max_new_tokens - generated


def draft_room(max_draft_length: int, remaining: int, context: int, max_context: int) -> int:
    """The most tokens a round may draft: at most ``max_draft_length``, and at most what
    the request's limit (``remaining`` tokens left) and the model's context (``context``
    tokens in the cache, ``max_context`` in all) still hold beside the target's own
    token. Never negative."""
    return max(0, min(max_draft_length, remaining - 1, max_context - context - 1))


def completion_room(capacity: int, prompt_tokens: int, max_draft_length: int) -> int:
    """The largest ``max_new_tokens`` a row of ``capacity`` tokens takes after a prompt of
    ``prompt_tokens``: its last round's drafts and pending token need room too (may be
    below 1: nothing fits)."""
    return capacity - prompt_tokens - max_draft_length - 1


__all__ = [
    "LogitsProcessor",
    "Request",
    "completion_room",
    "draft_room",
    "new_token_limit",
    "prompt_ids",
    "sampling_params",
    "stop_set",
]
