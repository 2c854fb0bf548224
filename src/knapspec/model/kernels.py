"""Linear layers for the few-row products of decoding and verification.

A decode step multiplies every weight matrix by 1 row; verification by ``k ≤ D + 1``
rows. On CPU, ``F.linear(x, W)`` (``x @ W.T``) sends such products to kernels that
re-read ``W`` for every row: on a 2-core EPYC with SmolLM2's ``49152 × 576`` LM head,
``F.linear`` takes 7.3 ms for 1 row, 15.3 ms for 2 and 22.2 ms for 3. The same product
computed as ``(W @ x.T).T`` lets the BLAS stream ``W`` once for up to four rows: 2.4-2.9
ms for 1-4 rows (``benchmarks/small_row_linear.py``, ``results/engine/
small_row_linear.jsonl``). One row and three rows fall back to slower paths, so they are
padded with zero rows to two and four. On small cache-resident matrices in isolation the
kernel is slower at 1 and 6-11 rows (0.7-0.85x); in the model, where every weight streams
from memory, a whole decode step is 1.6x faster.

Only the order of the floating-point summation differs from ``F.linear`` (as it does
between any two BLAS kernels), so outputs agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Up to this many rows use ``(W @ x.T).T``; beyond it ``F.linear``'s GEMM is as good.
SMALL_ROWS = 16


def padded_rows(rows: int) -> int:
    """Rows actually multiplied for ``rows`` (1 → 2 and 3 → 4; the others as they are)."""
    if rows == 1:
        return 2
    if rows == 3:
        return 4
    return rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, faster for few rows on CPU.

    Args:
        x: ``(..., in_features)``.
        weight: ``(out_features, in_features)``.
        bias: ``(out_features,)`` or None.

    Returns:
        ``(..., out_features)``, contiguous.
    """
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    if (
        x.device.type != "cpu"
        or not 1 <= rows <= SMALL_ROWS
        or x.dtype != weight.dtype
        or weight.dim() != 2
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, in_features)
    padded = padded_rows(rows)
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, in_features)])
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


__all__ = ["SMALL_ROWS", "linear", "padded_rows"]
