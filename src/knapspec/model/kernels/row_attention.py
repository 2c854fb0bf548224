"""Row-invariant attention: the attention half of the exactness contract.

The contract (``docs/theory.md``): verifying ``k`` drafted tokens in one pass computes, for
each of them, logits *bitwise equal* to a one-token step at its position. PyTorch's
``scaled_dot_product_attention`` on CPU does not give that. Its blocking and its BLAS
calls depend on how many queries ride along: with 2 to 16 queries against 5 to 2048 cached
keys, a query's output differed from its one-query result in most cases tried, in float32
and bfloat16 alike (``results/engine/HISTORY.md``). In bfloat16 the top two logits are often
near-tied, so greedy speculative decoding drifted from plain decoding within tens of tokens.

So attention over cached keys runs through one small C kernel (``csrc/row_attention.c``)
whose every query row is computed by the same code in the same order, whatever other rows
are in the call: the output of a row depends only on its query, the keys and values it may
see and their count. A one-token step and a ``k``-token verification then agree bitwise by
construction, not by luck of the BLAS.

Tree verification (:func:`attend_tree_rows`) runs the same kernel in tree mode: a row sees
a contiguous prefix of keys and then any subset of the next 64 (its ancestors in a token
tree and itself), and computes bitwise what the contiguous kernel computes over exactly
those keys laid out one after the other, which is what the cache holds once the accepted
path has been compacted (:meth:`knapspec.model.cache.KVCache.compact`).

The kernel is compiled on first use with the system C compiler (about a second, with
``-march=native`` for the machine at hand) into the per-user cache, keyed by the source,
the compiler and the CPU's flags. Where no compiler works the engine falls back to one
``scaled_dot_product_attention`` call per query row (exact, but it reads the cache once per
row) and says so once.

Size: a little over 450 lines: the kernel's four calling forms (rows, batched rows, tree
rows, one query at a time) share its library, its argument packing and the process-wide
choice of the bf16 unit, which the tests reset here.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch
import torch.nn.functional as F

from knapspec.model.kernels.compiled import CompiledLibrary
from knapspec.model.machine import AMX_TILE_FLAGS, AVX512_BF16_FLAGS, claimed_absent

logger = logging.getLogger(__name__)

#: The kernel's dtype codes.
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

#: Up to this many new tokens (a decode step, a verification, a short turn) attend through
#: the row-invariant kernel when the engine is exact; a longer chunk is a prefill, which
#: plain and speculative decoding share, and runs PyTorch's fused attention.
EXACT_MAX_QUERIES = 64

#: A tree row's visibility mask as an unsigned 64-bit value.
_ALL_BITS = (1 << 64) - 1


def _declare(library: ctypes.CDLL) -> None:
    function = library.knapspec_attend_tree
    function.restype = ctypes.c_int
    function.argtypes = [
        *(ctypes.c_void_p,) * 7,
        ctypes.c_int64,
        ctypes.c_int,
        *(ctypes.c_int64,) * 7,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    for probe in (
        library.knapspec_attention_amx_available,
        library.knapspec_attention_dpbf16_available,
    ):
        probe.restype = ctypes.c_int
        probe.argtypes = []


LIBRARY = CompiledLibrary(
    "row_attention.c",
    "the row-invariant attention kernel",
    "verification attends one query at a time instead (exact, slower)",
    _declare,
)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first use; None where it cannot be built or
    loaded (the reason is logged once)."""
    return LIBRARY.load()


#: The largest head size the bf16-unit paths serve (4 tiles of 32 dimensions for the scores).
AMX_MAX_HEAD_DIM = 128

#: The kernel's ``unit`` codes, by path name.
_UNITS = {"vector": 0, "amx-tiles": 1, "avx512-bf16": 2}

