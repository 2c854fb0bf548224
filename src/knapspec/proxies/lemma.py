"""Lemma 4.1 of KnapSpec as tensor functions: greedy margins, head geometry, certificates.

Lemma 4.1 (proved in ``docs/theory-lemma.md``). Let ``w_1..w_V`` be the LM-head rows (no
bias), ``x`` the vector the head is applied to, ``i* = argmax_i <w_i, x>`` and the margin
``ξ(x) = <w_i*, x> - max_{j≠i*} <w_j, x>``. If ``x' ≠ 0`` and

    cos(x, x') ≥ 1 - ξ² / (2 ‖x‖² max_{j≠i*} ‖w_i* - w_j‖²)

then ``i*`` is also an argmax of ``<w_i, x'>`` (the unique one when the inequality is strict).
The paper states it for ``‖x'‖ = ‖x‖``; that premise costs nothing: a bias-free head's
argmax is invariant under positive scaling, so ``x'`` and ``x'·‖x‖/‖x'‖`` (same cosine,
equal norm) have the same greedy token.

Which ``x``? The head acts on the *final-normed* state ``final_norm(h) = g ⊙ h / rms(h)``
(RMSNorm with a per-channel gain ``g``), never on the residual stream ``h`` itself. Two
coordinate systems give the same logits and are both handled here:

* ``"normed"``: ``x = final_norm(h)`` and the head ``W`` as is;
* ``"folded"``: ``x = h / rms(h)`` and the head ``W diag(g)`` (the gain folded into the
  head). Here ``‖x‖ = sqrt(d)`` up to the norm's epsilon, and ``cos(x, x') = cos(h, h')``
  is exactly the cosine the KnapSpec DP maximises on the residual stream.

:class:`HeadGeometry` represents the folded head without materialising it: with a channel
scale ``g``, inner products between rows use the metric ``diag(g²)``.

Besides the lemma's cosine test, :func:`certify` reports the distance form of the same
proof, ``‖x - x'‖ · D ≤ ξ``, applied to ``x'`` and to ``x'`` rescaled to ``‖x‖`` (the
latter is the cosine test with float rounding accounted for), and the exact
linear-classifier radius ``ρ(x) = min_j (l_i* - l_j) / ‖w_i* - w_j‖``, the largest ball
around ``x`` on which the argmax cannot change.

Size: over 450 lines because the head geometry, the margins and the certificates are one
proof read top to bottom; each piece is a short function.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import attrs
import torch
from torch import nn

from knapspec.validators import check_finite

LemmaSpace = Literal["normed", "folded"]

#: Rows of the Gram block computed at once; bounds memory at ``chunk * V`` floats.
_GRAM_CHUNK = 64


def _check_head(weight: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"LM head weight must be (vocab, d_model), got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] < 2:
        raise ValueError(f"the lemma needs a vocabulary of at least 2 rows, got {weight.shape[0]}")


def _check_states(name: str, states: torch.Tensor, d_model: int) -> None:
    if states.dim() < 1 or states.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have shape (..., {d_model}) to match the LM head, got "
            f"{tuple(states.shape)}"
        )
    if states.numel() == 0:
        raise ValueError(f"{name} is empty (no tokens in the window)")
    check_finite(name, states)


def greedy_margin(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its margin ``ξ(x) = <w_i*, x> - max_{j≠i*} <w_j, x>``.

    Args:
        weight: ``(V, d)`` LM-head rows (``V >= 2``).
        x: ``(..., d)`` states the head is applied to (batched over tokens).

    Returns:
        ``(margin, top)``: both ``(...)``; ``margin >= 0`` (0 on a tie) and ``top`` the index
        ``torch.argmax`` returns (the first maximiser).
    """
    _check_head(weight)
    _check_states("x", x, weight.shape[1])
    return _margin_from_logits(x @ weight.T.to(x.dtype))


