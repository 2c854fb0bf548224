"""transformers integration: ``model.generate(..., custom_generate=knapspec_generate)``.

transformers 5 runs its usual input preparation, then hands the decoding loop to a
``custom_generate`` callable. :func:`knapspec_generate` is such a callable: it runs a
:class:`SpeculativeDecoder` (one per model, built on first use and reused) with the
prepared ``GenerationConfig``:

* ``max_new_tokens`` / ``max_length``, ``eos_token_id``, ``do_sample``, ``temperature``,
  ``top_k`` and ``top_p`` map onto the decoder's own arguments;
* every other logits processor transformers prepared (``repetition_penalty``,
  ``min_new_tokens``, ``min_length``, ``no_repeat_ngram_size``, ``bad_words_ids``,
  ``min_p``, a user's ``logits_processor=``...) is applied to the draft's and the target's
  logits alike, each position seeing the prefix with the drafts before it, so the output
  stays exactly ``model.generate``'s (greedy) or distributed as it (sampling);
* sampling without a seed draws from torch's global RNG: ``torch.manual_seed(s)`` makes
  two calls agree, as with ``model.generate``;
* what cannot be honoured losslessly is refused by name (:data:`UNSUPPORTED`: beam search,
  several return sequences, contrastive search, classifier-free guidance, prompt lookup,
  ``return_dict_in_generate``, ``stop_strings``, ``max_time``, other stopping criteria).

Use :func:`make_custom_generate` to supply your own decoder or config::

    out = model.generate(input_ids, max_new_tokens=64, custom_generate=knapspec_generate)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.sampling import SamplingParams

_DECODERS: weakref.WeakKeyDictionary[nn.Module, SpeculativeDecoder] = weakref.WeakKeyDictionary()

#: The processors transformers builds from ``temperature`` / ``top_k`` / ``top_p``; the
#: decoder applies these itself (:func:`~knapspec.sampling.processed_probs`).
_SAMPLING_WARPERS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"})

#: The stopping criteria the decoder implements itself (``max_new_tokens``, ``eos_token_id``).
_HANDLED_CRITERIA = frozenset({"MaxLengthCriteria", "EosTokenCriteria"})

#: ``GenerationConfig`` fields knapspec refuses, with the value that means "off" and why.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_beams": (lambda v: v is None or v <= 1, "beam search"),
    "num_return_sequences": (lambda v: v is None or v <= 1, "several sequences per prompt"),
    "penalty_alpha": (lambda v: not v, "contrastive search"),
    "guidance_scale": (lambda v: v is None or v == 1, "classifier-free guidance"),
    "prompt_lookup_num_tokens": (lambda v: not v, "prompt-lookup decoding"),
    "return_dict_in_generate": (lambda v: not v, "knapspec returns the token ids only"),
    "stop_strings": (lambda v: not v, "stopping on strings"),
    "max_time": (lambda v: v is None, "a time limit"),
}


def _check_supported(generation_config: Any, stopping_criteria: Any) -> None:
    """Refuse, by name, every setting the decoder would otherwise silently ignore."""
    refused = [
        f"{name}={getattr(generation_config, name)!r} ({why})"
        for name, (is_off, why) in UNSUPPORTED.items()
        if not is_off(getattr(generation_config, name, None))
    ]
    for criterion in stopping_criteria or []:
        if type(criterion).__name__ not in _HANDLED_CRITERIA:
            refused.append(f"the stopping criterion {type(criterion).__name__}")
    if refused:
        raise ValueError(
            f"knapspec's custom_generate does not support {'; '.join(refused)}. Leave "
            "these settings at their defaults, or call model.generate without custom_generate."
        )


def _sampling_from(generation_config: Any, *, warpers_in_processor: bool) -> SamplingParams:
    if not getattr(generation_config, "do_sample", False):
        return SamplingParams()
    if warpers_in_processor:  # the processor list ends with the warpers: plain softmax here
        return SamplingParams(do_sample=True)
    return SamplingParams(
        do_sample=True,
        temperature=float(generation_config.temperature or 1.0),
        top_k=int(generation_config.top_k or 0),
        top_p=float(generation_config.top_p if generation_config.top_p is not None else 1.0),
        seed=None,
    )


def _max_new_tokens(generation_config: Any, prompt_length: int) -> int:
    if generation_config.max_new_tokens is not None:
        return int(generation_config.max_new_tokens)
    return int(generation_config.max_length) - prompt_length


def _run(
    decoder: SpeculativeDecoder,
    input_ids: torch.Tensor,
    generation_config: Any,
    streamer: Any,
    model_kwargs: dict[str, Any],
    logits_processor: Any = None,
    stopping_criteria: Any = None,
) -> torch.Tensor:
    _check_supported(generation_config, stopping_criteria)
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"knapspec's custom_generate decodes one sequence at a time; got batch size "
            f"{input_ids.shape[0]}"
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("knapspec's custom_generate does not support padded inputs")
    processors = list(logits_processor or [])
    # Only temperature / top-k / top-p: the decoder's fast path, no per-round processing.
    # Anything else: the whole list, in transformers' order, on draft and target alike.
    needs_processor = any(type(p).__name__ not in _SAMPLING_WARPERS for p in processors)
    result = decoder.generate(
        input_ids[0],
        max_new_tokens=_max_new_tokens(generation_config, input_ids.shape[1]),
        eos_token_id=generation_config.eos_token_id,
        sampling=_sampling_from(generation_config, warpers_in_processor=needs_processor),
        streamer=streamer,
        logits_processor=logits_processor if needs_processor else None,
    )
    return result.sequences.to(input_ids.device)


def knapspec_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    synced_gpus: bool = False,
    streamer: Any = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """A ``custom_generate`` callable running KnapSpec with the default components.

    Returns:
        ``(1, prompt + new)`` token ids, like ``model.generate``.

    Raises:
        ValueError: a setting knapspec cannot honour (named), batch > 1, padded inputs.
    """
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = SpeculativeDecoder(model)
        _DECODERS[model] = decoder
    return _run(
        decoder,
        input_ids,
        generation_config,
        streamer,
        model_kwargs,
        logits_processor,
        stopping_criteria,
    )


def make_custom_generate(decoder: SpeculativeDecoder) -> Callable[..., torch.Tensor]:
    """A ``custom_generate`` callable that runs ``decoder`` (built for the same model)."""

    def custom_generate(
        model: nn.Module,
        input_ids: torch.Tensor,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        generation_config: Any = None,
        synced_gpus: bool = False,
        streamer: Any = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        if decoder.engine.model is not model:
            raise ValueError("this custom_generate was built for a different model")
        return _run(
            decoder,
            input_ids,
            generation_config,
            streamer,
            model_kwargs,
            logits_processor,
            stopping_criteria,
        )

    return custom_generate


__all__ = ["UNSUPPORTED", "knapspec_generate", "make_custom_generate"]
