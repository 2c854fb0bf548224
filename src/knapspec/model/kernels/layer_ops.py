"""A decoder layer's small operations as single compiled calls (``csrc/layer_ops.c``).

Besides its products, a decode step of SmolLM2-135M ran ~1,200 PyTorch operations of a
few microseconds each: RMSNorm is eight (cast, square, mean, add, rsqrt, multiply, cast,
scale), rotary fourteen, a K/V write two indexed copies. In bfloat16 the small operations
and their Python were about a third of a one-row step and of a 16-row batched round
(figures: ``results/engine/HISTORY.md``). Three become one call each:

- :func:`rms_norm`: the Llama/Qwen/Mistral RMSNorm, variance in float32, and Gemma's
  (scaled by ``1 + weight`` in float32 before the one cast);
- :func:`rotary_`: rotary embedding in place, bitwise HF's ``apply_rotary_pos_emb``;
- :func:`scatter_`: each token's K/V heads into its row and position of a cache buffer,
  bitwise an indexed copy.

All are row-invariant by construction (rows share no arithmetic). RMSNorm is within a
unit in the last place of PyTorch's, not bitwise (another summation order), so an engine
normalises with it on all of its paths or on none (the engine decides once, after checking
both against the model's own modules). Where the C compiler is missing
every function here is unavailable and the engine keeps PyTorch's operations.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from knapspec.model.kernels.compiled import CompiledLibrary

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

#: A model family's ``apply_rotary_pos_emb(q, k, cos, sin) -> (q, k)``.
RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "knapspec_rms_norm": [ptr, ptr, ptr, i64, i64, i64, ctypes.c_float, c_int, c_int, c_int],
        "knapspec_rotary": [ptr, ptr, ptr, i64, i64, i64, i64, c_int],
        "knapspec_scatter": [ptr, ptr, ptr, ptr, *(i64,) * 7],
    }
    for name, arguments in signatures.items():
        function = getattr(library, name)
        function.restype = c_int
        function.argtypes = arguments


LIBRARY = CompiledLibrary(
    "layer_ops.c",
    "the compiled layer operations",
    "RMSNorm, rotary and K/V writes run as PyTorch operations",
    _declare,
    flags=("-ffp-contract=off",),
)


def available(dtype: torch.dtype) -> bool:
    """Whether the compiled operations serve ``dtype`` on CPU here."""
    return dtype in _DTYPES and LIBRARY.load() is not None


def _library() -> ctypes.CDLL:
    library = LIBRARY.load()
    if library is None:
        raise RuntimeError("the compiled layer operations are unavailable here (no C compiler)")
    return library


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"the compiled {what} refused its input (status {status})")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x (..., d)`` as ``(rows, d)`` with unit stride along ``d`` (a view where possible)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x²) + eps))``, normalised in float32 and cast to ``x``'s
    dtype before the weight is applied (HF's ``LlamaRMSNorm``); with ``unit_offset``,
    ``(x / sqrt(mean(x²) + eps)) * (1 + weight)`` all in float32, then cast (Gemma's).

    Args:
        x: ``(..., d)`` float32 or bfloat16 on CPU.
        weight: ``(d,)``, same dtype.
        eps: added to the variance.
        unit_offset: scale by ``1 + weight`` (Gemma's RMSNorm).

    Returns:
        ``(..., d)``, a new contiguous tensor.
    """
    flat = _rows(x)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _check(
        _library().knapspec_rms_norm(
            flat.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            flat.shape[0],
            flat.shape[1],
            flat.stride(0),
            eps,
            _DTYPES[x.dtype],
            torch.get_num_threads(),
            int(unit_offset),
        ),
        "RMSNorm",
    )
    return out


