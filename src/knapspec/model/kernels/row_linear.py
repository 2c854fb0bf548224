"""``row-linear``: a linear product that is row-invariant by construction and fast at few rows.

BLAS picks its blocking, and with it the summation order, from the row count, so a row of a
verification product need not equal the same row's one-row product (the exactness
contract, ``docs/theory.md``). The probe (:mod:`knapspec.model.tuning.invariance`) finds which of
the framework's kernels keep it on the machine at hand, and on some CPUs none does for a
shape (float32's ``576x1536`` down projection, on one with AMX), or only a slow one does
(``transposed-padded`` in bfloat16). This kernel (``csrc/row_linear.c``) takes the choice away
from the library: every output element is a dot product accumulated chunk by chunk in
``k`` order in one vector accumulator, its lanes summed by one fixed tree, whatever the
row count, so rows never share arithmetic. A block of weight rows stays in cache while
every input row passes over it, so a few-row product costs about what one row costs; in
bfloat16 it runs on VDPBF16PS where the CPU has AVX512-BF16.

At a few rows it beat ``F.linear`` on the shapes tried; from about 8 bfloat16 rows oneDNN's
AMX tiles won, so the probe's timing decides per shape (figures: ``results/engine/HISTORY.md``).

``packed-linear`` (bfloat16 on CPUs with AVX512-BF16) keeps the contract another way: the
weight packed once in VNNI order, each output element one float32 lane accumulating the pairs
of ``k`` in order, no lane sums: the pairs go through ``VDPBF16PS`` without a lane
reduction per element, so it ran SmolLM2's products faster than ``row-linear`` at every row
count tried from 1 to 512, at the cost of a second copy of each weight it runs.

Where the C compiler is missing, the kernel runs each row as its own one-row ``F.linear``
(row-invariant as well; slower at many rows) and says so once.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from knapspec.model.kernels.compiled import CompiledLibrary
from knapspec.model.machine import AMX_TILE_FLAGS, AVX512_BF16_FLAGS, claimed_absent

logger = logging.getLogger(__name__)

NAME = "row-linear"
#: The AMX-tile kernel's name (bfloat16 on CPUs with ``amx_bf16``).
AMX_NAME = "amx-linear"
#: The packed-weight kernel's name (bfloat16 on CPUs with ``avx512_bf16``).
PACKED_NAME = "packed-linear"

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _declare(library: ctypes.CDLL) -> None:
    function = library.knapspec_row_linear
    function.restype = ctypes.c_int
    function.argtypes = [
        *(ctypes.c_void_p,) * 4,
        *(ctypes.c_int64,) * 5,
        ctypes.c_int,
        ctypes.c_int,
    ]
    library.knapspec_row_linear_chunk.restype = ctypes.c_int64
    library.knapspec_row_linear_chunk.argtypes = [ctypes.c_int]
    library.knapspec_row_linear_build.restype = ctypes.c_int
    library.knapspec_row_linear_build.argtypes = []
    amx = library.knapspec_amx_linear
    amx.restype = ctypes.c_int
    amx.argtypes = [*(ctypes.c_void_p,) * 4, *(ctypes.c_int64,) * 5, ctypes.c_int]
    library.knapspec_amx_available.restype = ctypes.c_int
    library.knapspec_amx_available.argtypes = []
    packed = library.knapspec_packed_linear
    packed.restype = ctypes.c_int
    packed.argtypes = [*(ctypes.c_void_p,) * 4, *(ctypes.c_int64,) * 5, ctypes.c_int]
    library.knapspec_packed_available.restype = ctypes.c_int
    library.knapspec_packed_available.argtypes = []


LIBRARY = CompiledLibrary(
    "row_linear.c",
    "the row-invariant linear kernel",
    "it runs one F.linear per row instead (exact, slower at many rows)",
    _declare,
    flags=("-ffp-contract=off",),
)

# Zero-padded copies of weights whose input size is not a multiple of the kernel's chunk:
# id(weight) -> (weak reference, version, copy). Made on first use, dropped with the weight
# (a finalizer), made again if the weight changes in place (its version counter moves).
_padded: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def one_row_at_a_time(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Each row its own one-row ``F.linear``: row-invariant by construction, at one pass
    over ``W`` per row (the fallback where the compiled kernels cannot run).
    ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``."""
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features)
    if flat.shape[0] <= 1:
        return F.linear(x, weight, bias)
    rows = [F.linear(flat[i : i + 1], weight, bias) for i in range(flat.shape[0])]
    return torch.cat(rows).view(*x.shape[:-1], weight.shape[0])


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel serves ``dtype`` on CPU here."""
    return dtype in _DTYPES and LIBRARY.load() is not None


def build_tag(dtype: torch.dtype) -> str:
    """``"-<8 hex digits>"`` naming the compiled kernel's build when it serves ``dtype``
    here, else ``""``: cache files of timings or probes that ran it carry the tag, so a
    rebuilt kernel is measured afresh."""
    if not available(dtype):
        return ""
    return "-" + LIBRARY.path().stem.rpartition("-")[2][:8]


def build_description() -> str:
    """What the compiled kernel computes with here ("16 float32 lanes, bfloat16 on
    VDPBF16PS"), or why it does not run."""
    library = LIBRARY.load()
    if library is None:
        return "unavailable (no working C compiler): one F.linear per row"
    code = int(library.knapspec_row_linear_build())
    lanes, dpbf16 = divmod(code, 10)
    return f"{lanes} float32 lanes, bfloat16 " + (
        "on VDPBF16PS" if dpbf16 else "widened to float32"
    )


def _derived(
    cache: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]],
    weight: torch.Tensor,
    make: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``make(weight)``, kept in ``cache`` while the weight lives (a finalizer drops it) and
    made again if the weight changes in place (its version counter moves)."""
    key = id(weight)
    cached = cache.get(key)
    if cached is not None and cached[0]() is weight and cached[1] == weight._version:
        return cached[2]
    derived = make(weight)
    if cached is None or cached[0]() is not weight:
        weakref.finalize(weight, cache.pop, key, None)
    cache[key] = (weakref.ref(weight), weight._version, derived)
    return derived


def _padded_weight(weight: torch.Tensor, k_padded: int) -> torch.Tensor:
    return _derived(
        _padded,
        weight,
        lambda w: F.pad(w.detach(), (0, k_padded - w.shape[1])).contiguous(),
    )


def _chunk(library: ctypes.CDLL, dtype: int) -> int:
    chunk = _chunks.get(dtype)
    if chunk is None:
        chunk = _chunks[dtype] = int(library.knapspec_row_linear_chunk(dtype))
    return chunk


_chunks: dict[int, int] = {}


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, each row computed alone (bitwise the same at any row count).

    Args:
        x: ``(..., in)`` float32 or bfloat16 on CPU.
        weight: ``(out, in)``, same dtype.
        bias: ``(out,)`` or None.

    Returns:
        ``(..., out)`` in ``x``'s dtype.
    """
    dtype = _DTYPES.get(x.dtype, -1)
    library = LIBRARY.load() if dtype >= 0 and x.is_cpu else None
    if library is None or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return one_row_at_a_time(x, weight, bias)
    shape = x.shape
    in_features = shape[-1]
    out_features = weight.shape[0]
    flat = x if x.dim() == 2 else x.reshape(-1, in_features)
    rows = flat.shape[0]
    k = in_features
    if in_features % _chunk(library, dtype):
        chunk = _chunk(library, dtype)
        k = -(-in_features // chunk) * chunk
        flat = F.pad(flat, (0, k - in_features))
        weight = _padded_weight(weight, k)
    elif not weight.is_contiguous():
        weight = weight.contiguous()
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    out = torch.empty((*shape[:-1], out_features), dtype=x.dtype)
    if rows and library.knapspec_row_linear(
        flat.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        k,
        out_features,
        flat.stride(0),
        out_features,
        dtype,
        torch.get_num_threads(),
    ):
        raise RuntimeError("the row-invariant linear kernel refused its input")
    return out


# Weights packed into AMX tiles: id(weight) -> (weak reference, version, packed copy).
_amx_packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}


