"""The LM head seen by Lemma 4.1: its rows, their distances, and the space the lemma works in.

The head acts on the *final-normed* state ``final_norm(h) = g ⊙ h / rms(h)`` (RMSNorm with
a per-channel gain ``g``), never on the residual stream ``h`` itself. Two coordinate
systems give the same logits and are both handled here (:data:`LemmaSpace`):

* ``"normed"``: ``x = final_norm(h)`` and the head ``W`` as is;
* ``"folded"``: ``x = h / rms(h)`` and the head ``W diag(g)`` (the gain folded into the
  head). Here ``‖x‖ = sqrt(d)`` up to the norm's epsilon, and ``cos(x, x') = cos(h, h')``
  is exactly the cosine the KnapSpec DP maximises on the residual stream.

:class:`HeadGeometry` represents the folded head without materialising it: with a channel
scale ``g``, inner products between rows use the metric ``diag(g²)``. It computes the
lemma's ``D = max_{j≠i*} ‖w_i* - w_j‖`` with one matmul per chunk of distinct ``i*`` and
caches it per ``i*``. The margins, thresholds and certificates built on it are in
:mod:`knapspec.proxies.lemma`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
from torch import nn

from knapspec.validators import check_finite

LemmaSpace = Literal["normed", "folded"]

#: Rows of the Gram block computed at once; bounds memory at ``chunk * V`` floats.
_GRAM_CHUNK = 64


def check_head(weight: torch.Tensor) -> None:
    """Refuse anything but a ``(V, d)`` head with ``V >= 2``."""
    if weight.dim() != 2:
        raise ValueError(
            f"LM head weight must be (vocab, d_model), got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 2:
        raise ValueError(f"the lemma needs a vocabulary of at least 2 rows, got {weight.shape[0]}")


def check_states(name: str, states: torch.Tensor, d_model: int) -> None:
    """Refuse states that are not ``(..., d_model)``, empty, or not finite."""
    if states.dim() < 1 or states.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have shape (..., {d_model}) to match the LM head, got "
            f"{tuple(states.shape)}"
        )
    if states.numel() == 0:
        raise ValueError(f"{name} is empty (no tokens in the window)")
    check_finite(states, name)


def max_row_distance(weight: torch.Tensor, i_star: torch.Tensor) -> torch.Tensor:
    """``max_{j≠i*} ‖w_i* - w_j‖`` for every entry of ``i_star`` (uncached).

    Vectorised over the vocabulary with ``‖w_i‖² + ‖w_j‖² - 2<w_i, w_j>``: one matmul per
    chunk of distinct ``i*``. Use :class:`HeadGeometry` to cache the result per ``i*``.

    Args:
        weight: ``(V, d)``; i_star: ``(...)`` integer row indices.

    Returns:
        ``(...)`` distances in ``weight``'s floating dtype.
    """
    return HeadGeometry(weight, cache_size=0).max_row_distance(i_star)


class HeadGeometry:
    """The LM head's rows, with row norms and a per-``i*`` cache of the lemma's distance.

    With ``channel_scale = g`` the rows are those of ``W diag(g)`` (the "folded" head) but
    are never materialised: ``<w̃_i, w̃_j> = Σ_k g_k² w_ik w_jk``.

    Args:
        weight: ``(V, d)`` LM-head weight.
        channel_scale: ``(d,)`` per-channel gain folded into the head, or None.
        cache_size: how many ``i*`` distances to keep (least recently used evicted).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        channel_scale: torch.Tensor | None = None,
        *,
        cache_size: int = 4096,
    ) -> None:
        check_head(weight)
        check_finite(weight, "LM head weight")
        weight = weight.detach()
        if not weight.is_floating_point():
            raise TypeError(f"LM head weight must be floating point, got {weight.dtype}")
        if channel_scale is not None:
            if channel_scale.shape != (weight.shape[1],):
                raise ValueError(
                    f"channel_scale must have shape ({weight.shape[1]},), got "
                    f"{tuple(channel_scale.shape)}"
                )
            channel_scale = channel_scale.detach().to(weight.dtype)
            check_finite(channel_scale, "channel_scale")
        self.weight = weight
        self.channel_scale = channel_scale
        self.cache_size = cache_size
        metric = None if channel_scale is None else channel_scale.square()
        self._metric = metric
        squared = weight.square() if metric is None else weight.square() * metric
        self.row_norms_sq: torch.Tensor = squared.sum(dim=1)  # (V,)
        self._max_distance: OrderedDict[int, float] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[1])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., d) -> (..., V)``: ``<w̃_i, x>`` for every row."""
        check_states("x", x, self.d_model)
        scaled = x if self.channel_scale is None else x * self.channel_scale.to(x.dtype)
        return scaled @ self.weight.T.to(x.dtype)

    def row_distances(self, rows: torch.Tensor) -> torch.Tensor:
        """``(k,) -> (k, V)``: ``‖w̃_i - w̃_j‖`` for each ``i`` in ``rows`` and every ``j``.

        Rounding can make ``‖a‖² + ‖b‖² - 2<a, b>`` slightly negative; it is clamped at 0.
        The absolute error is about ``sqrt(d·u)·‖w‖`` for nearly equal rows.
        """
        rows = rows.to(torch.long).reshape(-1)
        if rows.numel() and not (int(rows.min()) >= 0 and int(rows.max()) < self.vocab_size):
            raise IndexError(f"row index out of range [0, {self.vocab_size})")
        blocks = []
        for chunk in torch.split(rows, _GRAM_CHUNK):
            selected = self.weight[chunk]
            if self._metric is not None:
                selected = selected * self._metric
            gram = selected @ self.weight.T  # (k, V): one matmul per chunk of distinct rows
            squared = self.row_norms_sq[chunk, None] + self.row_norms_sq[None, :] - 2 * gram
            blocks.append(squared.clamp_min(0).sqrt())
        if not blocks:
            return self.weight.new_empty((0, self.vocab_size))
        return torch.cat(blocks)

    def max_row_distance(self, i_star: torch.Tensor) -> torch.Tensor:
        """``max_{j≠i*} ‖w̃_i* - w̃_j‖`` per entry of ``i_star (...)``, cached per ``i*``."""
        flat = i_star.reshape(-1).to(torch.long).cpu()
        distinct = sorted({int(i) for i in flat.tolist()})
        missing = [i for i in distinct if i not in self._max_distance]
        found: dict[int, float] = {i: self._max_distance[i] for i in distinct if i not in missing}
        if missing:
            rows = torch.tensor(missing, dtype=torch.long, device=self.weight.device)
            for i, value in zip(missing, self.farthest(rows).tolist(), strict=True):
                found[i] = value
        for i in distinct:
            self.remember(i, found[i])
        values = torch.tensor([found[int(i)] for i in flat.tolist()], dtype=self.weight.dtype)
        return values.reshape(i_star.shape).to(self.weight.device)

    def farthest(self, rows: torch.Tensor, distances: torch.Tensor | None = None) -> torch.Tensor:
        """``(k,)`` ``max_{j≠i} ‖w̃_i - w̃_j‖`` for distinct ``rows (k,)``.

        The Gram form picks the farthest row ``j``; its distance is then recomputed from the
        difference ``w̃_i - w̃_j`` directly, which removes the form's cancellation error
        (about ``sqrt(u)·‖w‖`` absolute) from the returned value.
        """
        if distances is None:
            distances = self.row_distances(rows)
        distances = distances.clone()
        distances[torch.arange(len(rows)), rows] = -1.0  # exclude j = i*
        farthest = distances.argmax(dim=1)
        difference = self.weight[rows] - self.weight[farthest]
        if self.channel_scale is not None:
            difference = difference * self.channel_scale
        exact: torch.Tensor = difference.norm(dim=1)
        return exact

    def remember(self, i: int, value: float) -> None:
        """Cache the distance of row ``i`` (no-op when ``cache_size`` is 0)."""
        if self.cache_size <= 0:
            return
        self._max_distance[i] = value
        self._max_distance.move_to_end(i)
        while len(self._max_distance) > self.cache_size:
            self._max_distance.popitem(last=False)

    def cache_info(self) -> int:
        """Number of cached ``i*`` distances."""
        return len(self._max_distance)

    @classmethod
    def for_lm_head(
        cls, lm_head: nn.Module, final_norm: nn.Module, space: LemmaSpace
    ) -> HeadGeometry:
        """Geometry of a model's head in ``space`` (see the module docstring)."""
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError("lm_head has no weight tensor")
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("Lemma 4.1 is stated for a head without bias; this lm_head has one")
        if space == "normed":
            return cls(weight.float())
        if space == "folded":
            return cls(weight.float(), rms_norm_gain(final_norm).float())
        raise ValueError(f"unknown lemma space {space!r}; valid: 'normed', 'folded'")


