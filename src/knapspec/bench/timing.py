"""Direct latency measurements at a given context: draft steps, verify steps, v(k).

v(k) = time(one full-model step over k new tokens) / time(one 1-token step), at a fixed
context length. It is measured through our engine (preallocated cache, grouped-query
attention without repeated K/V) and, for comparison, through the Hugging Face model's own
forward with a ``DynamicCache``. Every timed call is followed by a crop back to the
context, so each repeat sees the same cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.types import SublayerMask

if TYPE_CHECKING:
    from knapspec.decoding.decoder import SpeculativeDecoder


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    call: Callable[[], object], device: torch.device, *, repeats: int, warmup: int = 1
) -> float:
    """Median wall time of ``call`` over ``repeats`` runs after ``warmup`` untimed ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def filled_cache(engine: SublayerEngine, token_ids: torch.Tensor, extra: int) -> KVCache:
    """A cache holding the full model's K/V for ``token_ids (n,)``, room for ``extra`` more."""
    cache = engine.new_cache(token_ids.numel() + extra)
    engine.forward(token_ids, 0, cache, all_logits=False)
    return cache


@torch.inference_mode()
def engine_step_seconds(
    engine: SublayerEngine,
    cache: KVCache,
    context_length: int,
    num_tokens: int,
    mask: SublayerMask | None = None,
    *,
    repeats: int,
) -> float:
    """Median time of one engine step over ``num_tokens`` new tokens after the first
    ``context_length`` cached tokens (all logits, as verification computes them)."""
    tokens = torch.zeros(num_tokens, dtype=torch.long, device=engine.device)

    def step() -> None:
        cache.crop(context_length)
        engine.forward(tokens, context_length, cache, mask)

    seconds = median_seconds(step, engine.device, repeats=repeats)
    cache.crop(context_length)
    return seconds


def engine_verify_seconds(
    engine: SublayerEngine,
    cache: KVCache,
    context_length: int,
    widths: Sequence[int],
    *,
    repeats: int,
) -> list[float]:
    """Full-model step times over ``k`` tokens for every ``k`` in ``widths``."""
    return [engine_step_seconds(engine, cache, context_length, k, repeats=repeats) for k in widths]


@torch.inference_mode()
def hf_verify_seconds(
    model: nn.Module, prompt: torch.Tensor, widths: Sequence[int], *, repeats: int
) -> list[float]:
    """The same measurement through ``model``'s forward with a ``DynamicCache``.

    Args:
        prompt: ``(n,)`` context token ids, prefilled once.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids = prompt.to(device).unsqueeze(0)
    context_length = ids.shape[1]
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
    model(input_ids=ids, cache=cache, use_cache=True)

    def rewind() -> None:
        extra = cache.get_seq_length() - context_length
        if extra > 0:
            cache.crop(-extra)  # transformers 5: a negative argument removes that many tokens

    results = []
    for k in widths:
        new = torch.zeros((1, k), dtype=torch.long, device=device)
        positions = torch.arange(context_length, context_length + k, device=device).unsqueeze(0)

        def step(new: torch.Tensor = new, positions: torch.Tensor = positions) -> None:
            rewind()
            model(input_ids=new, position_ids=positions, cache=cache, use_cache=True)

        results.append(median_seconds(step, device, repeats=repeats))
        rewind()
    return results


def spread_ms(seconds: Sequence[float]) -> dict[str, float]:
    """``median_ms``, ``p10_ms`` and ``p90_ms`` of ``seconds`` (rounded to 0.01 ms), the
    spread the A/B benchmarks write per setting."""
    ms = sorted(s * 1e3 for s in seconds)
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p10_ms": round(ms[len(ms) // 10], 2),
        "p90_ms": round(ms[(9 * len(ms)) // 10], 2),
    }


def batched_round_seconds(
    decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]], *, warm: int, timed: int
) -> list[float]:
    """Seconds of ``timed`` batched rounds over ``prompts`` (one row each, in one
    continuous batch) after ``warm`` untimed rounds; the rows' limit leaves room for all
    of them. With the autoregressive planner every round is a plain one."""
    from knapspec.request import Request

    batch = decoder.continuous_batch(len(prompts), 2048)
    for prompt in prompts:
        batch.add(Request(list(prompt), warm + timed + 8))
    for _ in range(warm):
        batch.step()
    seconds = []
    for _ in range(timed):
        started = time.perf_counter()
        batch.step()
        seconds.append(time.perf_counter() - started)
    return seconds


__all__ = [
    "batched_round_seconds",
    "engine_step_seconds",
    "engine_verify_seconds",
    "filled_cache",
    "hf_verify_seconds",
    "median_seconds",
    "spread_ms",
]
