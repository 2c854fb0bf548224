"""The oneDNN kernel: ``x @ W.T`` against a copy of ``W`` reordered once into oneDNN's
blocked layout.

``F.linear`` on CPU goes to the BLAS (MKL, say), which for a product of a few rows against
a large matrix can be far from the memory bandwidth, and slows down with every row it
adds (SmolLM2's ``49152 × 576`` LM head, its ``3072 × 576`` fused gate/up). The same
products through oneDNN's inner-product primitive, with the weight reordered beforehand
(what PyTorch's own ``torch.compile`` CPU backend does under ``freezing``), streamed the
weight nearly once whatever the row count, and even 2048-row prefill products came out
ahead (figures: ``results/engine/HISTORY.md``). Whether it wins on the machine at hand is
for :mod:`knapspec.model.tuning.autotune` to measure; nothing here assumes it.

The reordered copy costs memory: as much again as the weights it serves (about 0.4 GB for
SmolLM2-135M in float32, LM head included). It is made on the first product that needs it,
kept while its weight lives (keyed weakly by the weight tensor), and made again if the weight
changes in place (its version counter moves). :func:`release_packed` drops every copy (the
autotuner calls it after timing, so only the weights the chosen table runs keep one).

Only the order of the floating-point summation differs from ``F.linear``, as between any
two BLAS kernels.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.nn.functional as F

#: The share of physical memory the reordered copies may take; beyond it the autotuner does
#: not try the kernel (a model whose weights fill the machine must not double them).
PACKING_MEMORY_SHARE = 0.25

#: The batch-size hint oneDNN reorders a weight for; any row count may then use the copy
#: (measured: a hint of 16 serves 1-2048 rows as well as a hint equal to the rows).
PACK_HINT_ROWS = 16


class _Packed:
    """One weight's reordered copy and what it was made from."""

    __slots__ = ("packed", "pointer", "reference", "version")

    def __init__(self, weight: torch.Tensor) -> None:
        self.reference = weakref.ref(weight)
        self.pointer = weight.data_ptr()
        self.version = _version(weight)
        with torch.inference_mode():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)

    def serves(self, weight: torch.Tensor) -> bool:
        return (
            self.reference() is weight
            and self.pointer == weight.data_ptr()
            and self.version == _version(weight)
        )


def _version(weight: torch.Tensor) -> int:
    """The in-place version counter; -1 for an inference tensor (which has none and,
    made under ``torch.inference_mode``, cannot change outside it)."""
    try:
        return int(weight._version)
    except RuntimeError:
        return -1


_PACKED: dict[int, _Packed] = {}


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """The reordered copy of ``weight``, made now if there is none current."""
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or not entry.serves(weight):
        entry = _Packed(weight)
        _PACKED[key] = entry
        # Drop the copy with its weight (ids are reused after a tensor dies).
        weakref.finalize(weight, _PACKED.pop, key, None)
    packed: torch.Tensor = entry.packed
    return packed


def prepack(weight: torch.Tensor) -> None:
    """Make ``weight``'s reordered copy now (where oneDNN runs it), so that the first
    product that uses it is not also the one that pays the reorder: a first verification
    of a new width would otherwise look slow to every cost model timing it."""
    if onednn_available() and weight.dtype == torch.float32 and weight.device.type == "cpu":
        _packed(weight)


def release_packed() -> int:
    """Drop every reordered copy (they are made again on use); returns how many."""
    count = len(_PACKED)
    _PACKED.clear()
    return count


def packed_count() -> int:
    """Weights holding a reordered copy now."""
    return len(_PACKED)


@functools.cache
def onednn_available() -> bool:
    """Whether this PyTorch build runs oneDNN's packed linear product (x86 CPU builds do)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        weight = torch.randn(4, 8)
        x = torch.randn(2, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-5))


def physical_memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def packing_fits(weight_bytes: int, memory_bytes: int | None = None) -> bool:
    """Whether reordered copies of ``weight_bytes`` of weights, twice over (the separate
    and the fused projections may each keep one), fit in :data:`PACKING_MEMORY_SHARE` of
    ``memory_bytes`` (default: this machine's physical memory)."""
    memory = physical_memory_bytes() if memory_bytes is None else memory_bytes
    return memory > 0 and 2 * weight_bytes <= PACKING_MEMORY_SHARE * memory


def onednn_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN with ``weight`` pre-reordered:
    ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``, contiguous.

    Falls back to ``F.linear`` where oneDNN cannot run it (another dtype or device, a
    build without it), so a table naming this kernel is never wrong, only slower.
    """
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or x.shape[-1] != weight.shape[1]
        or x.numel() == 0
        or not onednn_available()
    ):
        return F.linear(x, weight, bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
        x if x.is_contiguous() else x.contiguous(), _packed(weight), bias, "none", [], ""
    )
    return out


__all__ = [
    "PACKING_MEMORY_SHARE",
    "PACK_HINT_ROWS",
    "onednn_available",
    "onednn_packed",
    "packed_count",
    "packing_fits",
    "physical_memory_bytes",
    "prepack",
    "release_packed",
]
