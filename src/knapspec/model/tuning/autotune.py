"""Kernel tables by measurement on this machine, cached per machine and model shape.

:func:`tune_kernel_table` times every candidate kernel of :mod:`knapspec.model.kernels.table`
for each linear role of the model (q, k, v, o, gate, up, down, LM head and the fused
q/k/v and gate/up products) and each row count ``1 .. SMALL_ROWS``, then keeps the fastest
per weight shape (ties within ``margin`` go to ``F.linear``), fuses a group only where the
fused product beats its parts, and finally checks the result with whole engine steps.
Products over ``SMALL_ROWS`` rows (a prefill, a batched verification) get a kernel per
shape too, ``F.linear`` or oneDNN's packed product, timed at 64 and 512 rows and checked
with a whole 256-token forward. oneDNN (:mod:`knapspec.model.kernels.onednn`) is tried only where
the build has it and its weight copies fit in a quarter of the machine's memory: where
the BLAS is slow at few rows it can beat the transposed kernel and ``F.linear`` on verify
steps and prefills alike (``results/engine/HISTORY.md``).

How it times matters. One cache-resident matrix timed in isolation gives the wrong answer:
the transposed kernel has looked slower than ``F.linear`` on a small matrix timed alone
where a whole decode step with it was faster (``results/engine/HISTORY.md``), because in
the model every weight streams from memory. So one *pass* multiplies every layer's weights of
the model in model order (all separate projections and the LM head; then, in a second
pass, all fused ones), far more data than any cache holds, and each call is timed inside
the pass. Then, for every row count of a decode, draft or verify step (``1 .. D + 1``),
whole engine steps run interleaved with the measured table, with the padded transposed
kernel everywhere (fused) and with plain ``F.linear``; the fastest whole step wins that
row count, and ``F.linear`` unless another beats it by ``margin``, so the engine is never
slower than its own ``F.linear`` path where it was checked.

The measuring and choosing live in :mod:`knapspec.model.tuning.timing`, the whole-step
checks in :mod:`knapspec.model.tuning.checks`; this module keys the result to the machine
and model, caches it and resolves the engine's choice (``$KNAPSPEC_KERNELS``). What first
use costs is bounded for 1-8B models: a timing pass streams the first layers (at least
``STREAM_BYTES``, every layer of a small model) and the LM head, and the whole-step checks
stop at a time budget (``VALIDATE_BUDGET_SECONDS``; the decode step first).

:func:`load_or_tune` caches the table under ``cache_root()/kernels/``, keyed by
:class:`KernelKey` (CPU model and flags, BLAS, torch version, threads, dtype, the model's
linear shapes): the first engine on a machine pays the measurement (once, with a progress
bar), later ones read a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from knapspec.model import cachefiles
from knapspec.model.kernels.onednn import (
    onednn_available,
    packing_fits,
    physical_memory_bytes,
    release_packed,
)
from knapspec.model.kernels.table import (
    FUSION_GROUPS,
    SMALL_ROWS,
    KernelTable,
    shape_name,
)
from knapspec.model.machine import blas_description, cpu_flags_digest, host_cpu_model
from knapspec.model.tuning.checks import (
    DEFAULT_VALIDATE_ROWS,
    StepCheck,
    merge_rows,
    validate_large,
    validate_table,
)
from knapspec.model.tuning.timing import (
    DEFAULT_MARGIN,
    LARGE_ROWS,
    LinearRole,
    Timer,
    candidate_kernels,
    choose_large,
    choose_table,
    linear_roles,
    measure_kernels,
    streamed_subset,
)
from knapspec.paths import cache_root

if TYPE_CHECKING:
    from knapspec.model.tuning.tunable import TunableEngine

#: Bump when the candidates or the measurement change, so that cached tables are re-tuned.
AUTOTUNE_REVISION = 4

#: Environment variable overriding the engine's default kernel choice
#: (``auto``, ``f.linear`` or ``transposed``; see :func:`resolve_kernel_table`).
KERNELS_ENV = "KNAPSPEC_KERNELS"


@attrs.frozen
class KernelKey:
    """What a kernel table depends on. Two machines or set-ups with equal keys share it."""

    host_cpu: str
    cpu_flags: str
    blas: str
    torch_version: str
    threads: int
    dtype: str
    model_shape: str
    max_rows: int
    revision: int = AUTOTUNE_REVISION
    #: Physical memory (GiB): whether oneDNN's reordered weight copies may be tried.
    memory_gib: int = 0

    @classmethod
    def for_engine(cls, engine: TunableEngine, max_rows: int = SMALL_ROWS) -> KernelKey:
        separate, fused = linear_roles(engine)
        shapes = ",".join(
            f"{role.name}:{shape_name(role.shape)}x{len(role.tensors)}"
            for role in (*separate, *fused)
        )
        return cls(
            host_cpu=host_cpu_model(),
            cpu_flags=cpu_flags_digest(),
            blas=blas_description(),
            torch_version=torch.__version__,
            threads=torch.get_num_threads(),
            dtype=str(engine.dtype).removeprefix("torch."),
            model_shape=f"{engine.config.model_type}-L{engine.num_layers}-{shapes}",
            max_rows=max_rows,
            memory_gib=physical_memory_bytes() // 2**30,
        )

    def digest(self) -> str:
        """Short stable hash of every field (the cache file name)."""
        text = json.dumps(attrs.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen
class TuneResult:
    """A measured table with what it was measured from (written to the cache file)."""

    key: KernelKey
    table: KernelTable
    seconds: float
    timings: dict[tuple[str, int, str], float]
    checks: tuple[StepCheck, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": attrs.asdict(self.key),
            "table": self.table.to_dict(),
            "seconds": self.seconds,
            "timings": [
                {"role": role, "rows": rows, "kernel": kernel, "seconds": seconds}
                for (role, rows, kernel), seconds in sorted(self.timings.items())
            ],
            "checks": [attrs.asdict(check) for check in self.checks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneResult:
        timings = {
            (t["role"], int(t["rows"]), t["kernel"]): float(t["seconds"]) for t in data["timings"]
        }
        return cls(
            key=KernelKey(**data["key"]),
            table=KernelTable.from_dict(data["table"]),
            seconds=float(data["seconds"]),
            timings=timings,
            checks=tuple(StepCheck(**check) for check in data["checks"]),
        )


def tune_kernel_table(
    engine: TunableEngine,
    *,
    max_rows: int = SMALL_ROWS,
    repeats: int = 2,
    margin: float = DEFAULT_MARGIN,
    validate_rows: Iterable[int] = DEFAULT_VALIDATE_ROWS,
    timer: Timer = time.perf_counter,
    progress: bool | None = None,
) -> TuneResult:
    """Measure, choose and check a table for ``engine`` on this machine (module docstring).

    ``timer`` is injectable for tests. The engine is left running the result.
    """
    start = time.perf_counter()
    separate, fused = linear_roles(engine)
    weight_bytes = sum(
        weight.numel() * weight.element_size() for role in separate for weight, _ in role.tensors
    )
    onednn = onednn_available() and packing_fits(weight_bytes)
    # One timed pass per kernel and row count (after a warm-up round): the whole-step
    # check below, not these per-product timings, has the last word. A pass streams the
    # first layers' weights (at least STREAM_BYTES) and the LM head, not a big model's all.
    sampled, sampled_fused = streamed_subset(separate, fused)
    timings = measure_kernels(
        sampled,
        sampled_fused,
        range(1, max_rows + 1),
        repeats=1,
        timer=timer,
        progress=progress,
        onednn=onednn,
    )
    measured = choose_table(timings, separate, fused, max_rows=max_rows, margin=margin)
    # Products over max_rows rows (prefill, batched verification): F.linear or oneDNN.
    large_timings = (
        measure_kernels(
            sampled, [], LARGE_ROWS, repeats=1, timer=timer, progress=progress, onednn=onednn
        )
        if onednn
        else {}
    )
    timings = {**timings, **large_timings}
    measured = measured.with_large(choose_large(large_timings, separate, margin=margin))
    # Per-product timings can mislead (module docstring): whole steps also try the one
    # uniform alternative that has won before, the padded transposed kernel everywhere.
    shapes = sorted({role.shape for role in (*separate, *fused)})
    uniform = attrs.evolve(
        KernelTable.uniform(shapes, "transposed-padded", fuse=bool(fused), max_rows=max_rows),
        source="measured",
    )
    table, checks = validate_table(
        engine,
        {"measured": measured, "transposed": uniform},
        validate_rows,
        repeats=repeats,
        margin=margin,
        timer=timer,
        progress=progress,
    )
    table, large_check = validate_large(
        engine, table.with_large(measured.large), repeats=repeats, margin=margin, timer=timer
    )
    # Timing packed every weight it tried: keep only the copies the chosen table runs.
    release_packed()
    engine.use_kernels(table)
    return TuneResult(
        key=KernelKey.for_engine(engine, max_rows),
        table=table,
        seconds=time.perf_counter() - start,
        timings=timings,
        checks=(*checks, *([large_check] if large_check is not None else [])),
    )


def kernel_table_path(key: KernelKey) -> Path:
    """``cache_root()/kernels/<model shape>-<key digest>.json``."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", key.model_shape.split("-", 1)[0])
    return cache_root() / "kernels" / f"{stem}-{key.digest()}.json"


