"""Position-keyed Gumbel noise: the randomness of sampled decoding, one stream per position.

The token at absolute position ``t`` is ``argmax_i(s_t(i) + G_t(i))``, where ``s_t`` are the
processed scores (temperature, top-k, top-p; ``-inf`` where filtered) and ``G_t(i)`` is
standard Gumbel noise that depends only on ``(seed, t, i)`` (the Gumbel-max trick: the
argmax is an exact sample of ``softmax(s_t)``). Because the noise is a function of the
position and not of the order in which it is drawn, every way of reaching position ``t``
(a plain step, a verification row, a draft step) sees the same ``G_t``, so the output of
speculative decoding is the output of plain sampling with the same seed, whatever the
draft plans were (proof: ``docs/theory.md``, "Position-keyed sampling").

The stream is counter-based: ``u_t(i)`` is the top 23 bits of SplitMix64 at counter
``i + 1`` from the key ``mix(mix(seed) ^ t)``, computed with wrapping int64 arithmetic, so
it is identical on every call, every device and every thread count (only the float32
``log`` of ``-log(u)`` may differ in the last bit between kernels). ``u`` lies on the grid
``(k + 1/2) 2^-23``, exact in float32 and never 0 or 1, so ``G`` is finite and bounded
(:data:`GUMBEL_SPAN`).

Only tokens whose score is close enough to the row's best can win the argmax
(:data:`GUMBEL_SPAN`), and once some noise is known, closer still, so the noise is computed
for those candidates alone (a sharp distribution needs 64 hash evaluations, not the
vocabulary's 49,152; SmolLM2 at T = 0.7 needed about 950 at the median).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

#: ``u`` is ``(k + 1/2) 2^-23`` for a 23-bit ``k`` (24 significant bits: exact in float32;
#: 24-bit ``k`` would round ``k + 1/2`` up to ``2^24`` and give ``u = 1``, ``G = inf``).
_UNIFORM_BITS = 23
_U_MIN = 0.5 * 2.0**-_UNIFORM_BITS
_U_MAX = 1.0 - _U_MIN
#: ``G = -log(-log u)`` lies in about ``[-2.8, 16.6]`` on that grid; the bounds used for
#: pruning keep a margin of 0.5 for float32 rounding.
GUMBEL_MAX = -math.log(-math.log(_U_MAX)) + 0.5
GUMBEL_MIN = -math.log(-math.log(_U_MIN)) - 0.5
#: A token whose score is more than this below the row's best can never win the argmax.
GUMBEL_SPAN = GUMBEL_MAX - GUMBEL_MIN
#: Tokens of highest score whose noise is computed first; the best of them bounds which
#: others could still win (their score must be within GUMBEL_MAX of that best).
FIRST_CANDIDATES = 64


def mix64(value: int) -> int:
    """SplitMix64's finaliser of a 64-bit integer (Steele, Lea & Flood 2014)."""
    z = value & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of the noise at absolute ``position`` for ``seed``: distinct
    positions of one seed get distinct keys (``mix64`` is a bijection)."""
    return mix64(mix64(seed) ^ position)


def _signed(value: int) -> int:
    """A 64-bit unsigned integer as torch's int64 (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch shifts signed values arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(key: int, index: torch.Tensor) -> torch.Tensor:
    """``u(i)`` in ``(0, 1)`` for each token id in ``index``.

    Args:
        key: :func:`position_key` of the position.
        index: ``(n,)`` int64 token ids.

    Returns:
        ``(n,)`` float32 uniforms on the grid ``(k + 1/2) 2^-23``.
    """
    # SplitMix64's state after i + 1 steps from the key, wrapping like uint64.
    z = (index + 1) * _signed(_GOLDEN) + _signed(key)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _shift_right(z, 31)
    top = _shift_right(z, 64 - _UNIFORM_BITS).to(torch.float32)
    return (top + 0.5) * 2.0**-_UNIFORM_BITS


def gumbel_noise(key: int, index: torch.Tensor) -> torch.Tensor:
    """``(n,)`` float32 standard Gumbel noise ``-log(-log u)`` for the token ids ``index``."""
    return uniforms(key, index).log_().neg_().log_().neg_()


def keyed_argmax(scores: torch.Tensor, keys: Sequence[int]) -> list[int]:
    """Per row, ``argmax_i(scores[row, i] + G(keys[row], i))``: an exact sample of
    ``softmax(scores[row])``.

    The noise is computed for few tokens: first the :data:`FIRST_CANDIDATES` of highest
    score; the best perturbed value ``b`` among them can be beaten only by a token whose
    score exceeds ``b - GUMBEL_MAX``, and only those are computed next (none, usually, when
    the distribution is sharp). The result is the full argmax's (a token's noise does not
    depend on which others are computed).

    Args:
        scores: ``(rows, vocab)`` processed scores (``-inf`` = filtered); float32 is used.
        keys: one :func:`position_key` per row.

    Returns:
        the chosen token id per row.
    """
    scores = scores.float()
    if scores.shape[0] != len(keys):
        raise ValueError(f"{len(keys)} keys for {scores.shape[0]} rows of scores")
    # Scores relative to the best, so that noise is not lost in the rounding of huge scores:
    # at a temperature near the floor they are ~1e30 apart and only exact ties stay within
    # reach, which the noise then breaks at random (as sampling their shared mass does).
    relative = scores - scores.max(dim=-1, keepdim=True).values
    vocab = relative.shape[-1]
    first, first_index = torch.topk(relative, min(FIRST_CANDIDATES, vocab), dim=-1)
    chosen = []
    for row, key in enumerate(keys):
        index = first_index[row]
        perturbed = first[row] + gumbel_noise(key, index)
        best = int(perturbed.argmax())
        threshold = float(perturbed[best]) - GUMBEL_MAX
        if index.numel() == vocab or float(first[row, -1]) < threshold:
            chosen.append(int(index[best]))  # no token outside the first ones can win
            continue
        live = relative[row] >= threshold
        if int(live.sum()) > vocab // 4:  # gathering would cost more than computing all
            index = _all_ids(vocab, relative.device)
            perturbed = relative[row] + gumbel_noise(key, index)
        else:
            index = live.nonzero().squeeze(-1)
            perturbed = relative[row, index] + gumbel_noise(key, index)
        chosen.append(int(index[int(perturbed.argmax())]))
    return chosen


@functools.cache
def _all_ids(vocab: int, device: torch.device) -> torch.Tensor:
    return torch.arange(vocab, device=device)


__all__ = [
    "FIRST_CANDIDATES",
    "GUMBEL_MAX",
    "GUMBEL_MIN",
    "GUMBEL_SPAN",
    "gumbel_noise",
    "keyed_argmax",
    "mix64",
    "position_key",
    "uniforms",
]