def amx_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the AMX-tile kernel runs here: a bfloat16 model, a build for a CPU with AMX,
    the OS's permission to use the tiles, and no claim of a CPU without them
    (:func:`~knapspec.model.machine.claimed_absent`)."""
    if dtype != torch.bfloat16 or claimed_absent(*AMX_TILE_FLAGS):
        return False
    library = LIBRARY.load()
    return library is not None and bool(library.knapspec_amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight (N, K)`` bf16 as AMX B tiles: zero-padded to ``(16·⌈N/16⌉, 32·⌈K/32⌉)`` and
    laid out ``[n_tile][k_tile][pair][n][2]`` (pairs of consecutive k side by side, VNNI
    order; 1 KiB per 16x32 tile)."""
    n, k = weight.shape
    n16, k32 = -(-n // 16) * 16, -(-k // 32) * 32
    padded = F.pad(weight.detach(), (0, k32 - k, 0, n16 - n))
    return padded.view(n16 // 16, 16, k32 // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed as :func:`amx_pack` lays it out, made on first use and kept while
    the weight lives (made again if it changes in place): what the AMX and packed-linear
    kernels read."""
    return _derived(_amx_packed, weight, amx_pack)


def release_amx_packed() -> None:
    """Drop every packed copy, the AMX and packed-linear kernels' (the probe packs every
    weight it tries; the engine's chosen kernel packs its own again on first use)."""
    _amx_packed.clear()


def packed_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the packed-weight kernel runs here: a bfloat16 model, a build for a CPU
    with AVX512-BF16 (VDPBF16PS), and no claim of a CPU without it
    (:func:`~knapspec.model.machine.claimed_absent`)."""
    if dtype != torch.bfloat16:
        return False
    global _packed_here
    if _packed_here is None:  # asked before every product: the answer cannot change
        library = LIBRARY.load()
        _packed_here = (
            library is not None
            and bool(library.knapspec_packed_available())
            and not claimed_absent(*AVX512_BF16_FLAGS)
        )
    return _packed_here


_packed_here: bool | None = None


def _tiled_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    entry: str,
    what: str,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through a compiled kernel that reads the weight packed
    (:func:`amx_pack`, made on first use and kept while the weight lives): the AMX tiles or
    the packed VDPBF16PS kernel (``entry``, its C function). bfloat16 on CPU, checked by the
    callers. ``x (..., in)``, ``weight (out, in)`` -> ``(..., out)``."""
    library = LIBRARY.load()
    assert library is not None
    shape = x.shape
    in_features = shape[-1]
    out_features = weight.shape[0]
    flat = x if x.dim() == 2 else x.reshape(-1, in_features)
    k = -(-in_features // 32) * 32
    if k != in_features:
        flat = F.pad(flat, (0, k - in_features))
    elif flat.stride(-1) != 1:
        flat = flat.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    packed = packed_weight(weight)
    out = torch.empty((*shape[:-1], out_features), dtype=x.dtype)
    rows = flat.shape[0]
    if rows:
        status = getattr(library, entry)(
            flat.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            k,
            out_features,
            flat.stride(0),
            out_features,
            torch.get_num_threads(),
        )
        if status:
            raise RuntimeError(f"the {what} failed (status {status})")
    return out


def _bf16_on_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and x.is_cpu
    )


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in bfloat16 on the AMX tiles, each row bitwise the same at
    any row count (16-row tiles, rows past the count zero-padded; k in increasing order).

    Args:
        x: ``(..., in)`` bfloat16 on CPU.
        weight: ``(out, in)`` bfloat16 (packed into tiles on first use, kept while it lives).
        bias: ``(out,)`` or None.

    Returns:
        ``(..., out)`` bfloat16. Where the tiles cannot run (another dtype, no AMX, the OS
        refuses them) each row runs its own ``F.linear`` instead (row-invariant as well).
    """
    if not _bf16_on_cpu(x, weight, bias) or not amx_available():
        return one_row_at_a_time(x, weight, bias)
    return _tiled_product(x, weight, bias, "knapspec_amx_linear", "AMX linear kernel")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in bfloat16 on VDPBF16PS with the weight packed in VNNI
    order (the AMX tiles' layout): each output element one float32 chain over the pairs of
    ``k`` in increasing order, so each row is bitwise the same at any row count.

    Args:
        x: ``(..., in)`` bfloat16 on CPU.
        weight: ``(out, in)`` bfloat16 (packed on first use, kept while it lives: a second
            copy of the weight in memory).
        bias: ``(out,)`` or None.

    Returns:
        ``(..., out)`` bfloat16. Where the kernel cannot run (another dtype, a CPU without
        AVX512-BF16) each row runs its own ``F.linear`` instead (row-invariant as well).
    """
    if not _bf16_on_cpu(x, weight, bias) or not packed_available():
        return one_row_at_a_time(x, weight, bias)
    return _tiled_product(x, weight, bias, "knapspec_packed_linear", "packed linear kernel")


__all__ = [
    "AMX_NAME",
    "LIBRARY",
    "NAME",
    "PACKED_NAME",
    "amx_available",
    "amx_linear",
    "amx_pack",
    "available",
    "build_description",
    "one_row_at_a_time",
    "packed_available",
    "packed_linear",
    "packed_weight",
    "release_amx_packed",
    "row_linear",
]