def _token_heads(x: torch.Tensor) -> torch.Tensor | None:
    """``x (b, q, heads, head_dim)`` as a ``(b * q, heads, head_dim)`` view with unit
    element stride and heads side by side, or None where its strides do not allow one."""
    batch, q_len, heads, head_dim = x.shape
    # A size-1 dimension's stride is arbitrary: the token stride is the other one's.
    token_stride = x.stride(0) if q_len == 1 else x.stride(1)
    if (
        x.stride(3) != 1
        or (heads > 1 and x.stride(2) != head_dim)
        or (batch > 1 and q_len > 1 and x.stride(0) != q_len * x.stride(1))
    ):
        return None
    return x.as_strided((batch * q_len, heads, head_dim), (token_stride, head_dim, 1))


def rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotary embedding of queries and keys in place, bitwise HF's
    ``x * cos + rotate_half(x) * sin``.

    Args:
        query: ``(b, q, H, hd)``, key ``(b, q, kvH, hd)``: each with unit element stride
            and its heads side by side (any token stride: the parts of a fused product).
        cos, sin: ``(b, q, hd)`` in their dtype.

    Returns:
        False, and nothing changed, where a layout does not allow it in place (the caller
        then runs the model's rotary); True once both are rotated.
    """
    batch, q_len, _, head_dim = query.shape
    query_view, key_view = _token_heads(query), _token_heads(key)
    if (
        query_view is None
        or key_view is None
        or query.dtype not in _DTYPES
        or key.dtype != query.dtype
        or tuple(key.shape[:2]) != (batch, q_len)
        or key.shape[3] != head_dim
        or any(
            table.dtype != query.dtype or tuple(table.shape) != (batch, q_len, head_dim)
            for table in (cos, sin)
        )
    ):
        return False
    tokens = batch * q_len
    cos = cos.reshape(tokens, head_dim).contiguous()
    sin = sin.reshape(tokens, head_dim).contiguous()
    rotary_heads_(query_view, cos, sin)
    rotary_heads_(key_view, cos, sin)
    return True


def rotary_heads_(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place of ``heads (tokens, H, hd)`` (unit element stride, heads
    side by side, any token stride) with ``cos``/``sin`` ``(tokens, hd)`` contiguous in its
    dtype: :func:`rotary_` after its layout checks, which the caller has made."""
    _check(
        _library().knapspec_rotary(
            heads.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            heads.shape[0],
            heads.shape[1],
            heads.shape[2],
            heads.stride(0),
            _DTYPES[heads.dtype],
        ),
        "rotary",
    )


def scatter_(
    buffer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, source: torch.Tensor
) -> bool:
    """``buffer[rows, :, positions] = source`` (K/V of new tokens into a cache), bitwise.

    Args:
        buffer: ``(slots, heads, capacity, head_dim)``, contiguous.
        rows, positions: ``(b, q)`` int64, contiguous: each token's slot and position.
        source: ``(b, q, heads, head_dim)`` with unit element stride, heads side by side.

    Returns:
        False, and nothing written, where a layout does not allow the compiled copy.

    Raises:
        RuntimeError: an index outside the buffer (checked in the copy).
    """
    view = _token_heads(source)
    library = LIBRARY.load()
    if (
        library is None
        or view is None
        or not buffer.is_contiguous()
        or source.dtype != buffer.dtype
        or buffer.dtype not in _DTYPES
        or rows.dtype != torch.int64
        or positions.dtype != torch.int64
        or not rows.is_contiguous()
        or not positions.is_contiguous()
        or rows.numel() != view.shape[0]
        or positions.numel() != view.shape[0]
        or tuple(buffer.shape[1:2] + buffer.shape[3:]) != tuple(view.shape[1:])
    ):
        return False
    scatter_heads_(buffer, rows, positions, view)
    return True


def scatter_heads_(
    buffer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, heads: torch.Tensor
) -> None:
    """:func:`scatter_` after its layout checks, which the caller has made: ``heads
    (tokens, H, hd)`` (unit element stride, heads side by side) into the contiguous
    ``buffer (slots, H, capacity, hd)`` of its dtype at ``rows``/``positions`` (``tokens``
    int64 each, contiguous)."""
    _check(
        _library().knapspec_scatter(
            heads.data_ptr(),
            buffer.data_ptr(),
            rows.data_ptr(),
            positions.data_ptr(),
            heads.shape[0],
            heads.shape[1],
            heads.shape[2],
            heads.stride(0),
            buffer.shape[0],
            buffer.shape[2],
            buffer.element_size(),
        ),
        "K/V write",
    )


#: RMSNorm classes that scale by ``1 + weight`` in float32 before casting (HF's Gemma
#: family); every other ``*RMSNorm`` is taken for the Llama form. :func:`serves_norms`
#: checks the output either way, so a class named wrongly here is refused, not miscomputed.
UNIT_OFFSET_NORMS: frozenset[str] = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})


