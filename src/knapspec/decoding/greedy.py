"""The greedy token of logits rows, the same as ``torch.argmax`` and faster on CPU.

Every verification takes the argmax of one vocabulary-long row per verified position. On
CPU, torch's argmax of a float32 row is several times slower than numpy's (its
index-tracking reduction is not vectorised), a difference a batched round's time shows
(figures: ``results/engine/HISTORY.md``, "Figures behind docstrings"). Both return the
first index of the largest value and count NaN as the largest (numpy's ``argmax`` and
torch's document both), so the chosen token is the same bit for bit; other devices and
dtypes numpy lacks (bfloat16) keep torch's.
"""

from __future__ import annotations

import torch

#: Dtypes whose CPU tensors numpy reads without a copy and reduces with SIMD (its float16
#: argmax is as slow as torch's).
_NUMPY_DTYPES = frozenset({torch.float32, torch.float64})


def _numpy_ready(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Per row, the index of the largest logit: ``logits (rows, vocab) -> rows`` ids."""
    ids: list[int] = (
        logits.detach().numpy().argmax(axis=-1).tolist()
        if _numpy_ready(logits)
        else logits.argmax(dim=-1).tolist()
    )
    return ids


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit of one row ``logits (vocab,)``."""
    if _numpy_ready(logits):
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """:func:`greedy_tokens` as a tensor: ``logits (rows, vocab) -> (rows,)`` int64."""
    if _numpy_ready(logits):
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1)).to(torch.int64)
    return logits.argmax(dim=-1)


__all__ = ["greedy_ids", "greedy_token", "greedy_tokens"]