#: ``KNAPSPEC_ATTENTION_UNIT`` picks what bf16 attention runs on (for A/B runs; every path
#: keeps the contract, but they differ in rounding, so one process uses one):
#: ``auto`` (default: the AMX tiles where the OS grants them, else ``VDPBF16PS`` where the
#: CPU has AVX512-BF16, else the vector path), ``amx-tiles``, ``avx512-bf16`` or
#: ``vector``. ``KNAPSPEC_AMX_ATTENTION=0`` (the older switch) rules out the tiles.
_UNIT_SWITCH = "KNAPSPEC_ATTENTION_UNIT"
_AMX_SWITCH = "KNAPSPEC_AMX_ATTENTION"

_bf16_unit: str | None = None


def available_bf16_units() -> list[str]:
    """The paths bf16 attention can run on here, fastest first (``vector`` always); a
    claim of a CPU without a path's units (:func:`~knapspec.model.machine.claimed_absent`)
    rules it out."""
    library = load_library()
    if library is None:
        return ["vector"]
    units = []
    if library.knapspec_attention_amx_available() == 1 and not claimed_absent(*AMX_TILE_FLAGS):
        units.append("amx-tiles")
    dot_products = library.knapspec_attention_dpbf16_available() == 1
    if dot_products and not claimed_absent(*AVX512_BF16_FLAGS):
        units.append("avx512-bf16")
    units.append("vector")
    return units


def bf16_attention_unit() -> str:
    """What bf16 attention runs on in this process: ``amx-tiles``, ``avx512-bf16`` or
    ``vector`` (``KNAPSPEC_ATTENTION_UNIT``, above). Decided once per process, so every
    bf16 call (a step, a verification, a tree, a prefill chunk) runs the same arithmetic.

    Raises:
        ValueError: ``KNAPSPEC_ATTENTION_UNIT`` names no path, or one this machine lacks.
    """
    global _bf16_unit
    if _bf16_unit is None:
        units = available_bf16_units()
        if os.environ.get(_AMX_SWITCH, "1") == "0" and "amx-tiles" in units:
            units.remove("amx-tiles")
        wanted = os.environ.get(_UNIT_SWITCH, "auto").strip().lower() or "auto"
        if wanted != "auto" and wanted not in _UNITS:
            raise ValueError(
                f"{_UNIT_SWITCH}={wanted!r} names no attention path; valid: "
                f"auto, {', '.join(_UNITS)}"
            )
        if wanted != "auto" and wanted not in units:
            raise ValueError(
                f"{_UNIT_SWITCH}={wanted!r}, but this CPU, its OS or the compiled kernel does "
                f"not offer it; available here: {', '.join(units)} (or auto)"
            )
        _bf16_unit = units[0] if wanted == "auto" else wanted
        logger.debug("bf16 row-invariant attention runs on %s", _bf16_unit)
    return _bf16_unit


def _unit(dtype: torch.dtype, head_dim: int) -> int:
    """The kernel's ``unit`` argument for one call: the process's bf16 path where it serves
    this call (bf16, an even head size up to ``AMX_MAX_HEAD_DIM``), else the vector path."""
    if dtype != torch.bfloat16 or head_dim % 2 or head_dim > AMX_MAX_HEAD_DIM:
        return 0
    return _UNITS[bf16_attention_unit()]


def attention_path(dtype: torch.dtype, head_dim: int) -> str:
    """What exact attention runs on for ``dtype`` and ``head_dim`` here: ``amx-tiles``,
    ``avx512-bf16`` (``VDPBF16PS``), ``vector`` (the compiled kernel's fp32-FMA path) or
    ``one-query-calls`` (no compiler)."""
    if not kernel_available(dtype):
        return "one-query-calls"
    code = _unit(dtype, head_dim)
    return next(name for name, value in _UNITS.items() if value == code)


def kernel_available(dtype: torch.dtype) -> bool:
    """Whether the compiled kernel serves ``dtype`` on CPU here."""
    return dtype in _DTYPES and load_library() is not None