def _margin_from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top2 = torch.topk(logits, 2, dim=-1)
    top = logits.argmax(dim=-1)  # topk's order on ties is unspecified; argmax's is not
    return top2.values[..., 0] - top2.values[..., 1], top


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
        _check_head(weight)
        check_finite("LM head weight", weight)
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
            check_finite("channel_scale", channel_scale)
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
        _check_states("x", x, self.d_model)
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
    """The per-channel gain ``g`` of an RMSNorm (``weight``), checked to be one."""
    gain = getattr(final_norm, "weight", None)
    if not isinstance(gain, torch.Tensor) or not hasattr(final_norm, "variance_epsilon"):
        raise TypeError(
            f"final norm {type(final_norm).__name__} is not an RMSNorm with a weight and "
            "variance_epsilon; the folded space needs one"
        )
    return gain.detach()


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
        rms_norm_gain(final_norm)
        eps = float(final_norm.variance_epsilon)  # type: ignore[arg-type]
        h = hidden.float()
        return h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    raise ValueError(f"unknown lemma space {space!r}; valid: 'normed', 'folded'")


def cosine_bound(xi: torch.Tensor, x_norm: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """The lemma's threshold ``1 - ξ² / (2 ‖x‖² D²)`` (elementwise, broadcasting).

    Where ``ξ <= 0`` (a tie) or ``D == 0`` nothing is certified and the bound is 1. The
    bound may be below -1, meaning every nonzero ``x'`` is certified.
    """
    denominator = 2 * x_norm.square() * dist.square()
    safe = (xi > 0) & (denominator > 0)
    ratio = xi.square() / torch.where(safe, denominator, torch.ones_like(denominator))
    return torch.where(safe, 1 - ratio, torch.ones_like(ratio))


@attrs.frozen
class ReferenceMargins:
    """What the certificate needs from the reference alone (computed once per window).

    Attributes:
        states: ``(r, d)`` reference vectors ``x`` in the lemma's space.
        target_index: ``(r,)`` ``i*``; margin: ``(r,)`` ``ξ``; max_distance: ``(r,)`` ``D``.
        exact_radius: ``(r,)`` ``ρ = min_j (l_i* - l_j)/‖w_i* - w_j‖`` or None.
        rounding_slack: ``(r,)`` bound on the float error of the logit gaps.
    """

    states: torch.Tensor
    target_index: torch.Tensor
    margin: torch.Tensor
    max_distance: torch.Tensor
    exact_radius: torch.Tensor | None
    rounding_slack: torch.Tensor

    @property
    def x_norm(self) -> torch.Tensor:
        """``(r,)`` ``‖x‖``."""
        norm: torch.Tensor = self.states.norm(dim=-1)
        return norm

    @property
    def bound(self) -> torch.Tensor:
        """``(r,)`` the lemma's cosine threshold per token."""
        return cosine_bound(self.margin, self.x_norm, self.max_distance)


def reference_margins(
    head: HeadGeometry | torch.Tensor, reference: torch.Tensor, *, exact_radius: bool = True
) -> ReferenceMargins:
    """Margins, ``i*`` and distances of the reference vectors ``(r, d)``.

    ``exact_radius`` also computes ``ρ(x)``; it costs one ``(r, V)`` pass over the distance
    rows of the distinct ``i*`` (the same matmul the lemma's ``D`` needs).
    """
    geometry = head if isinstance(head, HeadGeometry) else HeadGeometry(head, cache_size=0)
    if reference.dim() != 2:
        raise ValueError(f"reference must be (r, d), got shape {tuple(reference.shape)}")
    _check_states("reference", reference, geometry.d_model)
    x = reference.to(geometry.weight.dtype)
    logits = geometry.logits(x)
    margin, top = _margin_from_logits(logits)
    radius = None
    if exact_radius:
        distinct, inverse = torch.unique(top, return_inverse=True)
        rows = geometry.row_distances(distinct)  # (k, V): the one matmul
        # Pad by the Gram form's rounding bound so no distance is underestimated (which
        # would overstate ρ); a row identical to w_i* then gets gap 0, hence ρ = 0.
        unit = torch.finfo(rows.dtype).eps
        norms = geometry.row_norms_sq[distinct, None] + geometry.row_norms_sq[None, :]
        padded = (rows.square() + (geometry.d_model + 2) * unit * norms).sqrt()[inverse]
        gaps = logits.gather(1, top[:, None]) - logits  # (r, V), >= 0
        ratio = gaps / padded
        ratio[torch.arange(len(top)), top] = float("inf")
        radius = ratio.min(dim=1).values
        farthest = geometry.farthest(distinct, rows)
        for i, value in zip(distinct.tolist(), farthest.tolist(), strict=True):
            geometry.remember(i, value)
        max_distance = farthest[inverse]
    else:
        max_distance = geometry.max_row_distance(top)
    # Forward error of a length-d dot product is at most about d·u·Σ|w_k x_k| (u = unit
    # roundoff); bound Σ|w_k x_k| by ‖w‖‖x‖ with the largest row norm.
    unit = torch.finfo(x.dtype).eps
    largest_row = geometry.row_norms_sq.max().sqrt()
    slack = 2 * geometry.d_model * unit * largest_row * x.norm(dim=-1)
    return ReferenceMargins(
        states=x,
        target_index=top,
        margin=margin,
        max_distance=max_distance,
        exact_radius=radius,
        rounding_slack=slack,
    )


@attrs.frozen
class Certificate:
    """Lemma 4.1 applied to a candidate's states on a reference window.

    All per-token fields are ``(r,)`` tensors.

    Attributes:
        target_index: ``i*``, the reference's greedy token.
        margin: ``ξ(x)``; max_distance: ``D = max_{j≠i*} ‖w_i* - w_j‖``.
        bound: the lemma's cosine threshold ``1 - ξ²/(2‖x‖²D²)``.
        cosine: ``cos(x, x')``.
        norm_ratio: ``‖x'‖ / ‖x‖`` (informational: no test needs it to be 1).
        distance: ``‖x - x'‖``.
        rescaled_distance: ``‖x - x'·‖x‖/‖x'‖‖`` (inf for ``x' = 0``), a function of the
            cosine alone: ``‖x‖·sqrt(2(1 - cos))``.
        certified_cosine: the lemma's test, ``cos >= bound`` (and ``ξ > 0``, ``x' ≠ 0``);
            sound for any norm of ``x'``, without a float-rounding margin.
        certified: ``D·min(distance, rescaled_distance) <= ξ - slack``: the lemma's test
            (via the rescaled point) or the distance test on ``x'`` itself, each with the
            logits' rounding slack; always sound. Neither test implies the other when the
            norms differ.
        certified_exact: ``min(distance, rescaled_distance) < ρ(x) - slack/‖w‖`` with the
            exact linear-classifier radius (None when not computed); implied by ``certified``.
        agrees: whether the candidate's argmax is ``i*`` (None when not computed).
    """

    target_index: torch.Tensor
    margin: torch.Tensor
    max_distance: torch.Tensor
    bound: torch.Tensor
    cosine: torch.Tensor
    norm_ratio: torch.Tensor
    distance: torch.Tensor
    certified_cosine: torch.Tensor
    certified: torch.Tensor
    certified_exact: torch.Tensor | None = None
    agrees: torch.Tensor | None = None
    rescaled_distance: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.cosine.shape[0])

    @property
    def certified_fraction(self) -> float:
        """Share of tokens provably greedy-accepted: a lower bound on agreement."""
        return float(self.certified.float().mean())

    @property
    def certified_cosine_fraction(self) -> float:
        """Share of tokens that pass the lemma's cosine test as stated."""
        return float(self.certified_cosine.float().mean())

    @property
    def certified_exact_fraction(self) -> float | None:
        if self.certified_exact is None:
            return None
        return float(self.certified_exact.float().mean())

    @property
    def agreement(self) -> float | None:
        """Share of tokens whose candidate argmax is ``i*`` (None when not computed)."""
        return None if self.agrees is None else float(self.agrees.float().mean())

    def norm_ratio_stats(self) -> dict[str, float]:
        """How the candidate's norms differ from the reference's: ratio mean/min/max and max
        |log| (the certificates hold for any ratio; the distance test is the one it affects)."""
        ratio = self.norm_ratio.double()
        return {
            "mean": float(ratio.mean()),
            "min": float(ratio.min()),
            "max": float(ratio.max()),
            "max_abs_log": float(ratio.log().abs().max()),
        }


