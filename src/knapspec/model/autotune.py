"""Kernel tables by measurement on this machine, cached per machine and model shape.

:func:`tune_kernel_table` times every candidate kernel of :mod:`knapspec.model.kernels`
for each linear role of the model (q, k, v, o, gate, up, down, LM head and the fused
q/k/v and gate/up products) and each row count ``1 .. SMALL_ROWS``, then keeps the fastest
per weight shape (ties within ``margin`` go to ``F.linear``), fuses a group only where the
fused product beats its parts, and finally checks the result with whole engine steps.

How it times matters. One cache-resident matrix timed in isolation gives the wrong answer:
on a 2-core AMD EPYC the transposed kernel looks 0.7-0.85x as fast as ``F.linear`` on a
small matrix timed alone, yet a whole decode step with it is 1.6x faster, because in the
model every weight streams from memory. So one *pass* multiplies every layer's weights of
the model in model order (all separate projections and the LM head; then, in a second
pass, all fused ones), far more data than any cache holds, and each call is timed inside
the pass. Then, for every row count of a decode, draft or verify step (``1 .. D + 1``),
whole engine steps run interleaved with the measured table, with the padded transposed
kernel everywhere (fused) and with plain ``F.linear``; the fastest whole step wins that
row count, and ``F.linear`` unless another beats it by ``margin``, so the engine is never
slower than its own ``F.linear`` path where it was checked.

:func:`load_or_tune` caches the table under ``cache_root()/kernels/``, keyed by
:class:`KernelKey` (CPU model and flags, BLAS, torch version, threads, dtype, the model's
linear shapes): the first engine on a machine pays the measurement (about 10 s for
SmolLM2-135M on a 2-core CPU, with a progress bar), later ones read a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn
from tqdm.auto import tqdm

from knapspec.model.kernels import (
    FUSION_GROUPS,
    KERNELS,
    PLAIN_KERNEL,
    SMALL_ROWS,
    KernelTable,
    Shape,
    padded_rows,
    shape_name,
)
from knapspec.model.machine import blas_description, cpu_flags_digest, host_cpu_model
from knapspec.model.provision import cache_root

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

#: Bump when the candidates or the measurement change, so that cached tables are re-tuned.
AUTOTUNE_REVISION = 2

#: Environment variable overriding the engine's default kernel choice
#: (``auto``, ``f.linear`` or ``transposed``; see :func:`resolve_kernel_table`).
KERNELS_ENV = "KNAPSPEC_KERNELS"

#: Relative margin within which two timings count as a tie (the tie goes to ``F.linear``,
#: or to separate products for fusion).
DEFAULT_MARGIN = 0.03

#: Rows of the steps checked end to end: decode (1) to verify of the default ``D = 10``.
DEFAULT_VALIDATE_ROWS = tuple(range(1, 12))

Timer = Callable[[], float]
#: ``(role, rows, kernel) -> seconds`` of one pass (the role summed over all layers).
Timings = Mapping[tuple[str, int, str], float]


@attrs.frozen
class LinearRole:
    """One linear role of the model: its weight shape and every layer's ``(weight, bias)``.

    Attributes:
        name: ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``, ``lm_head``, or a fusion
            group (``qkv``, ``gate_up``).
        shape: ``(out_features, in_features)``.
        tensors: one ``(weight, bias)`` per layer (one for the LM head).
        parts: for a fusion group, the roles it fuses.
    """

    name: str
    shape: Shape
    tensors: tuple[tuple[torch.Tensor, torch.Tensor | None], ...]
    parts: tuple[str, ...] = ()


def linear_roles(engine: SublayerEngine) -> tuple[list[LinearRole], list[LinearRole]]:
    """The engine's plain ``nn.Linear`` roles in model order: ``(separate, fused)``.

    A role is listed only when every layer has it as a plain, equally shaped ``nn.Linear``
    (a quantised or hooked layer runs as itself and has nothing to tune).
    """
    paths = {
        "q": ("self_attn", "q_proj"),
        "k": ("self_attn", "k_proj"),
        "v": ("self_attn", "v_proj"),
        "o": ("self_attn", "o_proj"),
        "gate": ("mlp", "gate_proj"),
        "up": ("mlp", "up_proj"),
        "down": ("mlp", "down_proj"),
    }
    separate: list[LinearRole] = []
    for name, (block, attribute) in paths.items():
        modules = [getattr(getattr(layer, block), attribute, None) for layer in engine.layers]
        role = _role(name, modules)
        if role is not None:
            separate.append(role)
    head = _role("lm_head", [engine.lm_head])
    if head is not None:
        separate.append(head)
    fused: list[LinearRole] = []
    for group, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        projections = engine.fusions(group)
        if projections and all(p is not None for p in projections):
            tensors = tuple((p.weight, p.bias) for p in projections if p is not None)
            shapes = {(int(w.shape[0]), int(w.shape[1])) for w, _ in tensors}
            if len(shapes) == 1:
                fused.append(LinearRole(group, shapes.pop(), tensors, parts))
    return separate, fused


def _role(name: str, modules: Sequence[nn.Module | None]) -> LinearRole | None:
    if not modules or any(type(m) is not nn.Linear for m in modules):
        return None
    linears = [m for m in modules if isinstance(m, nn.Linear)]
    shapes = {(m.out_features, m.in_features) for m in linears}
    if len(shapes) != 1:
        return None
    return LinearRole(name, shapes.pop(), tuple((m.weight, m.bias) for m in linears))


def candidate_kernels(rows: int) -> tuple[str, ...]:
    """Kernels worth timing for ``rows`` rows (padding only changes 1 and 3 rows)."""
    names = [PLAIN_KERNEL, "transposed"]
    if padded_rows(rows) != rows:
        names.append("transposed-padded")
    return tuple(names)


@torch.inference_mode()
def measure_kernels(
    separate: Sequence[LinearRole],
    fused: Sequence[LinearRole],
    rows: Iterable[int],
    *,
    repeats: int = 1,
    warmup: int = 1,
    timer: Timer = time.perf_counter,
    progress: bool | None = None,
) -> dict[tuple[str, int, str], float]:
    """Median seconds of each role for each row count and candidate kernel.

    One pass runs one kernel over every tensor of ``separate`` in model order (layer by
    layer, then the LM head), another over every tensor of ``fused`` (the fused weights are
    the same memory as their parts, so the two never share a pass); each call is timed on
    its own and summed per role. Kernels are interleaved within each repeat so that drift
    affects them alike; ``warmup`` rounds run once, before the first row count.
    """
    rows = list(rows)
    passes = [_model_order(separate), _model_order(fused)]
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    timings: dict[tuple[str, int, str], list[float]] = {}
    bar = tqdm(rows, desc="tuning linear kernels", unit="rows", disable=_disabled(progress))
    for index, count in enumerate(bar):
        for repeat in range(repeats + (warmup if index == 0 else 0)):
            for kernel_name in candidate_kernels(count):
                kernel = KERNELS[kernel_name]
                for calls in passes:
                    totals: dict[str, float] = {}
                    for name, weight, bias in calls:
                        x = inputs.get((count, weight.shape[1]))
                        if x is None:
                            x = torch.randn(1, count, weight.shape[1], dtype=weight.dtype)
                            inputs[(count, weight.shape[1])] = x
                        start = timer()
                        kernel(x, weight, bias)
                        totals[name] = totals.get(name, 0.0) + timer() - start
                    if repeat >= (warmup if index == 0 else 0):
                        for name, seconds in totals.items():
                            timings.setdefault((name, count, kernel_name), []).append(seconds)
    bar.close()
    return {key: statistics.median(values) for key, values in timings.items()}


def _model_order(
    roles: Sequence[LinearRole],
) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """Every ``(role, weight, bias)`` in the order a forward reads them: layer by layer
    (roles with one tensor, the LM head, last)."""
    layers = max((len(role.tensors) for role in roles), default=0)
    calls = []
    for layer in range(layers):
        for role in roles:
            if len(role.tensors) == layers:
                calls.append((role.name, *role.tensors[layer]))
    for role in roles:
        if len(role.tensors) != layers:
            calls.extend((role.name, weight, bias) for weight, bias in role.tensors)
    return calls


def _disabled(progress: bool | None) -> bool | None:
    """tqdm's ``disable``: None shows the bar only on a terminal."""
    return None if progress is None else not progress


