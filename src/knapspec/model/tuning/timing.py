"""Timing the candidate kernels of every linear role and choosing the fastest per shape and
row count: the measurement half of :mod:`knapspec.model.tuning.autotune` (which keys, caches and
resolves the tables; :mod:`knapspec.model.tuning.checks` checks the choice with whole
engine steps). Why it is measured this way (in model order, every weight streaming from
memory) is explained there.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch import nn
from tqdm.auto import tqdm

from knapspec.model.kernels.onednn import onednn_available
from knapspec.model.kernels.table import (
    KERNELS,
    PLAIN_KERNEL,
    SMALL_ROWS,
    KernelTable,
    Shape,
    padded_rows,
)

if TYPE_CHECKING:
    from knapspec.model.tuning.tunable import TunableEngine

#: Relative margin within which two timings count as a tie (the tie goes to ``F.linear``,
#: or to separate products for fusion).
DEFAULT_MARGIN = 0.03

#: Row counts standing for products over ``SMALL_ROWS`` rows (a batched verification, a
#: prefill chunk): a kernel runs them only if it wins at each.
LARGE_ROWS = (64, 512)

#: Bytes of weights one timing pass of :func:`measure_kernels` streams at least: a model
#: with more is timed on its first layers up to this much, plus the LM head
#: (:func:`streamed_subset`). Far more than any CPU cache holds, so every weight still
#: streams from memory as in a whole step, while a 1-8B model's pass no longer multiplies
#: all of its weights (the pass runs some 130 times: 16 row counts, 4 kernels, 2 passes).
STREAM_BYTES = 512 * 2**20

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


def linear_roles(engine: TunableEngine) -> tuple[list[LinearRole], list[LinearRole]]:
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


def streamed_subset(
    separate: Sequence[LinearRole], fused: Sequence[LinearRole], min_bytes: int = STREAM_BYTES
) -> tuple[list[LinearRole], list[LinearRole]]:
    """``separate`` and ``fused`` cut to the first layers whose separate weights hold at
    least ``min_bytes`` (all of them where the model has fewer); single-tensor roles (the
    LM head) stay whole. Layers share their shapes, so the first layers time every shape
    a pass over all of them would, in model order and from memory."""
    layers = max((len(role.tensors) for role in separate), default=0)
    per_layer = sum(
        role.tensors[0][0].numel() * role.tensors[0][0].element_size()
        for role in separate
        if len(role.tensors) == layers
    )
    keep = layers if per_layer == 0 else min(layers, max(1, -(-min_bytes // per_layer)))
    if keep >= layers:
        return list(separate), list(fused)

    def cut(roles: Sequence[LinearRole]) -> list[LinearRole]:
        return [
            attrs.evolve(role, tensors=role.tensors[:keep]) if len(role.tensors) == layers else role
            for role in roles
        ]

    return cut(separate), cut(fused)


def candidate_kernels(rows: int, *, onednn: bool | None = None) -> tuple[str, ...]:
    """Kernels worth timing for ``rows`` rows (padding only changes 1 and 3 rows; oneDNN
    where ``onednn``, by default where this PyTorch build has it; over :data:`SMALL_ROWS`
    rows only ``F.linear`` and oneDNN, the transposed product being the BLAS's own at that
    size)."""
    names = [PLAIN_KERNEL]
    if rows <= SMALL_ROWS:
        names.append("transposed")
        if padded_rows(rows) != rows:
            names.append("transposed-padded")
    if onednn_available() if onednn is None else onednn:
        names.append("onednn")
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
    onednn: bool | None = None,
) -> dict[tuple[str, int, str], float]:
    """Median seconds of each role for each row count and candidate kernel
    (:func:`candidate_kernels`; ``onednn`` as there).

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
            for kernel_name in candidate_kernels(count, onednn=onednn):
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


def choose_large(
    timings: Timings,
    separate: Sequence[LinearRole],
    rows: Iterable[int] = LARGE_ROWS,
    *,
    margin: float = DEFAULT_MARGIN,
) -> dict[Shape, str]:
    """Per weight shape, the kernel of products over ``SMALL_ROWS`` rows: one that beats
    ``F.linear`` by more than ``margin`` at every row count of ``rows`` (summed over the
    roles of that shape); shapes where none does are left out (``F.linear``)."""
    by_shape: dict[Shape, list[str]] = {}
    for role in separate:
        by_shape.setdefault(role.shape, []).append(role.name)
    rows = list(rows)
    large: dict[Shape, str] = {}
    for shape, names in by_shape.items():
        winners = set()
        for count in rows:
            totals = {
                kernel: sum(timings[(name, count, kernel)] for name in names)
                for kernel in KERNELS
                if all((name, count, kernel) in timings for name in names)
            }
            winners.add(_fastest(totals, margin))
        if len(winners) == 1 and (winner := winners.pop()) != PLAIN_KERNEL:
            large[shape] = winner
    return large


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


__all__ = [
    "DEFAULT_MARGIN",
    "LARGE_ROWS",
    "STREAM_BYTES",
    "LinearRole",
    "Timer",
    "Timings",
    "candidate_kernels",
    "choose_large",
    "choose_table",
    "linear_roles",
    "measure_kernels",
    "streamed_subset",
]
