"""Fused projections: linear layers that read the same input, run as one matrix product.

A decode step of SmolLM2-135M makes 211 small matrix products; each call carries a fixed
cost (Python, dispatch, the BLAS threads' hand-off) on top of streaming its weights. The
query/key/value projections read the same normed input, and so do the MLP's gate and up
projections: stacking their weights row-wise turns seven products a layer into four, three
fixed costs fewer a layer, with bit-identical outputs. The engine fuses only few-row
products (decode, verify), where that fixed cost weighs: in a prefill the strided column
blocks of one fused output slowed the element-wise ops after it by more than the fusion
saved (figures: ``results/engine/HISTORY.md``, "Figures behind docstrings").

The fused matrix is not a copy. The layers' ``weight`` (and ``bias``) parameters are
re-pointed at row blocks of one new contiguous tensor, with the same values, so memory
stays the same and the model itself (``model.generate``, ``state_dict``) behaves as
before. ``save_pretrained`` clones such disjoint views when it writes. A model whose
weights are replaced afterwards (``model.to(...)``, a new ``nn.Parameter``) no longer
aliases the fused tensor: :meth:`FusedProjection.is_current` sees it and the engine falls
back to the layers themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

#: Attribute on each fused ``nn.Linear`` pointing at its :class:`FusedProjection`, so that
#: a second engine on the same model reuses the fusion instead of making another.
FUSED_ATTRIBUTE = "_knapspec_fused"


@attrs.frozen(eq=False)
class FusedProjection:
    """Linear layers whose weights are consecutive row blocks of one matrix.

    Attributes:
        weight: ``(sum(sizes), in_features)`` contiguous; each part's ``weight`` is a view
            of its block of rows.
        bias: ``(sum(sizes),)`` or None, laid out the same way.
        sizes: ``out_features`` of each part.
        parts: the fused layers, in order.
        views: per part, the ``weight`` and ``bias`` parameters the fusion gave it and the
            weight's data pointer, for :meth:`is_current`.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    parts: tuple[nn.Linear, ...]
    views: tuple[tuple[torch.Tensor, torch.Tensor | None, int], ...]

    def is_current(self) -> bool:
        """Whether every part still holds the views this fusion made (a few identity and
        pointer comparisons, cheap enough for every step; a model moved with ``.to()`` or a
        layer given a new parameter fails it)."""
        for part, (weight, bias, pointer) in zip(self.parts, self.views, strict=True):
            parameters = part._parameters
            if parameters["weight"] is not weight or weight.data_ptr() != pointer:
                return False
            if parameters.get("bias") is not bias:
                return False
        return True

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(..., sum(sizes))`` fused output -> one ``(..., size)`` view per part."""
        return tuple(torch.split(output, list(self.sizes), dim=-1))


def _fusable(parts: Sequence[nn.Module | None]) -> bool:
    """Plain, hook-free ``nn.Linear`` layers over one input, alike in dtype, device and bias."""
    if len(parts) < 2 or any(type(part) is not nn.Linear for part in parts):
        return False
    first = parts[0]
    assert isinstance(first, nn.Linear)
    for part in parts:
        assert isinstance(part, nn.Linear)
        if (
            part.in_features != first.in_features
            or part.weight.dtype != first.weight.dtype
            or part.weight.device != first.weight.device
            or part.weight.dim() != 2
            or (part.bias is None) != (first.bias is None)
            or part._forward_hooks
            or part._forward_pre_hooks
            or hasattr(part, "_hf_hook")  # accelerate's device hooks move tensors per call
        ):
            return False
    return True


def fuse_linears(parts: Sequence[nn.Module | None]) -> FusedProjection | None:
    """Fuse ``parts`` in place (see the module docstring), or reuse their current fusion.

    Returns None, touching nothing, when the layers cannot be fused (missing, not plain
    ``nn.Linear``, hooked, mixed dtypes or devices, different inputs).
    """
    if not _fusable(parts):
        return None
    linears = tuple(part for part in parts if isinstance(part, nn.Linear))
    existing = getattr(linears[0], FUSED_ATTRIBUTE, None)
    if (
        isinstance(existing, FusedProjection)
        and existing.parts == linears
        and existing.is_current()
    ):
        return existing
    with torch.no_grad():
        weight = torch.cat([part.weight.detach() for part in linears]).contiguous()
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([part.bias.detach() for part in linears if part.bias is not None])
        offset = 0
        for part in linears:
            size = part.out_features
            requires_grad = part.weight.requires_grad
            part.weight = nn.Parameter(weight[offset : offset + size], requires_grad=requires_grad)
            if bias is not None and part.bias is not None:
                part.bias = nn.Parameter(
                    bias[offset : offset + size], requires_grad=part.bias.requires_grad
                )
            offset += size
    views = tuple((part.weight, part.bias, part.weight.data_ptr()) for part in linears)
    sizes = tuple(part.out_features for part in linears)
    fused = FusedProjection(weight, bias, sizes, linears, views)
    for part in linears:
        setattr(part, FUSED_ATTRIBUTE, fused)
    return fused


__all__ = ["FUSED_ATTRIBUTE", "FusedProjection", "fuse_linears"]