def choose_table(
    timings: Timings,
    separate: Sequence[LinearRole],
    fused: Sequence[LinearRole],
    *,
    max_rows: int = SMALL_ROWS,
    margin: float = DEFAULT_MARGIN,
) -> KernelTable:
    """The table :func:`measure_kernels`' ``timings`` imply.

    Per weight shape and row count, the kernel with the least time summed over the roles of
    that shape; ``F.linear`` unless another is faster by more than ``margin``. A fusion
    group runs fused for a row count when its fused product, with its shape's kernel, beats
    the sum of its parts with theirs by more than ``margin``. Row counts without timings
    run ``F.linear`` unfused.
    """
    by_shape: dict[Shape, list[str]] = {}
    for role in (*separate, *fused):
        by_shape.setdefault(role.shape, []).append(role.name)
    choices: dict[Shape, list[str]] = {}
    for shape, names in by_shape.items():
        chosen = []
        for rows in range(1, max_rows + 1):
            totals = {
                kernel: sum(timings[(name, rows, kernel)] for name in names)
                for kernel in KERNELS
                if all((name, rows, kernel) in timings for name in names)
            }
            chosen.append(_fastest(totals, margin))
        choices[shape] = chosen
    roles = {role.name: role for role in (*separate, *fused)}
    fuse: dict[str, list[bool]] = {}
    for group in fused:
        flags = []
        for rows in range(1, max_rows + 1):
            together = timings.get((group.name, rows, choices[group.shape][rows - 1]))
            apart = [
                timings.get((part, rows, choices[roles[part].shape][rows - 1]))
                for part in group.parts
                if part in roles
            ]
            flags.append(
                together is not None
                and len(apart) == len(group.parts)
                and all(t is not None for t in apart)
                and together < (1 - margin) * sum(t for t in apart if t is not None)
            )
        fuse[group.name] = flags
    return KernelTable(
        max_rows=max_rows,
        choices={shape: tuple(names) for shape, names in choices.items()},
        fuse={group: tuple(flags) for group, flags in fuse.items()},
        source="measured",
    )


