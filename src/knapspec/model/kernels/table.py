"""Linear kernels for the few-row products of decoding, and the table that picks one.

A decode step multiplies every weight matrix by 1 row; verification by ``k ≤ D + 1``
rows. The same product can be computed several ways, and which is fastest depends on the
CPU and its BLAS, not on the model:

* ``f.linear``: ``F.linear(x, W)`` (``x @ W.T``), the model's own product;
* ``transposed``: ``(W @ x.T).T``;
* ``transposed-padded``: the same with 1 row padded to 2 and 3 rows to 4;
* ``onednn``: oneDNN's inner product against a copy of ``W`` reordered once into its
  blocked layout (:mod:`knapspec.model.kernels.onednn`; x86 builds of PyTorch);
* ``row-linear``, ``amx-linear`` and ``packed-linear``: compiled kernels that are
  row-invariant by construction (:mod:`knapspec.model.kernels.row_linear`; the second on the AMX
  tiles, the third on a weight packed for VDPBF16PS, both bfloat16), candidates of exact
  engines only.

On one CPU ``F.linear`` re-read ``W`` for every row of a few-row product (SmolLM2's
``49152 × 576`` LM head), while ``(W @ x.T).T`` streamed ``W`` once for up to four rows (1
and 3 rows only when padded) and made a whole decode step faster
(``results/engine/small_row_linear.jsonl``); on another the same transposed path made a
decode step *slower* than ``F.linear`` (``results/engine/HISTORY.md``, "Figures behind
docstrings"). So nothing here is hard-coded: a :class:`KernelTable` says,
per weight shape and row count, which kernel to run and whether to run each layer's
q/k/v and gate/up projections as one fused product; :mod:`knapspec.model.tuning.autotune`
measures it on the machine at hand, and anything but a float32 model on CPU gets
:meth:`KernelTable.plain` (the framework's own products).

All kernels differ from ``F.linear`` only in the order of the floating-point summation
(as any two BLAS kernels do), so outputs agree to rounding.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from knapspec.model.kernels.layer_ops import LIBRARY as LAYER_OPS_LIBRARY
from knapspec.model.kernels.onednn import onednn_packed
from knapspec.model.kernels.row_linear import AMX_NAME as AMX_KERNEL
from knapspec.model.kernels.row_linear import LIBRARY as ROW_LINEAR_LIBRARY
from knapspec.model.kernels.row_linear import NAME as ROW_LINEAR_KERNEL
from knapspec.model.kernels.row_linear import PACKED_NAME as PACKED_KERNEL
from knapspec.model.kernels.row_linear import (
    amx_linear,
    one_row_at_a_time,
    packed_linear,
    row_linear,
)

#: Row counts the table covers (1 .. SMALL_ROWS): decode, draft and verify steps (``D + 1``
#: rows at most) and the DP's small batches. Larger products always run ``F.linear``.
SMALL_ROWS = 16

Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

#: Fusion groups: layers that read one input and may run as one product.
FUSION_GROUPS = ("qkv", "gate_up")


def padded_rows(rows: int) -> int:
    """Rows actually multiplied by ``transposed-padded`` (1 → 2 and 3 → 4)."""
    if rows == 1:
        return 2
    if rows == 3:
        return 4
    return rows


def f_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``."""
    return F.linear(x, weight, bias)


