"""A :class:`~knapspec.decoding.run.Run` built from a decoder's components.

``generate`` and a conversation turn both play one :class:`Run` over the decoder's engine,
planner, drafters and cost model; :func:`decoder_run` is the one place that wires them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from knapspec.decoding.run import LogitsProcessor, Run
from knapspec.decoding.sampler import TokenSampler, resolve_seed
from knapspec.drafters.base import Drafter
from knapspec.planners.base import Planner
from knapspec.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers.generation.streamers import BaseStreamer

    from knapspec.costmodels.base import CostModel
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.proxies.base import ValueProxy
    from knapspec.window import WindowBuffer


class DecoderParts(Protocol):
    """The components of a decoder that a :class:`Run` plays with (what
    :class:`~knapspec.decoding.decoder.SpeculativeDecoder` holds)."""

    engine: SublayerEngine
    planner: Planner
    drafters: dict[str, Drafter]
    cost_model: CostModel | None
    proxy: ValueProxy | None
    max_draft_length: int
    confidence_threshold: float


def decoder_run(
    decoder: DecoderParts,
    cache: KVCache,
    window: WindowBuffer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: frozenset[int],
    params: SamplingParams,
    streamer: BaseStreamer | None,
    logits_processor: LogitsProcessor | None,
    *,
    reused_tokens: int = 0,
    proposers: Sequence[Drafter] | None = None,
    indexed_tokens: int = 0,
) -> Run:
    """A :class:`Run` of ``decoder``'s components over ``cache`` and ``window`` (one call
    of ``generate`` or one conversation turn); an unseeded ``params`` draws a fresh seed
    from torch's global RNG."""
    return Run(
        decoder.engine,
        cache,
        window,
        decoder.planner,
        decoder.drafters,
        cost_model=decoder.cost_model,
        proxy=decoder.proxy,
        max_draft_length=decoder.max_draft_length,
        confidence_threshold=decoder.confidence_threshold,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        params=params,
        sampler=TokenSampler(params, resolve_seed(params), decoder.engine.device),
        streamer=streamer,
        logits_processor=logits_processor,
        reused_tokens=reused_tokens,
        proposers=proposers,
        indexed_tokens=indexed_tokens,
    )


__all__ = ["DecoderParts", "decoder_run"]
