"""Copy evidence: how much of the recent output repeats spans seen earlier in the context.

Layer-skipping drafts agree with the target almost always while the model copies (quotes,
repeats, edits a passage), and rarely enough to pay on a CPU otherwise (docs/benchmarks.md).
Whether the output is copying is visible for free in the token ids: a token is *copied*
when the ``ngram`` tokens before it, followed by it, occur earlier in the sequence — what
prompt-lookup decoding would have drafted correctly. The knapsack planner's search gate
(``search_gate="copy"``) runs the DP only while this fraction is high.
"""

from __future__ import annotations

from collections import deque

import torch


def copied_fraction(tokens: torch.Tensor, *, ngram: int = 3, recent: int = 16) -> float:
    """Fraction of the last ``recent`` tokens whose ``(ngram + 1)``-gram ending at them
    also occurs earlier in ``tokens``.

    Args:
        tokens: ``(n,)`` token ids, oldest first.
        ngram: tokens of left context that must match (>= 1).
        recent: how many of the last tokens are scored (>= 1).

    Returns:
        A fraction in ``[0, 1]``; 0.0 when the sequence is too short to score any token.
    """
    if ngram < 1 or recent < 1:
        raise ValueError(f"ngram and recent must be >= 1, got ngram={ngram}, recent={recent}")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    span = ngram + 1
    grams = tokens.unfold(0, span, 1) if tokens.numel() >= span else tokens.new_empty(0, span)
    count = grams.shape[0]
    if count < 2:
        return 0.0
    scored = min(recent, count - 1)
    queries = grams[count - scored :]  # (scored, span): the grams ending at the last tokens
    # Gram j ending at token t may match any gram that ends before it: indices < its own.
    equal = (queries[:, None, :] == grams[None, :, :]).all(dim=-1)  # (scored, count)
    own = torch.arange(count - scored, count, device=tokens.device)
    earlier = torch.arange(count, device=tokens.device)[None, :] < own[:, None]
    hits = (equal & earlier).any(dim=1)
    return float(hits.float().mean())


class CopyTracker:
    """:func:`copied_fraction` maintained incrementally as a sequence grows.

    Each call processes only the tokens added since the previous one (a set of the grams
    seen so far and a ring of the last ``recent`` hit flags), so a decode step costs a few
    microseconds instead of a scan of the whole context. A sequence that is not an
    extension of the last one (a new prompt) starts over.

    Args:
        ngram: tokens of left context that must match (>= 1).
        recent: how many of the last tokens are scored (>= 1).
    """

    def __init__(self, ngram: int = 3, recent: int = 16) -> None:
        if ngram < 1 or recent < 1:
            raise ValueError(f"ngram and recent must be >= 1, got ngram={ngram}, recent={recent}")
        self.ngram = ngram
        self.recent = recent
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._seen: set[tuple[int, ...]] = set()
        self._hits: deque[bool] = deque(maxlen=self.recent)

    def update(self, tokens: torch.Tensor) -> float:
        """The copied fraction of ``tokens (n,)``, equal to ``copied_fraction(tokens, ...)``."""
        known = len(self._tokens)
        if tokens.numel() < known or (known and int(tokens[known - 1]) != self._tokens[-1]):
            self.reset()
            known = 0
        self._tokens.extend(tokens[known:].tolist())
        span = self.ngram + 1
        for end in range(max(known, span - 1), len(self._tokens)):
            gram = tuple(self._tokens[end - span + 1 : end + 1])
            if end >= span:  # the first gram has no earlier one to match
                self._hits.append(gram in self._seen)
            self._seen.add(gram)
        return sum(self._hits) / len(self._hits) if self._hits else 0.0


__all__ = ["CopyTracker", "copied_fraction"]
