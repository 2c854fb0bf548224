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
    FUSION_GROUPS,
    KERNELS,
    ONEDNN_KERNEL,
    PLAIN_KERNEL,
    ROWWISE_KERNEL,
    SMALL_ROWS,
    Kernel,
    KernelTable,
    Shape,
    parse_shape,
    shape_name,
)
from knapspec.model.onednn import onednn_available, packing_fits, release_packed
from knapspec.model.provision import cache_root

if TYPE_CHECKING:
    from knapspec.model.tunable import TunableEngine

logger = logging.getLogger(__name__)

#: Row counts every candidate is probed at (against each row's one-row product): every
#: few-row count of decoding and a spread of the packed batched-verification counts.
PROBE_ROWS: tuple[int, ...] = (*range(2, SMALL_ROWS + 1), 17, 24, 33, 48, 64)


def is_row_invariant(
    kernel: Kernel,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: Iterable[int] = PROBE_ROWS,
    *,
    seed: int = 0,
) -> bool:
    """Whether ``kernel`` gives every row of an ``m``-row product bitwise the result of
    that row alone, for each ``m`` in ``rows`` (random inputs in the weight's dtype)."""
    counts = sorted(set(rows))
    most = max(counts, default=1)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(most, weight.shape[1], generator=generator).to(weight.dtype)
    with torch.inference_mode():
        single = torch.cat([kernel(x[i : i + 1], weight, bias) for i in range(most)])
        return all(torch.equal(kernel(x[:m], weight, bias), single[:m]) for m in counts)


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
    return unique


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
    return cache_root() / "invariance" / f"{key.digest()}-{table.fingerprint()}.json"


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
            # A row-by-row product over hundreds of rows (a prefill) would crawl: there
            # the table's own large kernel runs, and only few-row products are exact.
            large={
                shape: (name if name != ROWWISE_KERNEL else table.large.get(shape, PLAIN_KERNEL))
                for shape, name in kernels.items()
            },
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


__all__ = ["PROBE_ROWS", "InvarianceReport", "is_row_invariant", "row_invariant_table"]
