"""Lemma 4.1 of KnapSpec as tensor functions: greedy margins, thresholds, certificates.

Lemma 4.1 (proved in ``docs/theory-lemma.md``). Let ``w_1..w_V`` be the LM-head rows (no
bias), ``x`` the vector the head is applied to, ``i* = argmax_i <w_i, x>`` and the margin
``ξ(x) = <w_i*, x> - max_{j≠i*} <w_j, x>``. If ``x' ≠ 0`` and

    cos(x, x') ≥ 1 - ξ² / (2 ‖x‖² max_{j≠i*} ‖w_i* - w_j‖²)

then ``i*`` is also an argmax of ``<w_i, x'>`` (the unique one when the inequality is strict).
The paper states it for ``‖x'‖ = ‖x‖``; that premise costs nothing: a bias-free head's
argmax is invariant under positive scaling, so ``x'`` and ``x'·‖x‖/‖x'‖`` (same cosine,
equal norm) have the same greedy token.

Which ``x``? The vector the head is applied to: the final-normed state, or the state
divided by its RMS with the norm's gain folded into the head (:data:`LemmaSpace`);
:mod:`knapspec.proxies.head_geometry` maps residual states into either space
(:func:`lemma_states`) and holds the head's rows and distances (:class:`HeadGeometry`).
Both are re-exported here, so the lemma's whole API is importable from this module.

Besides the lemma's cosine test, :func:`certify` reports the distance form of the same
proof, ``‖x - x'‖ · D ≤ ξ``, applied to ``x'`` and to ``x'`` rescaled to ``‖x‖`` (the
latter is the cosine test with float rounding accounted for), and the exact
linear-classifier radius ``ρ(x) = min_j (l_i* - l_j) / ‖w_i* - w_j‖``, the largest ball
around ``x`` on which the argmax cannot change.
"""

from __future__ import annotations

import attrs
import torch

from knapspec.proxies.head_geometry import (
    HeadGeometry,
    LemmaSpace,
    check_head,
    check_states,
    lemma_states,
    max_row_distance,
    rms_norm_gain,
)


def greedy_margin(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its margin ``ξ(x) = <w_i*, x> - max_{j≠i*} <w_j, x>``.

    Args:
        weight: ``(V, d)`` LM-head rows (``V >= 2``).
        x: ``(..., d)`` states the head is applied to (batched over tokens).

    Returns:
        ``(margin, top)``: both ``(...)``; ``margin >= 0`` (0 on a tie) and ``top`` the index
        ``torch.argmax`` returns (the first maximiser).
    """
    check_head(weight)
    check_states("x", x, weight.shape[1])
    return _margin_from_logits(x @ weight.T.to(x.dtype))


def _margin_from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top2 = torch.topk(logits, 2, dim=-1)
    top = logits.argmax(dim=-1)  # topk's order on ties is unspecified; argmax's is not
    return top2.values[..., 0] - top2.values[..., 1], top


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
    check_states("reference", reference, geometry.d_model)
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
    check_states("candidate", candidate, geometry.d_model)
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
