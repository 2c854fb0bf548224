"""Row-invariant kernel tables: the linear half of the exactness contract.

A speculative decoder is exact only if verifying ``k`` tokens computes, for each, what a
one-token step computes (``docs/theory.md``, "The exactness contract"). For the linear
products that means: a kernel's output for a row must not depend on how many rows are in
the product. BLAS kernels do not promise it. On one CPU (``results/engine/HISTORY.md``) float32
``F.linear`` changed a row's result between 1 and 2 rows for every SmolLM2 weight shape,
while oneDNN's packed inner product and bfloat16 ``F.linear`` (oneDNN as well) kept every
row bitwise equal from 1 to 160 rows. Another CPU, BLAS or thread count may differ, so
nothing is assumed: every candidate is *probed* on the machine at hand, on the model's own
weights, and only kernels that pass may run.

:func:`row_invariant_table` turns a measured (or framework) table into one that keeps the
contract:

* per weight shape, one kernel for every row count, few and many (a batched verification
  may pack more than :data:`~knapspec.model.kernels.table.SMALL_ROWS` rows): each candidate (the
  table's own choices, oneDNN, ``F.linear``, the transposed ones) is probed as it is and,
  where that fails, in blocks of 32, 16, .. 2 rows (:func:`~knapspec.model.kernels.table.blocked`:
  on the AMX tiles bf16 ``F.linear`` has kept rows up to 32, so in blocks of 32 it keeps the
  contract there); among those that pass, the fastest by a timing of decode,
  verification and prefill sizes (:data:`TIMED_ROWS`) runs. The clock ranks every
  candidate and the probe runs fastest first until one passes (:func:`_choose`): the
  probe has the last word on what runs;
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.model import cachefiles
from knapspec.model.kernels.onednn import onednn_available, packing_fits, release_packed
from knapspec.model.kernels.row_linear import (
    amx_available,
    build_tag,
    packed_available,
    release_amx_packed,
)
from knapspec.model.kernels.row_linear import available as row_linear_available
from knapspec.model.kernels.table import (
    AMX_KERNEL,
    BLOCK_HEIGHTS,
    FUSION_GROUPS,
    KERNELS,
    ONEDNN_KERNEL,
    PACKED_KERNEL,
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
from knapspec.model.tuning.autotune import KernelKey
from knapspec.model.tuning.probe import (  # the probe lived here; its names are re-exported
    PROBE_REVISION,
    PROBE_ROWS,
    cancelling_inputs,
    first_violation,
    is_row_invariant,
)
from knapspec.model.tuning.timing import LinearRole, linear_roles
from knapspec.paths import cache_root

if TYPE_CHECKING:
    from knapspec.model.tuning.tunable import TunableEngine

logger = logging.getLogger(__name__)


@attrs.frozen
class InvarianceReport:
    """What :func:`row_invariant_table` probed and chose.

    Attributes:
        table: the row-invariant table.
        kernels: per shape name, the kernel it runs for every row count.
        failed: per shape name, the candidates that broke the contract here.
        fused: per fusion group, whether it runs fused (for every row count).
        timed: per shape name, each timed kernel's score in seconds (:data:`TIMED_ROWS`);
            the fastest that keeps the contract runs.
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
    table: KernelTable,
    shape: Shape,
    onednn: bool,
    compiled: bool = False,
    amx: bool = False,
    packed: bool = False,
) -> list[str]:
    """The unblocked kernels to probe for ``shape``, in order of preference (each is also
    tried in blocks where it fails as it is: :func:`_choose`); with ``compiled``, the
    compiled ``row-linear`` kernel too (row-invariant by construction, yet probed like the
    others: the probe has the last word); with ``amx``, its AMX-tile version too, with
    ``packed`` its packed-weight VDPBF16PS version."""
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
    if packed:
        ordered.append(PACKED_KERNEL)
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
#: a prefill term outweighed the decode rows and chose a kernel that was several times
#: slower at 1 row (``results/engine/HISTORY.md``).
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

    The clock ranks first and the probe decides, fastest first: every candidate is timed
    (:data:`TIMED_ROWS`), then probed in order of its time until one passes; a candidate
    that fails is tried in blocks (the tallest that pass), timed and ranked among the rest.
    The first to pass is the fastest kernel that keeps the contract, as if every candidate
    had been probed, at a fraction of the probes (a probe multiplies some 2,000 rows; at
    the widths of a 1-8B model, probing every candidate took most of an engine's first
    use). The first candidate (the table's own choice) is probed whatever its rank, so the
    report says whether what the clock chose keeps the contract.

    Returns:
        the kernel's name, the names that failed the probe, and each timed kernel's score
        in seconds (:data:`TIMED_ROWS`).
    """
    weight, bias = role.tensors[0]
    scores = {name: _score_seconds(KERNELS[name], weight, bias) for name in candidates}
    failed: list[str] = []
    verdicts: dict[str, bool] = {}

    def passes(name: str) -> bool:
        """Probe ``name`` (once); a failure queues its tallest passing blocks."""
        if name in verdicts:
            return verdicts[name]
        broke_at = first_violation(KERNELS[name], weight, bias)
        verdicts[name] = broke_at is None
        if broke_at is not None:
            failed.append(name)
            # Blocks as tall as the count that broke it would hold such a product: not tried.
            for height in (h for h in BLOCK_HEIGHTS if h < broke_at):
                blocked = blocked_name(name, height)
                if is_row_invariant(KERNELS[blocked], weight, bias):
                    verdicts[blocked] = True
                    scores[blocked] = _score_seconds(KERNELS[blocked], weight, bias)
                    break
                failed.append(blocked)
        return verdicts[name]

    if candidates:
        passes(candidates[0])
    while True:
        waiting = [n for n in scores if verdicts.get(n) is not False]
        if not waiting:
            return ROWWISE_KERNEL, tuple(failed), scores
        fastest = min(waiting, key=scores.__getitem__)
        if passes(fastest):
            return fastest, tuple(failed), scores


def _cache_path(engine: TunableEngine, table: KernelTable) -> Path:
    """Probe results depend on the machine, BLAS, threads, dtype and shapes (the kernel
    table's key) and on the table probed; not on the weights' values."""
    key = KernelKey.for_engine(engine)
    name = f"{key.digest()}-{table.fingerprint()}-p{PROBE_REVISION}{build_tag(engine.dtype)}"
    return cache_root() / "invariance" / f"{name}.json"


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
    packed: bool = False,
) -> _Verdicts:
    """Probe and time the candidates for every role's shape (:func:`_choose`)."""
    kernels: dict[str, str] = {}
    failed: dict[str, tuple[str, ...]] = {}
    timed: dict[str, dict[str, float]] = {}
    for role in roles:
        shape = shape_name(role.shape)
        if shape in kernels:
            continue
        candidates = _candidates(table, role.shape, onednn, compiled, amx, packed)
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
    packed = compiled and packed_available(engine.dtype)
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
                cached = _probe(roles, table, onednn, compiled, amx, packed)
                cachefiles.store(path, _render(cached), "row-invariance probe")
    elif path is None:
        cached = _probe(roles, table, onednn, compiled, amx, packed)
    assert cached is not None
    kernels = {parse_shape(shape): name for shape, name in cached[0].items()}
    failed = dict(cached[1])
    timed = dict(cached[2])
    _fuse_by_construction(separate, fused_roles, kernels, fuse)
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


def _fuse_by_construction(
    separate: Sequence[LinearRole],
    fused_roles: Sequence[LinearRole],
    kernels: dict[Shape, str],
    fuse: dict[str, bool],
) -> None:
    """Fuse each group whose parts all run ``row-linear``, or all ``packed-linear`` (in
    place: ``fuse`` and the fused shape's kernel). Those kernels compute every output
    element alone, the same arithmetic whatever the other outputs, so the fused product is
    bitwise its parts and the probe has nothing to decide; the group's one call instead of
    two or three saves a call's fixed cost per group and layer (more at more rows;
    ``results/engine/HISTORY.md``). (The AMX kernel is left out: its tiles win only at many
    rows, where nothing runs fused.)"""
    for role in fused_roles:
        parts = [part for part in separate if part.name in role.parts]
        if fuse.get(role.name) or len(parts) != len(role.parts):
            continue
        chosen = {kernels.get(part.shape, PLAIN_KERNEL) for part in parts}
        kernel = chosen.pop()
        if not chosen and kernel in (ROW_LINEAR_KERNEL, PACKED_KERNEL):
            fuse[role.name] = True
            kernels[role.shape] = kernel


__all__ = [
    "PROBE_REVISION",
    "PROBE_ROWS",
    "InvarianceReport",
    "cancelling_inputs",
    "first_violation",
    "is_row_invariant",
    "row_invariant_table",
]
