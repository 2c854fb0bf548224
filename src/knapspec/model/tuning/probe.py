"""The row-invariance probe: does a linear kernel give every row of an ``m``-row product
bitwise that row's one-row product? (:mod:`knapspec.model.tuning.invariance` builds the exact
kernel tables from its verdicts; ``docs/theory.md`` explains the contract.)

It probes a kernel twice: on a weight of the model's shape with :func:`cancelling_inputs`,
which expose any change of float32 summation order even in bfloat16, every row also shifted
to other positions beside other rows; and on the model's own weight with random inputs (a
kernel may keep state per weight, as oneDNN's reordered copies do).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch

from knapspec.model.kernels.table import SMALL_ROWS, Kernel

#: Row counts every candidate is probed at (against each row's one-row product): every
#: few-row count of decoding, both sides of the block heights BLAS and oneDNN switch at (16,
#: 32, 64: on the AMX tiles, bfloat16 ``F.linear`` has kept every row up to 32 rows and
#: changed them from 33), and packed batched-verification counts past them.
PROBE_ROWS: tuple[int, ...] = (*range(2, SMALL_ROWS + 1), 17, 24, 31, 32, 33, 48, 63, 64, 65, 96)

#: Row counts at which the probe also shifts every row to other positions beside other rows
#: (a kernel whose result depends on a row's place in its block); each new row count costs
#: oneDNN a new primitive, so not at every count.
ROTATED_ROWS: frozenset[int] = frozenset({3, 8, 16, 17, 32, 33, 64, 96})

#: Bumped whenever the probe gets stronger: cached verdicts of a weaker probe are not reused.
PROBE_REVISION = 6

#: Magnitude of the cancelling pairs in :func:`cancelling_inputs` (see there).
_CANCELLING_SCALE = 2.0**12


@functools.lru_cache(maxsize=1)
def cancelling_inputs(
    rows: int, weight_shape: tuple[int, int], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs on which any change of summation order shows in the output, even in bfloat16.

    On random inputs a kernel whose float32 accumulation order depends on the row count
    changes a bfloat16 output only when the difference crosses a rounding boundary: about
    one element in ten thousand, so a probe on random inputs passes such a kernel most of
    the time (it did on the AMX tiles: ``F.linear`` for a ``32x64`` bf16 weight, then a
    broken verification). Here half the input columns hold large values that cancel in
    pairs (``x[:, p] = -x[:, q]`` and ``W[:, p] = W[:, q]``, so their products cancel
    exactly), and the small remainder is added onto partial sums ``2**12`` times larger:
    how much of it survives depends on where each term joins the sum, so a different
    order changes most outputs.

    The last call's pair is kept (every candidate of one weight shape is probed on the
    same pair, and drawing a ``14336 x 4096`` one took longer than some probes); callers
    must not modify it.

    Returns:
        ``x (rows, in)`` and ``weight (out, in)``, both in ``dtype``.
    """
    out_features, in_features = weight_shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    pairs = torch.randperm(in_features, generator=generator)[: in_features // 2 * 2].view(-1, 2)
    large = torch.randn(rows, pairs.shape[0], generator=generator) * _CANCELLING_SCALE
    x[:, pairs[:, 0]] = large
    x[:, pairs[:, 1]] = -large
    weight[:, pairs[:, 1]] = weight[:, pairs[:, 0]]
    return x.to(dtype), weight.to(dtype)


def _first_violation(
    kernel: Kernel,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counts: Sequence[int],
    *,
    rotate: bool,
) -> int | None:
    """The first ``m`` in ``counts`` (increasing) for which some row of ``kernel`` over the
    first ``m`` rows of ``x`` is not bitwise that row's one-row product, or None. With
    ``rotate``, also ``m`` rows starting further on (wrapping), so that each row sits at
    other positions beside other rows (at the counts of :data:`ROTATED_ROWS`). One-row
    products are made as needed, so a kernel that breaks at a few rows is refused after a
    few products."""
    most = x.shape[0]
    single: list[torch.Tensor] = []

    def alone(upto: int) -> torch.Tensor:
        while len(single) < upto:
            i = len(single)
            single.append(kernel(x[i : i + 1], weight, bias))
        return torch.cat(single[:upto])

    for m in counts:
        if not torch.equal(kernel(x[:m], weight, bias), alone(m)):
            return m
        if rotate and m in ROTATED_ROWS:
            order = (torch.arange(m) + m // 2 + 1) % most
            if not torch.equal(kernel(x[order], weight, bias), alone(most)[order]):
                return m
    return None


def first_violation(
    kernel: Kernel,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Iterable[int] = PROBE_ROWS,
    *,
    seed: int = 0,
) -> int | None:
    """The smallest row count in ``rows`` at which ``kernel`` changes some row's result
    from that row's one-row product (None: row-invariant at every count probed).

    Probed twice: on a weight of ``weight``'s shape and dtype with
    :func:`cancelling_inputs` (every count, each row also at other positions), which expose
    a changed summation order that random inputs hide in bfloat16; then on ``weight``
    itself with random inputs (a kernel may keep state per weight, as oneDNN's reordered
    copies do). A kernel's path depends on shapes and dtype, not values.
    """
    counts = sorted(set(rows))
    most = max(counts, default=1) + 1  # one spare row, so rotated blocks differ
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    x_cancel, w_cancel = cancelling_inputs(most, shape, weight.dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(most, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    with torch.inference_mode():
        cancel = _first_violation(
            kernel,
            x_cancel.to(weight.device),
            w_cancel.to(weight.device),
            bias,
            counts,
            rotate=True,
        )
        own = _first_violation(kernel, x, weight, bias, counts, rotate=False)
    found = [m for m in (cancel, own) if m is not None]
    return min(found) if found else None


def is_row_invariant(
    kernel: Kernel,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Iterable[int] = PROBE_ROWS,
    *,
    seed: int = 0,
) -> bool:
    """Whether ``kernel`` gives every row of an ``m``-row product bitwise the result of
    that row alone, at every position in the product, for each ``m`` in ``rows``
    (:func:`first_violation` finds none)."""
    return first_violation(kernel, weight, bias, rows, seed=seed) is None


__all__ = [
    "PROBE_REVISION",
    "PROBE_ROWS",
    "ROTATED_ROWS",
    "cancelling_inputs",
    "first_violation",
    "is_row_invariant",
]