def _fastest(totals: Mapping[str, float], margin: float) -> str:
    """The fastest kernel of ``totals``; ``F.linear`` when within ``margin`` of it or untimed."""
    if not totals or PLAIN_KERNEL not in totals:
        return PLAIN_KERNEL
    best = min(totals, key=lambda name: totals[name])
    if totals[PLAIN_KERNEL] <= (1 + margin) * totals[best]:
        return PLAIN_KERNEL
    return best


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


@attrs.frozen
class StepCheck:
    """Whole engine steps of ``rows`` tokens: median seconds with each candidate table
    (``f.linear`` among them) and the one chosen for this row count."""

    rows: int
    seconds: dict[str, float]
    chosen: str


@torch.inference_mode()
def validate_table(
    engine: SublayerEngine,
    candidates: Mapping[str, KernelTable],
    rows: Iterable[int] = DEFAULT_VALIDATE_ROWS,
    *,
    context: int = 128,
    repeats: int = 2,
    margin: float = DEFAULT_MARGIN,
    timer: Timer = time.perf_counter,
    progress: bool | None = None,
) -> tuple[KernelTable, list[StepCheck]]:
    """Choose per row count among whole tables by timing whole engine steps.

    Each row count's step runs with every table of ``candidates`` and with plain
    ``F.linear`` (interleaved, after ``context`` cached tokens); the fastest wins if it
    beats ``F.linear`` by ``margin``, else ``F.linear`` unfused runs that row count. The
    first candidate supplies the rows not checked. The engine is left running the result.
    """
    tables = {PLAIN_KERNEL: KernelTable.plain(), **candidates}
    base = next(iter(candidates.values()))
    rows = [r for r in rows if 1 <= r <= base.max_rows]
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
    bar.close()
    result = merge_rows(base, {check.rows: tables[check.chosen] for check in checks})
    engine.use_kernels(result)
    return result, checks


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

    @classmethod
    def for_engine(cls, engine: SublayerEngine, max_rows: int = SMALL_ROWS) -> KernelKey:
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
    engine: SublayerEngine,
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
    # One timed pass per kernel and row count (after a warm-up round): the whole-step
    # check below, not these per-product timings, has the last word.
    timings = measure_kernels(
        separate, fused, range(1, max_rows + 1), repeats=1, timer=timer, progress=progress
    )
    measured = choose_table(timings, separate, fused, max_rows=max_rows, margin=margin)
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
    return TuneResult(
        key=KernelKey.for_engine(engine, max_rows),
        table=table,
        seconds=time.perf_counter() - start,
        timings=timings,
        checks=tuple(checks),
    )


def kernel_table_path(key: KernelKey) -> Path:
    """``cache_root()/kernels/<model shape>-<key digest>.json``."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", key.model_shape.split("-", 1)[0])
    return cache_root() / "kernels" / f"{stem}-{key.digest()}.json"


def load_or_tune(
    engine: SublayerEngine,
    *,
    progress: bool | None = None,
    tune: Callable[..., TuneResult] = tune_kernel_table,
) -> TuneResult:
    """The cached table for this machine and model shape, measured on first use."""
    key = KernelKey.for_engine(engine)
    path = kernel_table_path(key)
    if path.exists():
        try:
            cached = TuneResult.from_dict(json.loads(path.read_text(encoding="utf-8")))
            if cached.key == key:
                return cached
        except (OSError, ValueError, KeyError, TypeError) as error:
            warnings.warn(
                f"kernel table {path} is unreadable ({error!r}); measuring again",
                RuntimeWarning,
                stacklevel=2,
            )
    result = tune(engine, progress=progress)
    _write_atomic(path, json.dumps(result.to_dict(), indent=1) + "\n")
    return result


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".kernels-", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def framework_only(engine: SublayerEngine) -> bool:
    """True where the engine uses the framework's own products with nothing to tune:
    a non-CPU device, or a dtype other than float32 (bf16/fp16 then match the model's own
    products exactly)."""
    return engine.device.type != "cpu" or engine.dtype != torch.float32


def resolve_kernel_table(
    engine: SublayerEngine, spec: KernelTable | str | None, *, progress: bool | None = None
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