def attend_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention where query row ``i`` sees keys ``0 .. lengths[i] - 1``.

    Args:
        query: ``(H, q, hd)`` query heads (contiguous after this call's copy if not).
        keys, values: ``(kvH, N, hd)`` with the last dimension contiguous (a view of the
            cache's buffers is fine); query head ``h`` reads K/V head ``h // (H / kvH)``.
        lengths: ``(q,)`` int64, ``1 <= lengths[i] <= N``.
        scale: the softmax scale.

    Returns:
        ``(H, q, hd)`` in the query's dtype. Row ``(h, i)`` is a function of
        ``query[h, i]``, ``keys/values[h // groups, :lengths[i]]`` alone (bitwise).
    """
    library = load_library() if query.device.type == "cpu" and query.dtype in _DTYPES else None
    if library is None:
        return _attend_one_by_one(query, keys, values, lengths, scale)
    out = _run_kernel(library, query, keys, values, lengths, None, scale)
    assert out is not None  # only tree rows are ever refused
    return out


def attend_rows_batched(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """:func:`attend_rows` for every sequence of a batch in one kernel call: sequence ``b``'s
    query row ``i`` sees its own keys ``0 .. lengths[b, i] - 1``. Each query row's output is
    a function of its query, its keys/values and its length alone, so the result is bitwise
    :func:`attend_rows` per sequence (one call per layer instead of one per sequence: at 16
    sequences the per-call overhead had been a third of a batched round).

    Args:
        query: ``(B, H, q, hd)``.
        keys, values: ``(B, kvH, N, hd)`` views whose first two dimensions merge (a batch
            cache's buffers: ``(rows, kvH, capacity, hd)`` cut to ``[:B, :, :N]``).
        lengths: ``(B, q)`` int64, ``1 <= lengths <= N`` (padding rows: 1).
        scale: the softmax scale.

    Returns:
        ``(B, H, q, hd)``, or None where the compiled kernel does not serve (the caller
        then attends sequence by sequence).
    """
    batch, heads, q_len, head_dim = query.shape
    library = load_library() if query.device.type == "cpu" and query.dtype in _DTYPES else None
    if library is None:
        return None
    kv_heads, n_keys = keys.shape[1], keys.shape[2]
    merged_keys = keys.reshape(batch * kv_heads, n_keys, head_dim)
    merged_values = values.reshape(batch * kv_heads, n_keys, head_dim)
    if merged_keys.stride() != merged_values.stride() or merged_keys.stride(-1) != 1:
        merged_keys, merged_values = merged_keys.contiguous(), merged_values.contiguous()
    folded = query.reshape(batch * heads, q_len, head_dim).contiguous()
    call = BatchedAttention(library, lengths, heads, kv_heads, head_dim, query.dtype, scale)
    out = call(folded, merged_keys, merged_values)
    assert out is not None  # only tree rows are ever refused
    return out.view(batch, heads, q_len, head_dim)


class BatchedAttention:
    """:func:`attend_rows_batched`'s kernel call, prepared once for a pass's layers: ``lengths
    (B, q)`` int64 keys each query row sees, or for one sequence ``tree = (prefix, visible)``
    (``(q,)`` each, as :func:`attend_tree_rows`); the model's ``heads``, ``kv_heads``,
    ``head_dim``, ``dtype`` (float32 or bfloat16) and softmax ``scale``; ``library``."""

    def __init__(
        self,
        library: ctypes.CDLL,
        lengths: torch.Tensor | None,
        heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # Row (b, h, i) sits at row t * q + i of K/V head (b, g) for h = g * groups + t;
        # tree rows are read at row % q by the kernel.
        if lengths is not None:
            batch, self.q_len = lengths.shape
            per_row = lengths.to(torch.int64)[:, None, :].expand(batch, heads, self.q_len)
            self._rows: tuple[torch.Tensor | None, ...] = (per_row.contiguous(), None, None)
        elif tree is not None:
            batch, self.q_len = 1, tree[0].numel()
            self._rows = (None, *(t.to("cpu", torch.int64).contiguous() for t in tree))
        else:
            raise ValueError("the attention call needs per-row lengths or a tree")
        self._library, self.head_dim, self._scale = library, head_dim, float(scale)
        self.total_kv, self.rows_per_kv_head = batch * kv_heads, heads // kv_heads * self.q_len
        self._dtype, self._unit = _DTYPES[dtype], _unit(dtype, head_dim)
        self._threads = torch.get_num_threads()
        self._chunk = _chunk_rows(
            self.total_kv, self.rows_per_kv_head, self._threads, bool(self._unit)
        )

    def row_pointers(self) -> tuple[int | None, int | None, int | None]:
        """The kernel's ``lengths``, ``tree_prefix`` and ``tree_visible`` arguments (data
        pointers, None where unused), for a caller that calls the kernel from C
        (:mod:`knapspec.model.kernels.layer_loop`; this object keeps the tensors alive)."""
        lengths, prefix, visible = (t.data_ptr() if t is not None else None for t in self._rows)
        return lengths, prefix, visible

    @property
    def settings(self) -> tuple[int, int, float, int]:
        """The kernel's ``chunk``, ``unit``, ``scale`` and ``threads`` arguments."""
        return self._chunk, self._unit, self._scale, self._threads

    def __call__(
        self, folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor | None:
        """``folded (B * H, q, hd)`` contiguous queries over ``keys``/``values
        (B * kvH, N, hd)`` (unit last stride, equal strides) -> ``(B * H, q, hd)``; None
        where the kernel refuses a tree row (one that sees no key, or keys past ``N``)."""
        out = torch.empty_like(folded)
        status = self._library.knapspec_attend_tree(
            folded.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            *(t.data_ptr() if t is not None else None for t in self._rows),
            self.q_len,
            self._dtype,
            self.total_kv,
            self.rows_per_kv_head,
            self.head_dim,
            keys.stride(0),
            keys.stride(1),
            keys.shape[1],
            self._chunk,
            self._scale,
            self._threads,
            self._unit,
        )
        if status == 3:
            return None
        if status:  # an allocation failure
            raise RuntimeError(f"row-invariant attention kernel failed (status {status})")
        return out


def attend_tree_rows(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    prefix: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`attend_rows` where row ``i`` sees keys ``0 .. prefix[i] - 1`` and the keys
    ``prefix[i] + t`` (``0 <= t < 64``) whose bit ``t`` is set in ``visible[i]``.

    Args:
        query: ``(H, q, hd)``; keys, values: ``(kvH, N, hd)``, as for :func:`attend_rows`.
        prefix: ``(q,)`` int64, ``>= 0``.
        visible: ``(q,)`` int64 holding 64-bit masks (bit 63 is the sign bit); every visible
            key must exist (``prefix[i] + t < N``) and every row must see at least one key.
        scale: the softmax scale.

    Returns:
        ``(H, q, hd)`` in the query's dtype. Row ``(h, i)`` is bitwise what
        :func:`attend_rows` computes for that query over the row's visible keys and values
        gathered into consecutive positions (length ``prefix[i] + popcount(visible[i])``),
        on the compiled kernel and on the fallback alike.
    """
    if prefix.shape != (query.shape[1],) or visible.shape != (query.shape[1],):
        raise ValueError(
            f"prefix and visible need one entry per query row ({query.shape[1]}), got shapes "
            f"{tuple(prefix.shape)} and {tuple(visible.shape)}"
        )
    library = load_library() if query.device.type == "cpu" and query.dtype in _DTYPES else None
    if library is None:
        rows = [
            torch.cat([torch.arange(first), first + _bit_positions(mask)])
            for first, mask in _tree_rows(prefix, visible, keys.shape[1])
        ]
        return _attend_one_by_one(query, keys, values, None, scale, rows)
    # The kernel checks the rows itself (status 3): no Python loop per layer on this path.
    tree = (prefix.to("cpu", torch.int64), visible.to("cpu", torch.int64))
    out = _run_kernel(library, query, keys, values, None, tree, scale)
    if out is None:
        _tree_rows(prefix, visible, keys.shape[1])  # raises, saying which row
        raise RuntimeError("the kernel refused tree rows that pass the Python check")
    return out


def _tree_rows(prefix: torch.Tensor, visible: torch.Tensor, n_keys: int) -> list[tuple[int, int]]:
    """``(prefix, unsigned mask)`` per tree row, checked against ``n_keys`` keys."""
    rows = []
    for row, (first, signed) in enumerate(zip(prefix.tolist(), visible.tolist(), strict=True)):
        mask = int(signed) & _ALL_BITS
        span = first + mask.bit_length()
        if first < 0 or span > n_keys or first + mask.bit_count() == 0:
            raise ValueError(
                f"row {row}: prefix {first} with visible mask {mask:#x} needs keys "
                f"0 .. {span - 1} of {n_keys} and at least one visible key"
            )
        rows.append((int(first), mask))
    return rows


def _bit_positions(mask: int) -> torch.Tensor:
    """``(popcount,)`` int64: the set bits of ``mask``, increasing."""
    return torch.tensor([t for t in range(mask.bit_length()) if mask >> t & 1], dtype=torch.int64)


def _run_kernel(
    library: ctypes.CDLL,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    tree: tuple[torch.Tensor, torch.Tensor] | None,
    scale: float,
) -> torch.Tensor | None:
    """One call of the compiled kernel: contiguous rows (``lengths``) or tree rows
    (``tree = (prefix, visible)``), all ``(q,)`` int64. None when the kernel refuses a
    tree row (one that sees no key, or keys past ``N``)."""
    heads, q_len, head_dim = query.shape
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    rows = None if lengths is None else lengths.reshape(1, q_len)
    call = BatchedAttention(library, rows, heads, keys.shape[0], head_dim, query.dtype, scale, tree)
    return call(query.contiguous(), keys, values)


def _chunk_rows(kv_heads: int, rows_per_kv_head: int, threads: int, tiles: bool = False) -> int:
    """Rows per task: all of a K/V head's rows together (each key loaded once for them)
    unless that leaves a thread idle; the split changes no row's arithmetic. On the bf16
    units (``tiles``) a split is in whole 16-row groups: a part tile costs what a full one
    does, and each task repacks its head's keys."""
    if kv_heads % threads == 0 or kv_heads >= 4 * threads:
        return rows_per_kv_head
    chunk = max(1, -(-rows_per_kv_head * kv_heads // (threads * kv_heads)))
    return -(-chunk // 16) * 16 if tiles else chunk


def _attend_one_by_one(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor | None,
    scale: float,
    gathered: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The fallback: each query position in its own one-query call (what a one-token step
    runs), so every row is computed exactly as a one-token step computes it. Row ``i``
    sees keys ``0 .. lengths[i] - 1``, or with ``gathered`` (tree rows) the keys at the
    increasing indices ``gathered[i]``, copied together first."""
    heads, q_len, head_dim = query.shape
    kv_heads = keys.shape[0]
    groups = heads // kv_heads
    ends = lengths.tolist() if lengths is not None else [0] * q_len
    rows = []
    for i in range(q_len):
        packed = query[:, i].reshape(1, kv_heads, groups, head_dim)
        if gathered is None:  # a view of the first keys, as a one-token step reads them
            row_keys, row_values = keys[:, : ends[i]], values[:, : ends[i]]
        else:
            index = gathered[i].to(keys.device)
            row_keys, row_values = keys.index_select(1, index), values.index_select(1, index)
        rows.append(
            F.scaled_dot_product_attention(
                packed, row_keys[None], row_values[None], scale=scale
            ).reshape(heads, 1, head_dim)
        )
    return torch.cat(rows, dim=1)