def load_or_tune(
    engine: TunableEngine,
    *,
    progress: bool | None = None,
    tune: Callable[..., TuneResult] = tune_kernel_table,
) -> TuneResult:
    """The cached table for this machine and model shape, measured on first use.

    A bad cache file (truncated, garbage, another key or version) or an unwritable cache
    costs one warning and a measurement, never an error (:mod:`knapspec.model.cachefiles`).
    """
    key = KernelKey.for_engine(engine)

    def mismatch(cached: TuneResult) -> str | None:
        return None if cached.key == key else "was measured for another machine or version"

    return cachefiles.load_or_measure(
        kernel_table_path(key),
        parse=lambda text: TuneResult.from_dict(json.loads(text)),
        valid=mismatch,
        measure=lambda: tune(engine, progress=progress),
        render=lambda result: json.dumps(result.to_dict(), indent=1) + "\n",
        what="kernel table",
        measures="the matrix-product kernels on this model's weight shapes (about 20 s for "
        "SmolLM2-135M on a 2-core CPU)",
    )


def framework_only(engine: TunableEngine) -> bool:
    """True where the engine uses the framework's own products with nothing to tune:
    a non-CPU device, or a dtype other than float32 (bf16/fp16 then match the model's own
    products exactly)."""
    return engine.device.type != "cpu" or engine.dtype != torch.float32


