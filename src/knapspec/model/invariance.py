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
  may pack more than :data:`~knapspec.model.kernels.SMALL_ROWS` rows): each candidate (the
  table's own choices, oneDNN, ``F.linear``, the transposed ones) is probed as it is and,
  where that fails, in blocks of 32, 16, .. 2 rows (:func:`~knapspec.model.kernels.blocked`:
  on an AMX Xeon bf16 ``F.linear`` keeps rows up to 32, so in blocks of 32 it keeps the
  contract on the AMX tiles); among those that pass, the fastest by a timing of decode,
  verification and prefill sizes (:data:`TIMED_ROWS`) runs. The probe has the last word,
  the clock only ranks what it let through;
* per fusion group, one decision for every row count, products over ``max_rows`` rows
  included (a fused and an unfused product round differently);
* where nothing passes, ``rowwise``: each row its own one-row product. Exact by
  construction, slow for many rows; used only for the few-row products, and said once.
"""

from __future__ import annotations

import json
import logging
import time
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
    AMX_KERNEL,
    BLOCK_HEIGHTS,
    FUSION_GROUPS,
    KERNELS,
    ONEDNN_KERNEL,
    PLAIN_KERNEL,
    ROW_LINEAR_KERNEL,
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
from knapspec.model.row_linear import LIBRARY as ROW_LINEAR_LIBRARY
from knapspec.model.row_linear import amx_available, release_amx_packed
from knapspec.model.row_linear import available as row_linear_available

if TYPE_CHECKING:
    from knapspec.model.tunable import TunableEngine

logger = logging.getLogger(__name__)

#: Row counts every candidate is probed at (against each row's one-row product): every
#: few-row count of decoding, both sides of the block heights BLAS and oneDNN switch at (16,
#: 32, 64: on a 2-core Intel Xeon with AMX, bfloat16 ``F.linear`` kept every row up to 32
#: rows and changed them from 33), and packed batched-verification counts past them.
PROBE_ROWS: tuple[int, ...] = (*range(2, SMALL_ROWS + 1), 17, 24, 31, 32, 33, 48, 63, 64, 65, 96)

#: Row counts at which the probe also shifts every row to other positions beside other rows
#: (a kernel whose result depends on a row's place in its block); each new row count costs
#: oneDNN a new primitive, so not at every count.
ROTATED_ROWS: frozenset[int] = frozenset({3, 8, 16, 17, 32, 33, 64, 96})

#: Bumped whenever the probe gets stronger: cached verdicts of a weaker probe are not reused.
PROBE_REVISION = 6

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
            kernel, x_cancel.to(weight.device), w_cancel.to(weight.device), bias, counts,
            rotate=True,
        )  # fmt: skip
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


@attrs.frozen
class InvarianceReport:
    """What :func:`row_invariant_table` probed and chose.

    Attributes:
        table: the row-invariant table.
        kernels: per shape name, the kernel it runs for every row count.
        failed: per shape name, the candidates that broke the contract here.
        fused: per fusion group, whether it runs fused (for every row count).
        timed: per shape name where several kernels kept the contract, each one's score in
            seconds (:data:`TIMED_ROWS`); the fastest runs.
    """

    table: KernelTable
    kernels: dict[str, str]
    failed: dict[str, tuple[str, ...]]
    fused: dict[str, bool]
    timed: dict[str, dict[str, float]] = attrs.field(factory=dict)

    def summary(self) -> str:
        """One line per shape: its kernel, and what failed the probe."""
        lines = []
        for shape, kernel in sorted(self.kernels.items()):
            failed = self.failed.get(shape, ())
            note = f" (not row-invariant here: {', '.join(failed)})" if failed else ""
            scores = self.timed.get(shape, {})
            if scores:
                timing = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in sorted(scores.items()))
                note += f" [timed: {timing}]"
            lines.append(f"{shape}: {kernel}{note}")
        for group, fused in sorted(self.fused.items()):
            lines.append(f"{group}: {'fused' if fused else 'separate'}")
        return "\n".join(lines)


def _candidates(
    table: KernelTable, shape: Shape, onednn: bool, compiled: bool = False, amx: bool = False
) -> list[str]:
    """The unblocked kernels to probe for ``shape``, in order of preference (each is also
    tried in blocks where it fails as it is: :func:`_choose`); with ``compiled``, the
    compiled ``row-linear`` kernel too (row-invariant by construction, yet probed like the
    others: the probe has the last word); with ``amx``, its AMX-tile version too."""
    names = table.choices.get(shape, ())
    ordered = [*names[:1], *(name for name, _ in Counter(names).most_common())]
    if shape in table.large:
        ordered.append(table.large[shape])
    if table.is_plain:  # the framework's own products first where nothing was tuned
        ordered.append(PLAIN_KERNEL)
    if onednn:
        ordered.append(ONEDNN_KERNEL)
    ordered += [PLAIN_KERNEL, "transposed-padded", "transposed"]
    if compiled:
        ordered.append(ROW_LINEAR_KERNEL)
    if amx:
        ordered.append(AMX_KERNEL)
    unique: list[str] = []
    for name in ordered:
        base = name.partition("/")[0]
        if (
            base not in unique
            and base in KERNELS
            and base != ROWWISE_KERNEL
            and (onednn or base != ONEDNN_KERNEL)
        ):
            unique.append(base)
    return unique


#: Row counts a kernel that keeps the contract is timed at, and the weight of each in its
#: score, roughly how often decoding runs it: one row in every plain decode step and in
#: every speculative step that drafts nothing (γ = 0, common where nothing pays), 4 and 8
#: rows in lookup verifications, 16 in a draft-model or tree verification, 64 in a packed
#: batch. A cold prefill is not scored: it runs the measured kernels (``SublayerEngine``);
#: a prefill term outweighed the decode rows and chose a kernel 2-3x slower at 1 row on an
#: AMX Xeon.
TIMED_ROWS: dict[int, float] = {1: 4.0, 4: 1.0, 8: 0.5, 16: 0.25, 64: 1 / 32}


def _score_seconds(kernel: Kernel, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """The weighted sum over :data:`TIMED_ROWS` of ``kernel``'s best-of-five seconds."""
    total = 0.0
    with torch.inference_mode():
        for rows, share in TIMED_ROWS.items():
            x = torch.randn(rows, weight.shape[1]).to(weight.device, weight.dtype)
            kernel(x, weight, bias)  # warm-up (oneDNN reorders a weight on first use)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                kernel(x, weight, bias)
                best = min(best, time.perf_counter() - start)
            total += share * best
    return total


def _choose(
    role: LinearRole, candidates: Sequence[str]
) -> tuple[str, tuple[str, ...], dict[str, float]]:
    """The fastest kernel that keeps the contract for ``role``: each candidate as it is, or
    else in the tallest blocks (:data:`BLOCK_HEIGHTS`) that pass; rowwise where none does.

    Returns:
        the kernel's name, the names that failed the probe, and each passing kernel's
        score in seconds (:data:`TIMED_ROWS`; empty when only one passed).
    """
    weight, bias = role.tensors[0]
    failed: list[str] = []
    passing: list[str] = []
    for base in candidates:
        broke_at = first_violation(KERNELS[base], weight, bias)
        if broke_at is None:
            passing.append(base)
            continue
        failed.append(base)
        # Blocks as tall as the count that broke it would hold such a product: not tried.
        for height in (h for h in BLOCK_HEIGHTS if h < broke_at):
            name = blocked_name(base, height)
            if is_row_invariant(KERNELS[name], weight, bias):
                passing.append(name)
                break
            failed.append(name)
    if not passing:
        return ROWWISE_KERNEL, tuple(failed), {}
    if len(passing) == 1:
        return passing[0], tuple(failed), {}
    scores = {name: _score_seconds(KERNELS[name], weight, bias) for name in passing}
    return min(passing, key=scores.__getitem__), tuple(failed), scores


def _cache_path(engine: TunableEngine, table: KernelTable) -> Path:
    """Probe results depend on the machine, BLAS, threads, dtype and shapes (the kernel
    table's key) and on the table probed; not on the weights' values."""
    key = KernelKey.for_engine(engine)
    name = f"{key.digest()}-{table.fingerprint()}-p{PROBE_REVISION}"
    if row_linear_available(engine.dtype):  # a changed compiled kernel is probed afresh
        name += "-" + ROW_LINEAR_LIBRARY.path().stem.rpartition("-")[2][:8]
    name += ".json"
    return cache_root() / "invariance" / name


#: Probe verdicts: per shape name the kernel, the candidates that failed, the timings.
_Verdicts = tuple[dict[str, str], dict[str, tuple[str, ...]], dict[str, dict[str, float]]]


def _parse_cached(text: str) -> _Verdicts:
    data = json.loads(text)
    kernels = {str(k): str(v) for k, v in data["kernels"].items()}
    failed = {str(k): tuple(str(n) for n in v) for k, v in data["failed"].items()}
    timed = {
        str(k): {str(n): float(t) for n, t in v.items()} for k, v in data.get("timed", {}).items()
    }
    unknown = set(kernels.values()) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}")
    return kernels, failed, timed