def _transposed(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pad: bool
) -> torch.Tensor:
    in_features = x.shape[-1]
    rows = x.numel() // in_features if in_features else 0
    if rows == 0 or x.dtype != weight.dtype or weight.dim() != 2:
        return F.linear(x, weight, bias)  # F.linear's own errors, never a silent cast
    flat = x.reshape(rows, in_features)
    padded = padded_rows(rows) if pad else rows
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, in_features)])
    out = torch.mm(weight, flat.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(W @ x.T).T``: ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``, contiguous."""
    return _transposed(x, weight, bias, pad=False)


def transposed_padded(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """:func:`transposed` with 1 row padded to 2 and 3 rows to 4 (zero rows, dropped after)."""
    return _transposed(x, weight, bias, pad=True)


def rowwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row its own one-row ``F.linear``: row-invariant by construction (a row's result
    is the one-row product's), at one pass over ``W`` per row. The exact fallback where no
    faster kernel keeps the contract (:mod:`knapspec.model.tuning.invariance`); never timed."""
    return one_row_at_a_time(x, weight, bias)


def blocked(kernel: Kernel, height: int) -> Kernel:
    """``kernel`` over consecutive blocks of at most ``height`` rows, concatenated.

    Where ``kernel`` keeps every row of a product of 1 .. ``height`` rows bitwise equal to
    that row alone (its BLAS picks one blocking for those counts), the blocked kernel keeps
    it for *every* row count: each block is such a product. Where bfloat16 ``F.linear`` runs
    on the AMX tiles (oneDNN), it was seen to keep rows up to 32 and change them from 33 rows
    on; in blocks of 32 it is row-invariant at any count and still runs on the tiles.
    Shapes: ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``."""

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.numel() // in_features if in_features else 0
        if rows <= height:
            return kernel(x, weight, bias)
        flat = x.reshape(rows, in_features)
        parts = [kernel(flat[i : i + height], weight, bias) for i in range(0, rows, height)]
        return torch.cat(parts).view(*x.shape[:-1], weight.shape[0])

    return run


#: Block heights of the blocked kernels (:func:`blocked`), tallest first: the probe tries
#: a kernel in blocks only where it is not row-invariant as it is.
BLOCK_HEIGHTS: tuple[int, ...] = (32, 16, 8, 4, 2)

_BASE_KERNELS: dict[str, Kernel] = {
    "f.linear": f_linear,
    "transposed": transposed,
    "transposed-padded": transposed_padded,
    "onednn": onednn_packed,  # ONEDNN_KERNEL
}


def blocked_name(name: str, height: int) -> str:
    """The name of kernel ``name`` run in blocks of ``height`` rows, e.g. ``"f.linear/32"``."""
    return f"{name}/{height}"


#: The candidate kernels by name; ``f.linear`` first (it wins ties). Each base kernel also
#: comes in blocks of every :data:`BLOCK_HEIGHTS` height (``"onednn/16"``): row-invariance
#: candidates only, never timed by the autotuner.
KERNELS: dict[str, Kernel] = {
    **_BASE_KERNELS,
    "rowwise": rowwise,  # ROWWISE_KERNEL: the exact fallback, never a timing candidate
    # Row-invariant by construction (compiled C, :mod:`knapspec.model.kernels.row_linear`): a
    # candidate of exact engines only, never tried in blocks.
    ROW_LINEAR_KERNEL: row_linear,
    AMX_KERNEL: amx_linear,  # the same on the AMX tiles (bfloat16)
    PACKED_KERNEL: packed_linear,  # the same on a packed weight (bfloat16, AVX512-BF16)
    **{
        blocked_name(name, height): blocked(kernel, height)
        for height in BLOCK_HEIGHTS
        for name, kernel in _BASE_KERNELS.items()
    },
}
PLAIN_KERNEL = "f.linear"
#: The compiled kernels (row-invariant by construction; a table running one names its build).
COMPILED_KERNELS = frozenset({ROW_LINEAR_KERNEL, AMX_KERNEL, PACKED_KERNEL})
#: oneDNN's packed product (its weights are reordered when a table that runs it is adopted).
ONEDNN_KERNEL = "onednn"
#: One row at a time (:func:`rowwise`).
ROWWISE_KERNEL = "rowwise"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as the transposed-padded product for up to :data:`SMALL_ROWS` rows on CPU
    (the fixed choice of engine revisions r2-r3; kept for measurements and tests)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 1 <= rows <= SMALL_ROWS:
        return F.linear(x, weight, bias)
    return transposed_padded(x, weight, bias)


Shape = tuple[int, int]


def shape_name(shape: Shape) -> str:
    """``(out, in)`` -> ``"outxin"`` (the JSON key of a shape)."""
    return f"{shape[0]}x{shape[1]}"


def parse_shape(name: str) -> Shape:
    """Inverse of :func:`shape_name`."""
    out, _, in_ = name.partition("x")
    return int(out), int(in_)


def _choices(value: Mapping[Any, Any]) -> dict[Shape, tuple[str, ...]]:
    result: dict[Shape, tuple[str, ...]] = {}
    for shape, names in value.items():
        key = parse_shape(shape) if isinstance(shape, str) else (int(shape[0]), int(shape[1]))
        result[key] = tuple(str(name) for name in names)
    return result


def _large(value: Mapping[Any, Any]) -> dict[Shape, str]:
    result: dict[Shape, str] = {}
    for shape, name in value.items():
        key = parse_shape(shape) if isinstance(shape, str) else (int(shape[0]), int(shape[1]))
        result[key] = str(name)
    return result


def _fuse(value: Mapping[str, Any]) -> dict[str, tuple[bool, ...]]:
    return {str(group): tuple(bool(flag) for flag in flags) for group, flags in value.items()}


@attrs.frozen
class KernelTable:
    """Which kernel runs each few-row product, and which projections run fused.

    Attributes:
        max_rows: row counts ``1 .. max_rows`` are covered; larger products use ``F.linear``.
        choices: per weight shape ``(out_features, in_features)``, the kernel name (a key
            of :data:`KERNELS`) for ``rows = 1 .. max_rows`` (index ``rows - 1``). A shape
            not listed runs ``F.linear``.
        fuse: per fusion group (``"qkv"``, ``"gate_up"``), whether ``rows = 1 .. max_rows``
            run as one fused product. A group not listed runs separately.
        large: per weight shape, the kernel of products over ``max_rows`` rows (a prefill,
            a batched verification); never fused. A shape not listed runs ``F.linear``.
        source: how the table came about (``"measured"``, ``"f.linear"``: forced or not a
            float32 CPU model, ``"fixed"``: given in code).
    """

    max_rows: int = SMALL_ROWS
    choices: Mapping[Shape, tuple[str, ...]] = attrs.field(factory=dict, converter=_choices)
    fuse: Mapping[str, tuple[bool, ...]] = attrs.field(factory=dict, converter=_fuse)
    source: str = "fixed"
    large: Mapping[Shape, str] = attrs.field(factory=dict, converter=_large)

    def __attrs_post_init__(self) -> None:
        if self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {self.max_rows}")
        for shape, names in self.choices.items():
            if len(names) != self.max_rows:
                raise ValueError(
                    f"kernel choices for shape {shape_name(shape)} list {len(names)} row "
                    f"counts; expected max_rows={self.max_rows}"
                )
            unknown = sorted(set(names) - set(KERNELS))
            if unknown:
                raise ValueError(
                    f"unknown kernel(s) {unknown} for shape {shape_name(shape)}; "
                    f"known: {sorted(KERNELS)}"
                )
        unknown = sorted(set(self.large.values()) - set(KERNELS))
        if unknown:
            raise ValueError(
                f"unknown kernel(s) {unknown} for large products; known: {sorted(KERNELS)}"
            )
        for group, flags in self.fuse.items():
            if group not in FUSION_GROUPS or len(flags) != self.max_rows:
                raise ValueError(
                    f"fuse[{group!r}] must be one of {FUSION_GROUPS} with max_rows="
                    f"{self.max_rows} flags, got {len(flags)}"
                )

    @classmethod
    def plain(cls, source: str = "f.linear") -> KernelTable:
        """``F.linear`` everywhere and no fusion: the framework's own products."""
        return cls(max_rows=0, source=source)

    @classmethod
    def uniform(
        cls, shapes: list[Shape], kernel: str, *, fuse: bool, max_rows: int = SMALL_ROWS
    ) -> KernelTable:
        """One kernel for every shape and row count (e.g. engine revision r3's fixed choice:
        ``uniform(shapes, "transposed-padded", fuse=True)``)."""
        return cls(
            max_rows=max_rows,
            choices={shape: (kernel,) * max_rows for shape in shapes},
            fuse={group: (fuse,) * max_rows for group in FUSION_GROUPS},
        )

    @property
    def is_plain(self) -> bool:
        """True when every product runs ``F.linear`` unfused (the model's own arithmetic)."""
        return (
            all(name == PLAIN_KERNEL for names in self.choices.values() for name in names)
            and not any(flag for flags in self.fuse.values() for flag in flags)
            and all(name == PLAIN_KERNEL for name in self.large.values())
        )

    def kernel(self, shape: Shape, rows: int) -> str:
        """The kernel name for a product of ``rows`` rows with a ``shape`` weight."""
        if rows > self.max_rows:
            return self.large.get(shape, PLAIN_KERNEL)
        names = self.choices.get(shape)
        if names is None or rows < 1:
            return PLAIN_KERNEL
        return names[rows - 1]

    def fused(self, group: str, rows: int) -> bool:
        """Whether ``group`` runs as one product for ``rows`` rows."""
        flags = self.fuse.get(group)
        return flags is not None and 1 <= rows <= self.max_rows and flags[rows - 1]

    def dispatch(self) -> dict[tuple[int, ...], tuple[Kernel, ...]]:
        """Per listed shape, the kernel functions indexed by row count (index 0 unused):
        the engine's hot-path lookup."""
        return {
            shape: (f_linear, *(KERNELS[name] for name in names))
            for shape, names in self.choices.items()
        }

    def large_dispatch(self) -> dict[tuple[int, ...], Kernel]:
        """Per shape with a kernel other than ``F.linear``, the kernel of products over
        ``max_rows`` rows."""
        return {shape: KERNELS[name] for shape, name in self.large.items() if name != PLAIN_KERNEL}

    def fuse_rows(self, group: str) -> tuple[bool, ...]:
        """``fused(group, rows)`` indexed by ``rows`` (index 0 unused), for the hot path."""
        return (False, *(self.fused(group, rows) for rows in range(1, self.max_rows + 1)))

    def with_fusion_off(self) -> KernelTable:
        """The same kernels with no fusion."""
        return attrs.evolve(self, fuse={})

    def with_large(self, large: Mapping[Shape, str]) -> KernelTable:
        """The same few-row choices with ``large`` for products over ``max_rows`` rows."""
        return attrs.evolve(self, large=large)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: shapes as ``"outxin"`` keys."""
        return {
            "max_rows": self.max_rows,
            "choices": {shape_name(s): list(n) for s, n in sorted(self.choices.items())},
            "fuse": {group: list(flags) for group, flags in sorted(self.fuse.items())},
            "large": {shape_name(s): name for s, name in sorted(self.large.items())},
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KernelTable:
        """Inverse of :meth:`to_dict` (raises ``ValueError``/``KeyError`` on bad data)."""
        return cls(
            max_rows=int(data["max_rows"]),
            choices=data["choices"],
            fuse=data["fuse"],
            source=str(data.get("source", "fixed")),
            large=data.get("large", {}),
        )

    def fingerprint(self) -> str:
        """A short hash of what runs (not of ``source``): ``"f.linear"`` for a plain table.

        Latency profiles store it; a profile timed under another table is not reused. A
        table that runs the compiled kernels names their build too (source, compiler,
        flags, CPU) and that of the layer operations an exact engine runs beside them
        (``layer_ops.c``): a faster build makes the old timings wrong (adding a prefetch
        to the kernels shortened a 16-row bf16 step by a sixth; ``results/engine/HISTORY.md``)
        and they are measured again.
        """
        if self.is_plain:
            return PLAIN_KERNEL
        data = self.to_dict()
        del data["source"]
        if not data["large"]:  # tables from before ``large`` keep their fingerprints
            del data["large"]
        names = {name for row in self.choices.values() for name in row} | set(self.large.values())
        if names & COMPILED_KERNELS:
            data["compiled"] = ROW_LINEAR_LIBRARY.path().stem
            data["layer_ops"] = LAYER_OPS_LIBRARY.path().stem
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def summary(self) -> str:
        """One line per shape and group, rows grouped by kernel: for logs and reports."""
        lines = []
        for shape, names in sorted(self.choices.items()):
            lines.append(f"{shape_name(shape)}: {_runs(names)}")
        for group, flags in sorted(self.fuse.items()):
            lines.append(f"{group}: {_runs(tuple('fused' if f else 'separate' for f in flags))}")
        for shape, name in sorted(self.large.items()):
            lines.append(f"{shape_name(shape)}: rows {self.max_rows + 1}+ {name}")
        return "\n".join(lines) if lines else "f.linear everywhere, no fusion"


def _runs(names: tuple[str, ...]) -> str:
    """``("a", "a", "b")`` -> ``"rows 1-2 a, 3 b"``."""
    parts = []
    start = 0
    for index in range(1, len(names) + 1):
        if index == len(names) or names[index] != names[start]:
            span = f"{start + 1}" if index - 1 == start else f"{start + 1}-{index}"
            parts.append(f"{span} {names[start]}")
            start = index
    return "rows " + ", ".join(parts)


__all__ = [
    "AMX_KERNEL",
    "BLOCK_HEIGHTS",
    "COMPILED_KERNELS",
    "FUSION_GROUPS",
    "KERNELS",
    "ONEDNN_KERNEL",
    "PACKED_KERNEL",
    "PLAIN_KERNEL",
    "ROWWISE_KERNEL",
    "ROW_LINEAR_KERNEL",
    "SMALL_ROWS",
    "Kernel",
    "KernelTable",
    "blocked",
    "blocked_name",
    "f_linear",
    "linear",
    "padded_rows",
    "parse_shape",
    "rowwise",
    "shape_name",
    "transposed",
    "transposed_padded",
]