def resolve_kernel_table(
    engine: TunableEngine, spec: KernelTable | str | None, *, progress: bool | None = None
) -> KernelTable:
    """The table an engine runs for ``spec``.

    ``spec``: a :class:`KernelTable` (used as given); ``"auto"`` (measured once per machine
    and model shape, then cached); ``"f.linear"`` (the framework's products, no fusion);
    ``"transposed"`` (engine revision r3's fixed choice: the padded transposed kernel for
    every few-row product, fused projections); None: ``$KNAPSPEC_KERNELS`` or ``"auto"``.
    On a non-CPU device or a non-float32 model, anything but an explicit table resolves to
    ``"f.linear"``.
    """
    if isinstance(spec, KernelTable):
        return spec
    name = spec if spec is not None else (os.environ.get(KERNELS_ENV) or "auto")
    if name not in ("auto", "f.linear", "transposed"):
        raise ValueError(
            f"kernels must be 'auto', 'f.linear', 'transposed' or a KernelTable, got {name!r}"
            + (f" (from ${KERNELS_ENV})" if spec is None else "")
        )
    if name == "f.linear":
        return KernelTable.plain()
    if framework_only(engine):
        return KernelTable.plain(source="framework")
    if name == "transposed":
        separate, fused = linear_roles(engine)
        shapes = sorted({role.shape for role in (*separate, *fused)})
        return KernelTable.uniform(shapes, "transposed-padded", fuse=True)
    return load_or_tune(engine, progress=progress).table


__all__ = [
    "AUTOTUNE_REVISION",
    "DEFAULT_MARGIN",
    "DEFAULT_VALIDATE_ROWS",
    "FUSION_GROUPS",
    "KERNELS_ENV",
    "KernelKey",
    "LinearRole",
    "StepCheck",
    "TuneResult",
    "candidate_kernels",
    "choose_table",
    "framework_only",
    "kernel_table_path",
    "linear_roles",
    "load_or_tune",
    "measure_kernels",
    "merge_rows",
    "resolve_kernel_table",
    "tune_kernel_table",
    "validate_table",
]