def _epsilon(norm: nn.Module) -> float | None:
    """An RMSNorm module's epsilon (``variance_epsilon`` in Llama's form, ``eps`` in
    Gemma's), or None."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


def apply_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """:func:`rms_norm` with an RMSNorm module's weight, epsilon and form (one that
    :func:`serves_norms` accepted)."""
    weight = cast(torch.Tensor, norm.weight)
    unit_offset = type(norm).__name__ in UNIT_OFFSET_NORMS
    return rms_norm(x, weight, cast(float, _epsilon(norm)), unit_offset)


def serves_norms(norms: Sequence[nn.Module], dtype: torch.dtype) -> bool:
    """Whether :func:`rms_norm` computes every module of ``norms`` (a model's layer norms,
    or its q/k norms) here: each an RMSNorm with a ``(d,)`` weight and an epsilon, all of
    one class, and the first one's output on a test input equal to :func:`rms_norm`'s
    within a unit in the last place."""
    if not norms or not available(dtype):
        return False
    for module in norms:
        weight = getattr(module, "weight", None)
        if (
            not type(module).__name__.endswith("RMSNorm")
            or type(module) is not type(norms[0])
            or not isinstance(weight, torch.Tensor)
            or weight.dim() != 1
            or weight.dtype != dtype
            or not weight.is_cpu
            or _epsilon(module) is None
        ):
            return False
    first = norms[0]
    generator = torch.Generator().manual_seed(0)
    width = cast(torch.Tensor, first.weight).shape[0]
    x = (torch.randn(3, width, generator=generator) * 4).to(dtype)
    with torch.inference_mode():
        expected = first(x)
    if expected.shape != x.shape or expected.dtype != dtype:
        return False
    got = apply_norm(first, x)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    return bool(torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance))


def serves_rotary(
    apply_rotary: RotaryFn, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> bool:
    """Whether :func:`rotary_` is bitwise the model's ``apply_rotary_pos_emb`` here (HF's
    ``rotate_half`` form), checked on a test input of the model's head shapes."""
    if not available(dtype) or head_dim % 2:
        return False
    generator = torch.Generator().manual_seed(0)
    tokens = 3

    def sample(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    packed = sample(1, tokens, heads + kv_heads, head_dim)  # a fused product's layout
    cos, sin = sample(1, tokens, head_dim), sample(1, tokens, head_dim)
    query, key = packed[:, :, :heads], packed[:, :, heads:]
    with torch.inference_mode():
        expected_query, expected_key = apply_rotary(
            query.transpose(1, 2), key.transpose(1, 2), cos, sin
        )
        rotated = packed.clone()
        if not rotary_(rotated[:, :, :heads], rotated[:, :, heads:], cos, sin):
            return False
    return torch.equal(rotated[:, :, :heads], expected_query.transpose(1, 2)) and torch.equal(
        rotated[:, :, heads:], expected_key.transpose(1, 2)
    )


__all__ = [
    "LIBRARY",
    "apply_norm",
    "available",
    "rms_norm",
    "rotary_",
    "rotary_heads_",
    "scatter_",
    "scatter_heads_",
    "serves_norms",
    "serves_rotary",
]
