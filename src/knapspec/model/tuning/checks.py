"""Checking a kernel table with whole engine steps (the last word on what
:mod:`knapspec.model.tuning.timing`'s per-product timings chose;
:mod:`knapspec.model.tuning.autotune` explains why per-product timings can mislead).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from tqdm.auto import tqdm

from knapspec.model.kernels.table import (
    FUSION_GROUPS,
    PLAIN_KERNEL,
    SMALL_ROWS,
    KernelTable,
)
from knapspec.model.tuning.timing import DEFAULT_MARGIN, Timer, linear_roles

if TYPE_CHECKING:
    from knapspec.model.tuning.tunable import TunableEngine

#: Rows of the steps checked end to end: decode (1) to verify of the default ``D = 10``.
DEFAULT_VALIDATE_ROWS = tuple(range(1, 12))

#: Tokens of the whole step that checks the choice for large products (a short prefill).
LARGE_CHECK_ROWS = 256

#: The most weight-elements x tokens that check may multiply (SmolLM2 and 0.6B models run
#: the full 256 tokens; bigger ones fewer, never fewer than ``SMALL_ROWS + 1``).
LARGE_CHECK_BUDGET = 1.6e11

#: Wall seconds :func:`validate_table` aims at: row counts are checked in order of how
#: often decoding runs them (:func:`_check_order`) until it is spent; the rest keep the
#: measured table's choice. SmolLM2's checks take a few seconds; a 3B float32 model's
#: whole steps take over a second each, nine per row count.
VALIDATE_BUDGET_SECONDS = 20.0


def merge_rows(base: KernelTable, rows: Mapping[int, KernelTable]) -> KernelTable:
    """``base`` with each listed row count taken from its own table (kernels and fusion)."""
    shapes = set(base.choices)
    for table in rows.values():
        shapes |= set(table.choices)
    choices = {
        shape: tuple(rows.get(r, base).kernel(shape, r) for r in range(1, base.max_rows + 1))
        for shape in shapes
    }
    fuse = {
        group: tuple(rows.get(r, base).fused(group, r) for r in range(1, base.max_rows + 1))
        for group in FUSION_GROUPS
    }
    return attrs.evolve(base, choices=choices, fuse=fuse)


def _disabled(progress: bool | None) -> bool | None:
    """tqdm's ``disable``: None shows the bar only on a terminal."""
    return None if progress is None else not progress


@attrs.frozen
class StepCheck:
    """Whole engine steps of ``rows`` tokens: median seconds with each candidate table
    (``f.linear`` among them) and the one chosen for this row count."""

    rows: int
    seconds: dict[str, float]
    chosen: str


