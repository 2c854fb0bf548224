"""Acceptance rules: exact greedy matching and lossless speculative rejection sampling."""

from __future__ import annotations

import attrs
import torch

from knapspec.decoding.greedy import greedy_tokens

# Its first home: the old import path keeps working.
from knapspec.errors import NonFiniteLogitsError as NonFiniteLogitsError
from knapspec.sampling import sample_token


@attrs.frozen
class Verdict:
    """Result of verifying one round.

    Attributes:
        accepted: leading draft tokens accepted.
        tokens: committed tokens: the accepted drafts, then one token from the target
            (the correction on rejection, or the bonus token when all were accepted).
    """

    accepted: int
    tokens: list[int]


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Accept the longest prefix equal to the target's argmax, plus the target's next token.

    Args:
        draft_tokens: ``k`` drafted tokens.
        target_logits: ``(k + 1, vocab)``: row ``j`` predicts the token after draft ``j``
            (row 0 follows the last committed token).
    """
    target = greedy_tokens(target_logits)
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target[accepted]:
        accepted += 1
    return Verdict(accepted, [*draft_tokens[:accepted], target[accepted]])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``, the resampling distribution after a rejection.

    Falls back to ``p`` when the residual has no mass (then ``p == q`` up to rounding, and
    a rejection had probability zero).
    """
    residual = (p - q).clamp_min(0)
    mass = residual.sum()
    return residual / mass if float(mass) > 0 else p


def verify_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    Draft token ``x_j ~ q_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``;
    on the first rejection a token is drawn from ``norm(max(0, p_j - q_j))``; if all are
    accepted a bonus token is drawn from ``p_k``. The committed tokens are then distributed
    exactly as sampling from the target.

    Args:
        draft_tokens: ``k`` drafted tokens.
        draft_probs: ``(k, vocab)`` processed draft distributions ``q_j``.
        target_probs: ``(k + 1, vocab)`` processed target distributions ``p_j``.
    """
    k = len(draft_tokens)
    if k:
        index = torch.arange(k, device=draft_probs.device)
        tokens = torch.tensor(draft_tokens, device=draft_probs.device)
        p_x = target_probs[index, tokens]
        q_x = draft_probs[index, tokens]
        uniforms = torch.rand(k, generator=generator, device=draft_probs.device)
        # u < p/q  <=>  u * q < p; q(x) > 0 because x was sampled from q.
        accepted_mask = (uniforms * q_x < p_x).tolist()
    else:
        accepted_mask = []
    for j in range(k):
        if not accepted_mask[j]:
            residual = residual_distribution(target_probs[j], draft_probs[j])
            correction = sample_token(residual, generator)
            return Verdict(j, [*draft_tokens[:j], correction])
    bonus = sample_token(target_probs[k], generator)
    return Verdict(k, [*draft_tokens, bonus])
