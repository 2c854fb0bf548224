"""Row-invariant kernel tables: the linear half of the exactness contract.

A speculative decoder is exact only if verifying ``k`` tokens computes, for each, what a
one-token step computes (``docs/theory.md``, "The exactness contract"). For the linear
products that means: a kernel's output for a row must not depend on how many rows are in
the product. BLAS kernels do not promise it. On a 2-core AMD EPYC (torch 2.13, MKL) float32
``F.linear`` changed a row's result between 1 and 2 rows for every SmolLM2 weight shape,
while oneDNN's packed inner product and bfloat16 ``F.linear`` (oneDNN as well) kept every
row bitwise equal from 1 to 160 rows. Another CPU, BLAS or thread count may differ, so
nothing is assumed: every candidate is *probed* on the machine at hand, on the model's own
weights, and only kernels that pass may run.

:func:`row_invariant_table` turns a measured (or framework) table into one that keeps the
contract:

* per weight shape, one kernel for every row count, few and many (a batched verification
  may pack more than :data:`~knapspec.model.kernels.SMALL_ROWS` rows), chosen as the first
  that passes the probe among: the table's own one-row choice (the decode step's, timed
  fastest there), the other kernels it uses, oneDNN, ``F.linear``, the transposed ones;
* per fusion group, one decision for every row count, products over ``max_rows`` rows
  included (a fused and an unfused product round differently);
* where nothing passes, ``rowwise``: each row its own one-row product. Exact by
  construction, slow for many rows; used only for the few-row products, and said once.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.model import cachefiles
from knapspec.model.autotune import KernelKey
from knapspec.model.kernel_timing import LinearRole, linear_roles
from knapspec.model.kernels import (
    BLOCK_HEIGHTS,
    FUSION_GROUPS,
    KERNELS,
    ONEDNN_KERNEL,
    PLAIN_KERNEL,
    ROWWISE_KERNEL,
    SMALL_ROWS,
    Kernel,
    KernelTable,
    Shape,
    blocked_name,
    parse_shape,
    shape_name,
)
from knapspec.model.onednn import onednn_available, packing_fits, release_packed
from knapspec.model.provision import cache_root

if TYPE_CHECKING:
    from knapspec.model.tunable import TunableEngine

logger = logging.getLogger(__name__)

#: Row counts every candidate is probed at (against each row's one-row product): every
#: few-row count of decoding, both sides of the block heights BLAS and oneDNN switch at (16,
#: 32, 64: on a 2-core Intel Xeon with AMX, bfloat16 ``F.linear`` kept every row up to 32
#: rows and changed them from 33), and packed batched-verification counts past them.
PROBE_ROWS: tuple[int, ...] = (*range(2, SMALL_ROWS + 1), 17, 24, 31, 32, 33, 48, 63, 64, 65, 96)

#: Bumped whenever the probe gets stronger: cached verdicts of a weaker probe are not reused.
PROBE_REVISION = 2

#: Magnitude of the cancelling pairs in :func:`cancelling_inputs` (see there).
_CANCELLING_SCALE = 2.0**12


def cancelling_inputs(
    rows: int, weight_shape: tuple[int, int], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs on which any change of summation order shows in the output, even in bfloat16.

    On random inputs a kernel whose float32 accumulation order depends on the row count
    changes a bfloat16 output only when the difference crosses a rounding boundary: about
    one element in ten thousand, so a probe on random inputs passes such a kernel most of
    the time (it did on an AMX Xeon: ``F.linear`` for a ``32x64`` bf16 weight, then a
    broken verification). Here half the input columns hold large values that cancel in
    pairs (``x[:, p] = -x[:, q]`` and ``W[:, p] = W[:, q]``, so their products cancel
    exactly), and the small remainder is added onto partial sums ``2**12`` times larger:
    how much of it survives depends on where each term joins the sum, so a different
    order changes most outputs.

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


def _keeps_rows(
    kernel: Kernel,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counts: Sequence[int],
) -> bool:
    """Whether every row of ``kernel`` over the first ``m`` rows of ``x`` (and over ``m``
    rows rotated so that each row also sits at other positions, beside other rows) is
    bitwise that row's one-row product, for each ``m`` in ``counts``."""
    most = x.shape[0]
    single = torch.cat([kernel(x[i : i + 1], weight, bias) for i in range(most)])
    for m in counts:
        if not torch.equal(kernel(x[:m], weight, bias), single[:m]):
            return False
        order = (torch.arange(m) + m // 2 + 1) % most  # a different slice, shifted
        if not torch.equal(kernel(x[order], weight, bias), single[order]):
            return False
    return True


def is_row_invariant(
    kernel: Kernel,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Iterable[int] = PROBE_ROWS,
    *,
    seed: int = 0,
) -> bool:
    """Whether ``kernel`` gives every row of an ``m``-row product bitwise the result of
    that row alone, at every position in the product, for each ``m`` in ``rows``.

    Probed twice: on ``weight`` itself with random inputs (a kernel may keep state per
    weight, as oneDNN's reordered copies do), and on a weight of the same shape and dtype
    with :func:`cancelling_inputs`, which expose a changed summation order that random
    inputs hide in bfloat16. The kernel's path depends on shapes and dtype, not values.
    """
    counts = sorted(set(rows))
    most = max(counts, default=1) + 1  # one spare row, so rotated blocks differ
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(most, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    x_cancel, w_cancel = cancelling_inputs(most, shape, weight.dtype, seed)
    with torch.inference_mode():
        return _keeps_rows(kernel, x, weight, bias, counts) and _keeps_rows(
            kernel, x_cancel.to(weight.device), w_cancel.to(weight.device), bias, counts
        )


@attrs.frozen
class InvarianceReport:
    """What :func:`row_invariant_table` probed and chose.

    Attributes:
        table: the row-invariant table.
        kernels: per shape name, the kernel it runs for every row count.
        failed: per shape name, the candidates that broke the contract here.
        fused: per fusion group, whether it runs fused (for every row count).
    """

    table: KernelTable
    kernels: dict[str, str]
    failed: dict[str, tuple[str, ...]]
    fused: dict[str, bool]

    def summary(self) -> str:
        """One line per shape: its kernel, and what failed the probe."""
        lines = []
        for shape, kernel in sorted(self.kernels.items()):
            failed = self.failed.get(shape, ())
            note = f" (not row-invariant here: {', '.join(failed)})" if failed else ""
            lines.append(f"{shape}: {kernel}{note}")
        for group, fused in sorted(self.fused.items()):
            lines.append(f"{group}: {'fused' if fused else 'separate'}")
        return "\n".join(lines)


def _candidates(table: KernelTable, shape: Shape, onednn: bool) -> list[str]:
    names = table.choices.get(shape, ())
    ordered = [*names[:1], *(name for name, _ in Counter(names).most_common())]
    if shape in table.large:
        ordered.append(table.large[shape])
    if table.is_plain:  # the framework's own products first where nothing was tuned
        ordered.append(PLAIN_KERNEL)
    if onednn:
        ordered.append(ONEDNN_KERNEL)
    ordered += [PLAIN_KERNEL, "transposed-padded", "transposed"]
    unique: list[str] = []
    for name in ordered:
        if name not in unique and name in KERNELS and (onednn or name != ONEDNN_KERNEL):
            unique.append(name)
    # Then the same kernels in blocks (tallest first): a kernel that keeps rows up to some
    # count is row-invariant at every count in blocks of that many rows.
    bases = [name for name in unique if name != ROWWISE_KERNEL and "/" not in name]
    return unique + [blocked_name(name, height) for height in BLOCK_HEIGHTS for name in bases]


def _choose(role: LinearRole, candidates: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    weight, bias = role.tensors[0]
    failed: list[str] = []
    for name in candidates:
        if is_row_invariant(KERNELS[name], weight, bias):
            return name, tuple(failed)
        failed.append(name)
    return ROWWISE_KERNEL, tuple(failed)


def _cache_path(engine: TunableEngine, table: KernelTable) -> Path:
    """Probe results depend on the machine, BLAS, threads, dtype and shapes (the kernel
    table's key) and on the table probed; not on the weights' values."""
    key = KernelKey.for_engine(engine)
    name = f"{key.digest()}-{table.fingerprint()}-p{PROBE_REVISION}.json"
    return cache_root() / "invariance" / name


def _parse_cached(text: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    data = json.loads(text)
    kernels = {str(k): str(v) for k, v in data["kernels"].items()}
    failed = {str(k): tuple(str(n) for n in v) for k, v in data["failed"].items()}
    unknown = set(kernels.values()) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}")
    return kernels, failed


def row_invariant_table(
    engine: TunableEngine, table: KernelTable, *, use_cache: bool = True
) -> InvarianceReport:
    """The row-invariant version of ``table`` for ``engine`` (module docstring); the probe's
    verdicts are cached per machine, model shape and table (``use_cache``)."""
    separate, fused_roles = linear_roles(engine)
    weight_bytes = sum(
        weight.numel() * weight.element_size() for role in separate for weight, _ in role.tensors
    )
    onednn = engine.device.type == "cpu" and onednn_available() and packing_fits(weight_bytes)
    max_rows = table.max_rows or SMALL_ROWS
    fuse = {
        group: Counter(table.fuse.get(group, (False,))).most_common(1)[0][0]
        for group in FUSION_GROUPS
    }
    roles = [*separate, *(role for role in fused_roles if fuse.get(role.name, False))]
    path = _cache_path(engine, table) if use_cache else None
    cached = (
        cachefiles.read(path, _parse_cached, "row-invariance probe") if path is not None else None
    )
    kernels: dict[Shape, str] = {}
    failed: dict[str, tuple[str, ...]] = {}
    if cached is not None and {shape_name(role.shape) for role in roles} == set(cached[0]):
        kernels = {parse_shape(shape): name for shape, name in cached[0].items()}
        failed = dict(cached[1])
    else:
        for role in roles:
            if role.shape in kernels:
                continue
            name, broken = _choose(role, _candidates(table, role.shape, onednn))
            kernels[role.shape] = name
            if broken:
                failed[shape_name(role.shape)] = broken
        release_packed()  # probing packed every weight it tried; the engine re-packs its own
        if path is not None:
            text = json.dumps(
                {
                    "kernels": {shape_name(s): n for s, n in kernels.items()},
                    "failed": {k: list(v) for k, v in failed.items()},
                }
            )
            cachefiles.store(path, text, "row-invariance probe")
    if all(name == PLAIN_KERNEL for name in kernels.values()) and not any(fuse.values()):
        exact = KernelTable.plain(source=f"{table.source}+row-invariant")
    else:
        exact = KernelTable(
            max_rows=max_rows,
            choices={shape: (name,) * max_rows for shape, name in kernels.items()},
            fuse={group: (flag,) * max_rows for group, flag in fuse.items()},
            # Every row count keeps the contract: a tree or a batch verifies more than
            # max_rows rows at once (a row-by-row prefill is slow, hence the warning below;
            # a blocked kernel of height 2 or more almost always passes instead).
            large=dict(kernels),
            source=f"{table.source}+row-invariant",
        )
    if failed:  # detail for the curious (the engine's invariance report keeps it too)
        logger.debug(
            "knapspec: kernels that are not row-invariant on this machine were set aside: %s",
            "; ".join(f"{shape}: {', '.join(names)}" for shape, names in sorted(failed.items())),
        )
    if ROWWISE_KERNEL in kernels.values():
        logger.warning(
            "knapspec: no row-invariant product kernel for some weights here; they run one "
            "row at a time (exact, slower verification)"
        )
    return InvarianceReport(
        table=exact,
        kernels={shape_name(shape): name for shape, name in kernels.items()},
        failed=failed,
        fused=fuse,
    )


__all__ = [
    "PROBE_REVISION",
    "PROBE_ROWS",
    "InvarianceReport",
    "cancelling_inputs",
    "is_row_invariant",
    "row_invariant_table",
]