def _probe(
    roles: Sequence[LinearRole],
    table: KernelTable,
    onednn: bool,
    compiled: bool,
    amx: bool,
) -> _Verdicts:
    """Probe and time the candidates for every role's shape (:func:`_choose`)."""
    kernels: dict[str, str] = {}
    failed: dict[str, tuple[str, ...]] = {}
    timed: dict[str, dict[str, float]] = {}
    for role in roles:
        shape = shape_name(role.shape)
        if shape in kernels:
            continue
        candidates = _candidates(table, role.shape, onednn, compiled, amx)
        kernels[shape], broken, scores = _choose(role, candidates)
        if broken:
            failed[shape] = broken
        if scores:
            timed[shape] = scores
    release_packed()  # probing packed every weight it tried; the engine re-packs its own
    release_amx_packed()
    return kernels, failed, timed


def _render(verdicts: _Verdicts) -> str:
    kernels, failed, timed = verdicts
    return json.dumps(
        {"kernels": kernels, "failed": {k: list(v) for k, v in failed.items()}, "timed": timed}
    )


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
    compiled = engine.device.type == "cpu" and row_linear_available(engine.dtype)
    amx = compiled and amx_available(engine.dtype)
    max_rows = table.max_rows or SMALL_ROWS
    fuse = {
        group: Counter(table.fuse.get(group, (False,))).most_common(1)[0][0]
        for group in FUSION_GROUPS
    }
    roles = [*separate, *(role for role in fused_roles if fuse.get(role.name, False))]
    path = _cache_path(engine, table) if use_cache else None
    wanted = {shape_name(role.shape) for role in roles}

    def usable(cached: _Verdicts | None) -> bool:
        return cached is not None and wanted == set(cached[0])

    cached = cachefiles.read(path, _parse_cached, "row-invariance probe") if path else None
    if path is not None and not usable(cached):
        # Two processes starting on an empty cache: one probes, the other reads its
        # verdicts (probing both at once, each timing under the other's load, could choose
        # different kernels, and so different numerics, in each).
        with cachefiles.exclusive(path):
            cached = cachefiles.read(path, _parse_cached, "row-invariance probe", quiet=True)
            if not usable(cached):
                cached = _probe(roles, table, onednn, compiled, amx)
                cachefiles.store(path, _render(cached), "row-invariance probe")
    elif path is None:
        cached = _probe(roles, table, onednn, compiled, amx)
    assert cached is not None
    kernels = {parse_shape(shape): name for shape, name in cached[0].items()}
    failed = dict(cached[1])
    timed = dict(cached[2])
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
            "kernels that are not row-invariant on this machine were set aside: %s",
            "; ".join(f"{shape}: {', '.join(names)}" for shape, names in sorted(failed.items())),
        )
    if ROWWISE_KERNEL in kernels.values():
        logger.warning(
            "no row-invariant product kernel for some weights here; they run one "
            "row at a time (exact, slower verification)"
        )
    return InvarianceReport(
        table=exact,
        kernels={shape_name(shape): name for shape, name in kernels.items()},
        failed=failed,
        fused=fuse,
        timed=timed,
    )


__all__ = [
    "PROBE_REVISION",
    "PROBE_ROWS",
    "InvarianceReport",
    "cancelling_inputs",
    "first_violation",
    "is_row_invariant",
    "row_invariant_table",
]