def rms_norm_gain(final_norm: nn.Module) -> torch.Tensor:
    """The per-channel gain ``g`` of an RMSNorm: its ``weight`` (Llama's convention) or
    ``1 + weight`` (Gemma's), whichever the module computes, checked on a probe input."""
    return _rms_norm_parts(final_norm)[0]


def _rms_norm_parts(final_norm: nn.Module) -> tuple[torch.Tensor, float]:
    """``(gain, eps)`` of an RMSNorm (see :func:`rms_norm_gain`)."""
    weight = getattr(final_norm, "weight", None)
    eps = getattr(final_norm, "variance_epsilon", getattr(final_norm, "eps", None))
    if isinstance(weight, torch.Tensor) and isinstance(eps, float) and weight.dim() == 1:
        probe = torch.linspace(-2.0, 3.0, weight.numel()).unsqueeze(0)
        with torch.inference_mode():
            expected = final_norm(probe.to(weight.dtype)).float()
        scaled = probe * torch.rsqrt(probe.square().mean(dim=-1, keepdim=True) + eps)
        tolerance = 1e-2 if weight.dtype != torch.float32 else 1e-5
        for gain in (weight.detach(), 1.0 + weight.detach()):
            if torch.allclose(scaled * gain.float(), expected, rtol=tolerance, atol=tolerance):
                return gain, float(eps)
    raise TypeError(
        f"final norm {type(final_norm).__name__} is not an RMSNorm with a weight and an "
        "epsilon that scales by weight or 1 + weight; the folded space needs one"
    )


def lemma_states(hidden: torch.Tensor, final_norm: nn.Module, space: LemmaSpace) -> torch.Tensor:
    """Map residual states ``h (..., d)`` to the vectors the lemma is applied to, in float32.

    ``"normed"``: ``final_norm(h)``. ``"folded"``: ``h * rsqrt(mean(h²) + eps)``, the RMSNorm
    without its gain (which :meth:`HeadGeometry.for_lm_head` folds into the head).
    """
    if space == "normed":
        with torch.inference_mode():
            normed: torch.Tensor = final_norm(hidden)
        return normed.float()
    if space == "folded":
        eps = _rms_norm_parts(final_norm)[1]
        h = hidden.float()
        return h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    raise ValueError(f"unknown lemma space {space!r}; valid: 'normed', 'folded'")


__all__ = [
    "HeadGeometry",
    "LemmaSpace",
    "check_head",
    "check_states",
    "lemma_states",
    "max_row_distance",
    "rms_norm_gain",
]
