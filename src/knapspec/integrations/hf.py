"""transformers integration: ``model.generate(..., custom_generate=knapspec_generate)``.

transformers 5 runs its usual input preparation, then hands the decoding loop to a
``custom_generate`` callable. :func:`knapspec_generate` is such a callable: it reads
``max_new_tokens``, ``eos_token_id``, ``do_sample``, ``temperature``, ``top_k`` and ``top_p``
from the prepared ``GenerationConfig`` and runs a :class:`SpeculativeDecoder` (one per model,
built on first use and reused). Use :func:`make_custom_generate` to supply your own decoder
or config::

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


def _sampling_from(generation_config: Any) -> SamplingParams:
    if not getattr(generation_config, "do_sample", False):
        return SamplingParams()
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
) -> torch.Tensor:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"knapspec's custom_generate decodes one sequence at a time; got batch size "
            f"{input_ids.shape[0]}"
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("knapspec's custom_generate does not support padded inputs")
    result = decoder.generate(
        input_ids[0],
        max_new_tokens=_max_new_tokens(generation_config, input_ids.shape[1]),
        eos_token_id=generation_config.eos_token_id,
        sampling=_sampling_from(generation_config),
        streamer=streamer,
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
    """
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = SpeculativeDecoder(model)
        _DECODERS[model] = decoder
    return _run(decoder, input_ids, generation_config, streamer, model_kwargs)


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
        return _run(decoder, input_ids, generation_config, streamer, model_kwargs)

    return custom_generate


__all__ = ["knapspec_generate", "make_custom_generate"]
