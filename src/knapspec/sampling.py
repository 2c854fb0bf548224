"""Sampling parameters and the processed distributions that verification compares."""

from __future__ import annotations

import math
import numbers
from typing import Any

import attrs
import torch

#: Temperatures below this are computed as this floor. At ``1e-30`` every logit gap a model
#: produces becomes a score gap beyond float32's ``exp`` range, so the distribution is
#: already a point mass on the most likely token (shared by exact ties): sampling is greedy.
#: Dividing by a smaller temperature would overflow float32 (``1e-40`` gave NaN
#: probabilities), so the floor changes no result, only avoids the overflow.
TEMPERATURE_FLOOR = 1e-30

#: ``torch.Generator.manual_seed`` takes seeds in ``[0, 2**64)``.
MAX_SEED = 2**64 - 1

#: Sampled verification schemes (:attr:`SamplingParams.verification`).
POSITION_KEYED = "position-keyed"
REJECTION = "rejection"
VERIFICATION_SCHEMES = (POSITION_KEYED, REJECTION)


def _as_bool(value: Any) -> bool:
    if isinstance(value, (bool, numbers.Integral)) and value in (0, 1):
        return bool(value)
    raise TypeError(f"do_sample must be true or false, got {value!r}")


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def _as_temperature(value: Any) -> float:
    return _as_float(value, "temperature")


def _as_top_p(value: Any) -> float:
    return _as_float(value, "top_p")


def _as_int(value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"top_k must be an integer, got {type(value).__name__} {value!r}")


def _as_seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if not 0 <= int(value) <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64 - 1], got {value}")
        return int(value)
    raise TypeError(f"seed must be an integer or None, got {type(value).__name__} {value!r}")


def _as_scheme(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"verification must be a string, got {type(value).__name__} {value!r}")
    if value not in VERIFICATION_SCHEMES:
        raise ValueError(
            f"verification must be one of {', '.join(VERIFICATION_SCHEMES)}, got {value!r}"
        )
    return value


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
        do_sample: False = greedy (exact token matching in verification); True = sampling,
            lossless under either ``verification`` scheme.
        temperature: softmax temperature (> 0), used when sampling. Temperatures below
            :data:`TEMPERATURE_FLOOR` (``1e-30``) sample greedily (all mass on the most
            likely token).
        top_k: keep the k most likely tokens (0 = off).
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: the sampling seed, in ``[0, 2**64)``. ``None`` draws a fresh seed per call
            from torch's global RNG (so ``torch.manual_seed(s)`` makes unseeded calls
            reproducible, as with ``model.generate``). With ``position-keyed``
            verification, the same seed, prompt, dtype and machine give the same tokens on
            every call and under every planner (the autoregressive one included: they
            equal plain sampling with this seed), whatever the drafts were. With
            ``rejection``, they repeat only when the draft plans repeat too. Neither
            reproduces transformers' own sampler (a different random stream).
        verification: how sampled drafts are verified. ``"position-keyed"`` (default):
            every token is ``argmax(log p~ + G_t)`` with Gumbel noise keyed by (seed,
            absolute position), and a draft is accepted iff it equals that token; the
            output does not depend on the draft plan. A lookup draft is accepted with
            probability ``p(x)``, as under rejection sampling; a sub-network draft (drafted
            with the same noise) with the Gumbel coupling's probability, between
            ``a / (2 - a)`` and ``a = sum min(p, q)``. ``"rejection"``: speculative
            rejection sampling (Leviathan et al. 2023), acceptance ``sum min(p, q)``, the
            tokens drawn per round, so they depend on the plan.

    Integers of any kind (numpy scalars included) are accepted where a number is expected;
    a wrong type raises ``TypeError`` naming the field.
    """

    do_sample: bool = attrs.field(default=False, converter=_as_bool)
    temperature: float = attrs.field(
        default=1.0, converter=_as_temperature, validator=_positive_temperature
    )
    top_k: int = attrs.field(default=0, converter=_as_int, validator=_top_k_range)
    top_p: float = attrs.field(default=1.0, converter=_as_top_p, validator=_top_p_range)
    seed: int | None = attrs.field(default=None, converter=_as_seed)
    verification: str = attrs.field(default=POSITION_KEYED, converter=_as_scheme)


def processed_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with the tokens top-k and top-p filter set to ``-inf``:
    :func:`processed_probs` is their softmax.

    Top-p keeps, per row, the smallest set of most likely tokens whose mass reaches
    ``top_p`` (the most likely token always stays; tokens tied with the last kept one stay
    too). Temperatures below :data:`TEMPERATURE_FLOOR` are computed as the floor.

    Args:
        logits: ``(..., vocab)`` raw logits.

    Returns:
        ``(..., vocab)`` float32 scores.
    """
    scores = logits.float() / max(params.temperature, TEMPERATURE_FLOOR)
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        threshold = _nucleus_threshold(scores, params.top_p)
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    return scores


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target/draft distribution after temperature, top-k and top-p
    (:func:`processed_scores`).

    Args:
        logits: ``(..., vocab)`` raw logits.

    Returns:
        ``(..., vocab)`` float32 probabilities; filtered tokens have probability exactly 0.
    """
    return processed_scores(logits, params).softmax(dim=-1)


# Candidates examined first for the nucleus: a language model's nucleus is usually far
# smaller, and a top-k of this many costs a small fraction of a full sort of the
# vocabulary (figures: results/engine/HISTORY.md, "Figures behind docstrings").
_FIRST_NUCLEUS_CANDIDATES = 64


def _nucleus_threshold(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The score of the last token the top-p nucleus keeps, per row.

    Looks at the ``k`` highest scores, growing ``k`` fourfold until their mass reaches
    ``top_p`` in every row (then the nucleus lies within them), so the common case never
    sorts the vocabulary.

    Args:
        scores: ``(..., vocab)`` temperature-scaled scores (``-inf`` = filtered).

    Returns:
        ``(..., 1)`` thresholds: keep the tokens with ``scores >= threshold``.
    """
    vocab = scores.shape[-1]
    log_normaliser = torch.logsumexp(scores, dim=-1, keepdim=True)
    k = min(_FIRST_NUCLEUS_CANDIDATES, vocab)
    while True:
        top = torch.topk(scores, k, dim=-1).values  # sorted, descending
        probs = (top - log_normaliser).exp()
        if k == vocab or bool((probs.sum(dim=-1) >= top_p).all()):
            break
        k = min(4 * k, vocab)
    # Keep the prefix whose mass before each token is still below top_p (>= 1 token).
    mass_before = probs.cumsum(dim=-1) - probs
    kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
    return top.gather(-1, kept - 1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token from ``probs (vocab,)`` (need not be normalised) by inverting its CDF.

    Tokens of probability 0 are never drawn. A float64 cumulative sum and a binary search
    do ``torch.multinomial``'s job in a small fraction of its time on a large vocabulary
    (figures: ``results/engine/HISTORY.md``, "Figures behind docstrings").
    """
    cumulative = probs.double().cumsum(dim=-1)
    point = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    # The first index whose cumulative mass exceeds the point: never a zero-mass token.
    index = int(torch.searchsorted(cumulative, point * cumulative[-1], right=True))
    if index == probs.shape[-1]:  # u * total rounded up to total: take the last live token
        index = int(torch.nonzero(probs).max())
    return index


__all__ = [
    "MAX_SEED",
    "POSITION_KEYED",
    "REJECTION",
    "TEMPERATURE_FLOOR",
    "VERIFICATION_SCHEMES",
    "SamplingParams",
    "processed_probs",
    "processed_scores",
    "sample_token",
]
