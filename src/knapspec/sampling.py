"""Sampling parameters and the processed distributions that verification compares."""

from __future__ import annotations

import math

import attrs
import torch


def _positive_temperature(
    instance: SamplingParams, attribute: attrs.Attribute[float], value: float
) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {value}")


def _top_p_range(instance: SamplingParams, attribute: attrs.Attribute[float], value: float) -> None:
    if not (0.0 < value <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {value}")


def _top_k_range(instance: SamplingParams, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {value}")


@attrs.frozen
class SamplingParams:
    """How tokens are chosen.

    Attributes:
        do_sample: False = greedy (exact token matching in verification); True = sampling
            with lossless speculative rejection sampling.
        temperature: softmax temperature (> 0), used when sampling.
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: seed of the decoder's ``torch.Generator`` (None = nondeterministic).
    """

    do_sample: bool = False
    temperature: float = attrs.field(default=1.0, validator=_positive_temperature)
    top_k: int = attrs.field(default=0, validator=_top_k_range)
    top_p: float = attrs.field(default=1.0, validator=_top_p_range)
    seed: int | None = None


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target/draft distribution after temperature, top-k and top-p.

    Args:
        logits: ``(..., vocab)`` raw logits.

    Returns:
        ``(..., vocab)`` float32 probabilities; filtered tokens have probability exactly 0.
    """
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


__all__ = ["SamplingParams", "processed_probs"]