def certify(
    head: HeadGeometry | torch.Tensor,
    reference: torch.Tensor | ReferenceMargins,
    candidate: torch.Tensor,
    *,
    exact_radius: bool = True,
    check_agreement: bool = True,
) -> Certificate:
    """Apply Lemma 4.1 token by token.

    Args:
        head: ``(V, d)`` LM-head weight, or a :class:`HeadGeometry` (cached distances,
            optionally a folded gain).
        reference: ``(r, d)`` reference vectors ``x`` in the lemma's space, or their
            precomputed :class:`ReferenceMargins` (reuse one per window across candidates).
        candidate: ``(r, d)`` candidate vectors ``x'`` in the same space.
        exact_radius: also test against the exact radius ``ρ(x)``.
        check_agreement: also compute the candidate's argmax (one ``(r, V)`` head matmul)
            to report actual agreement next to the certificate.

    Returns:
        :class:`Certificate`.
    """
    geometry = head if isinstance(head, HeadGeometry) else HeadGeometry(head, cache_size=0)
    margins = (
        reference
        if isinstance(reference, ReferenceMargins)
        else reference_margins(geometry, reference, exact_radius=exact_radius)
    )
    x = margins.states
    if candidate.shape != x.shape:
        raise ValueError(
            f"candidate shape {tuple(candidate.shape)} does not match reference shape "
            f"{tuple(x.shape)}"
        )
    _check_states("candidate", candidate, geometry.d_model)
    x_prime = candidate.to(x.dtype)
    x_norm = x.norm(dim=-1)
    candidate_norm = x_prime.norm(dim=-1)
    nonzero = candidate_norm > 0
    distance = (x - x_prime).norm(dim=-1)
    # A bias-free head's argmax is invariant under positive scaling, so the equal-norm
    # point x'·‖x‖/‖x'‖ (same cosine) has x''s greedy token: the lemma applies to it.
    scale = x_norm / torch.where(nonzero, candidate_norm, torch.ones_like(candidate_norm))
    rescaled = (x - x_prime * scale[:, None]).norm(dim=-1)
    rescaled = torch.where(nonzero, rescaled, torch.full_like(rescaled, float("inf")))
    nearest = torch.minimum(distance, rescaled)
    cosine = torch.nn.functional.cosine_similarity(x, x_prime, dim=-1, eps=1e-30)
    bound = cosine_bound(margins.margin, x_norm, margins.max_distance)
    positive = margins.margin > 0
    certified_cosine = positive & nonzero & (cosine >= bound)
    slack = margins.rounding_slack
    certified = positive & (margins.max_distance * nearest <= margins.margin - slack)
    certified_exact = None
    if margins.exact_radius is not None and exact_radius:
        largest_row = geometry.row_norms_sq.max().sqrt()
        certified_exact = nearest < margins.exact_radius - slack / largest_row
    agrees = None
    if check_agreement:
        agrees = geometry.logits(x_prime).argmax(dim=-1) == margins.target_index
    return Certificate(
        target_index=margins.target_index,
        margin=margins.margin,
        max_distance=margins.max_distance,
        bound=bound,
        cosine=cosine,
        norm_ratio=candidate_norm / x_norm.clamp_min(1e-30),
        distance=distance,
        certified_cosine=certified_cosine,
        certified=certified,
        certified_exact=certified_exact,
        agrees=agrees,
        rescaled_distance=rescaled,
    )


__all__ = [
    "Certificate",
    "HeadGeometry",
    "LemmaSpace",
    "ReferenceMargins",
    "certify",
    "cosine_bound",
    "greedy_margin",
    "lemma_states",
    "max_row_distance",
    "reference_margins",
    "rms_norm_gain",
]