@torch.inference_mode()
def validate_large(
    engine: TunableEngine,
    table: KernelTable,
    *,
    rows: int = LARGE_CHECK_ROWS,
    repeats: int = 2,
    margin: float = DEFAULT_MARGIN,
    timer: Timer = time.perf_counter,
) -> tuple[KernelTable, StepCheck | None]:
    """Keep ``table``'s kernels for large products only if a whole ``rows``-token forward
    (a short prefill) with them beats the same table without them by ``margin``
    (interleaved, medians); the check is None when ``table`` has none. The engine is left
    running the result."""
    if not table.large:
        engine.use_kernels(table)
        return table, None
    separate, _ = linear_roles(engine)
    elements = sum(weight.numel() for role in separate for weight, _ in role.tensors)
    rows = min(rows, int(LARGE_CHECK_BUDGET // max(elements, 1)))
    rows = max(SMALL_ROWS + 1, min(rows, engine.max_context))
    without = table.with_large({})
    tables = {PLAIN_KERNEL: without, "large": table}
    ids = torch.randint(0, engine.vocab_size, (rows,), generator=torch.Generator().manual_seed(0))
    seconds: dict[str, list[float]] = {name: [] for name in tables}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, candidate in tables.items():
            engine.use_kernels(candidate)
            cache = engine.new_cache(rows)
            start = timer()
            engine.forward(ids, 0, cache, all_logits=False)
            if repeat:
                seconds[name].append(timer() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    chosen = "large" if medians["large"] < (1 - margin) * medians[PLAIN_KERNEL] else PLAIN_KERNEL
    result = tables[chosen]
    engine.use_kernels(result)
    return result, StepCheck(rows, medians, chosen)


def _check_order(rows: Sequence[int]) -> list[int]:
    """``rows`` in the order :func:`validate_table` checks them: a decode step (1 row, the
    most frequent), powers of two (lookup and draft verifications), the widest, the rest
    ascending."""
    unique = sorted(set(rows))
    first = [r for r in unique if r & (r - 1) == 0]
    if unique and unique[-1] not in first:
        first.append(unique[-1])
    return first + [r for r in unique if r not in first]


@torch.inference_mode()
def validate_table(
    engine: TunableEngine,
    candidates: Mapping[str, KernelTable],
    rows: Iterable[int] = DEFAULT_VALIDATE_ROWS,
    *,
    context: int = 128,
    repeats: int = 2,
    margin: float = DEFAULT_MARGIN,
    timer: Timer = time.perf_counter,
    progress: bool | None = None,
    budget_seconds: float | None = VALIDATE_BUDGET_SECONDS,
) -> tuple[KernelTable, list[StepCheck]]:
    """Choose per row count among whole tables by timing whole engine steps.

    Each row count's step runs with every table of ``candidates`` and with plain
    ``F.linear`` (interleaved, after ``context`` cached tokens); the fastest wins if it
    beats ``F.linear`` by ``margin``, else ``F.linear`` unfused runs that row count. Row
    counts are checked in :func:`_check_order` until ``budget_seconds`` (wall clock;
    None: no limit) is spent, at least one. The first candidate supplies the rows not
    checked. The engine is left running the result.
    """
    tables = {PLAIN_KERNEL: KernelTable.plain(), **candidates}
    base = next(iter(candidates.values()))
    rows = _check_order([r for r in rows if 1 <= r <= base.max_rows])
    began = time.perf_counter()
    context = max(1, min(context, engine.max_context - max(rows, default=1) - 1))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, engine.vocab_size, (context + max(rows, default=1),), generator=generator
    )
    cache = engine.new_cache(ids.numel())
    engine.use_kernels(tables[PLAIN_KERNEL])
    engine.forward(ids[:context], 0, cache, all_logits=False)
    checks: list[StepCheck] = []
    bar = tqdm(rows, desc="checking kernel choice", unit="rows", disable=_disabled(progress))
    for index, count in enumerate(bar):
        step = ids[context : context + count]
        seconds: dict[str, list[float]] = {name: [] for name in tables}
        warmup = 1 if index == 0 else 0
        for repeat in range(repeats + warmup):
            for name, candidate in tables.items():
                engine.use_kernels(candidate)
                start = timer()
                engine.forward(step, context, cache)
                elapsed = timer() - start
                cache.crop(context)
                if repeat >= warmup:
                    seconds[name].append(elapsed)
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        best = min(candidates, key=lambda name: medians[name])
        chosen = best if medians[best] < (1 - margin) * medians[PLAIN_KERNEL] else PLAIN_KERNEL
        checks.append(StepCheck(count, medians, chosen))
        if budget_seconds is not None and time.perf_counter() - began > budget_seconds:
            break
    bar.close()
    result = merge_rows(base, {check.rows: tables[check.chosen] for check in checks})
    engine.use_kernels(result)
    return result, checks


__all__ = [
    "DEFAULT_VALIDATE_ROWS",
    "LARGE_CHECK_BUDGET",
    "LARGE_CHECK_ROWS",
    "VALIDATE_BUDGET_SECONDS",
    "StepCheck",
    "merge_rows",
    "validate_large",
    "validate_table",
]
