"""Lemma 4.1: proof-backed property tests, non-vacuity, head geometry, certificates.

The claims tested here are proved in docs/theory-lemma.md; each test names its claim.
All geometric constructions use float64 so that "at the bound" means at the bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from knapspec.proxies.lemma import (
    HeadGeometry,
    certify,
    cosine_bound,
    greedy_margin,
    lemma_states,
    max_row_distance,
    reference_margins,
)
from knapspec.testing import examples

DTYPE = torch.float64


@st.composite
def heads_and_states(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A random LM head ``W (V, d)`` and state ``x (d,)`` with a strictly positive margin."""
    vocab = draw(st.integers(2, 40))
    d_model = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    row_scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d_model, generator=generator, dtype=DTYPE) * row_scale
    x = torch.randn(d_model, generator=generator, dtype=DTYPE) * draw(st.sampled_from([0.5, 3.0]))
    margin, _ = greedy_margin(weight, x)
    assume(float(margin) > 1e-6 * float(weight.norm() * x.norm()))
    return weight, x


def _sphere_point(x: torch.Tensor, direction: torch.Tensor, cosine: float) -> torch.Tensor:
    """The point of the sphere of radius ``‖x‖`` at cosine ``cosine`` from ``x``, toward
    ``direction``'s component orthogonal to ``x``."""
    unit = x / x.norm()
    orthogonal = direction - (direction @ unit) * unit
    orthogonal = orthogonal / orthogonal.norm()
    c = max(-1.0, min(1.0, cosine))
    point: torch.Tensor = x.norm() * (c * unit + math.sqrt(max(0.0, 1 - c * c)) * orthogonal)
    return point


def _lemma_bound(weight: torch.Tensor, x: torch.Tensor) -> tuple[float, int]:
    margin, top = greedy_margin(weight, x)
    distance = max_row_distance(weight, top)
    return float(cosine_bound(margin, x.norm(), distance)), int(top)


def _gap_tolerance(weight: torch.Tensor, x: torch.Tensor) -> float:
    return 1e-9 * float(weight.norm(dim=1).max() * x.norm())


# --------------------------------------------------------------------------- soundness
# Example counts are written for the "ci" profile and scale with the active one
# (knapspec.testing.examples): the proofs nox session runs ~17x as many.
@settings(max_examples=examples(400), deadline=None)
@given(case=heads_and_states(), seed=st.integers(0, 2**31 - 1))
def test_lemma_equal_norm_random_directions_keep_argmax(
    case: tuple[torch.Tensor, torch.Tensor], seed: int
) -> None:
    """Claim 1: ‖x'‖ = ‖x‖ and cos(x, x') ≥ bound ⇒ i* is an argmax of W x'; 16 random x'
    per head, at cosines spread from the bound (inclusive) up to 1."""
    weight, x = case
    bound, top = _lemma_bound(weight, x)
    assume(bound < 1.0)
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(16, x.shape[0], generator=generator, dtype=DTYPE)
    unit = x / x.norm()
    orthogonal = directions - (directions @ unit)[:, None] * unit[None, :]
    keep = orthogonal.norm(dim=1) > 1e-6
    assume(bool(keep.any()))
    orthogonal = orthogonal[keep] / orthogonal[keep].norm(dim=1, keepdim=True)
    low = max(bound, -1.0)
    cosines = low + (1.0 - low) * torch.rand(len(orthogonal), generator=generator, dtype=DTYPE)
    cosines[0] = low  # always include a point exactly at the bound
    sines = (1 - cosines.square()).clamp_min(0).sqrt()
    points = x.norm() * (cosines[:, None] * unit[None, :] + sines[:, None] * orthogonal)
    logits = points @ weight.T
    tolerance = _gap_tolerance(weight, x)
    assert bool((logits[:, top] >= logits.max(dim=1).values - tolerance).all())


@settings(max_examples=examples(500), deadline=None)
@given(case=heads_and_states(), strict=st.booleans())
def test_lemma_adversarial_points_at_the_bound_keep_argmax(
    case: tuple[torch.Tensor, torch.Tensor], strict: bool
) -> None:
    """Claim 1 at its edge: for every rival j, move x along the sphere straight against
    w_i* - w_j until cos(x, x') equals the bound (or just above it, ``strict``); i* stays
    an argmax, and strictly above the bound it stays the unique argmax (Claim 2)."""
    weight, x = case
    bound, top = _lemma_bound(weight, x)
    assume(-1.0 < bound < 1.0)
    cosine = bound + 1e-3 * (1.0 - bound) if strict else bound
    unit = x / x.norm()
    toward = weight - weight[top]  # (V, d): row j points from w_i* toward w_j
    orthogonal = toward - (toward @ unit)[:, None] * unit[None, :]
    usable = orthogonal.norm(dim=1) > 1e-9  # parallel to x: no sphere move lowers that gap
    usable[top] = False
    assume(bool(usable.any()))
    directions = orthogonal[usable] / orthogonal[usable].norm(dim=1, keepdim=True)
    sine = math.sqrt(max(0.0, 1 - cosine * cosine))
    points = x.norm() * (cosine * unit[None, :] + sine * directions)  # one x' per rival
    logits = points @ weight.T  # (rivals, V)
    if strict:
        assert bool((logits.argmax(dim=1) == top).all())
        others = torch.cat([logits[:, :top], logits[:, top + 1 :]], dim=1)
        assert bool((logits[:, top] > others.max(dim=1).values).all())
    else:
        tolerance = _gap_tolerance(weight, x)
        assert bool((logits[:, top] >= logits.max(dim=1).values - tolerance).all())


@st.composite
def tight_cases(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int, int, float]:
    """A head built so that Lemma 4.1 is nearly tight at ``x``.

    With ``u0 = x/‖x‖`` and ``u1 ⊥ u0``, the rival ``j`` differs from ``i*`` by
    ``a = (ξ/‖x‖) u0 + b u1`` with ``ξ ≪ ‖x‖ b``; every other row sits at distance ``‖a‖/2``
    from ``w_i*`` with a large margin, so ``D = ‖a‖`` and ``j`` is the binding rival.
    """
    d_model = draw(st.integers(2, 10))
    others = draw(st.integers(0, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    relative_margin = draw(st.floats(1e-4, 1e-2))
    b = draw(st.floats(0.5, 5.0))
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d_model, d_model, generator=generator, dtype=DTYPE))
    u0, u1 = basis[:, 0], basis[:, 1]
    x_norm = draw(st.floats(0.5, 5.0))
    x = x_norm * u0
    xi = relative_margin * x_norm * b
    a = (xi / x_norm) * u0 + b * u1
    top_row = torch.randn(d_model, generator=generator, dtype=DTYPE)
    rival_row = top_row - a
    rows = [top_row, rival_row]
    for _ in range(others):
        push = torch.randn(d_model, generator=generator, dtype=DTYPE)
        push = push - (push @ u0) * u0  # keep it from raising the logit
        push = push / push.norm() * 0.3 + u0
        rows.append(top_row - 0.5 * float(a.norm()) * push / push.norm())
    return torch.stack(rows), x, 0, 1, xi


@settings(max_examples=examples(200), deadline=None)
@given(case=tight_cases())
def test_lemma_is_not_vacuous_just_below_a_tight_bound_the_argmax_flips(
    case: tuple[torch.Tensor, torch.Tensor, int, int, float],
) -> None:
    """Claim 3 (non-vacuity): on a tight head, an equal-norm x' whose cosine is just below
    the bound changes the greedy token, and the flip point's 1 - cos is within 1% of the
    bound's: the lemma's threshold cannot be relaxed materially."""
    weight, x, top, rival, xi = case
    bound, found_top = _lemma_bound(weight, x)
    assert found_top == top
    a = weight[top] - weight[rival]
    b = float((a - (a @ x) / (x @ x) * x).norm())
    flip_angle = math.atan(xi / (float(x.norm()) * b))  # the gap ξcosθ - ‖x‖ b sinθ hits 0
    assert (1 - math.cos(flip_angle)) / (1 - bound) <= 1.01
    beyond = math.cos(flip_angle * 1.02)
    assert beyond < bound
    x_prime = _sphere_point(x, -a, beyond)
    assert int((weight @ x_prime).argmax()) == rival


@settings(max_examples=examples(500), deadline=None)
@given(
    case=heads_and_states(),
    seed=st.integers(0, 2**31 - 1),
    radius=st.floats(1e-4, 2.0),
    folded=st.booleans(),
)
def test_certificate_implies_agreement_without_the_equal_norm_premise(
    case: tuple[torch.Tensor, torch.Tensor], seed: int, radius: float, folded: bool
) -> None:
    """Claim 4: ``certified`` (D·‖x - x'‖ ≤ ξ) and ``certified_exact`` (‖x - x'‖ < ρ) imply
    agreement for any x', whatever its norm, also with a folded channel gain."""
    weight, x = case
    generator = torch.Generator().manual_seed(seed)
    gain = torch.rand(x.shape[0], generator=generator, dtype=DTYPE) + 0.5 if folded else None
    geometry = HeadGeometry(weight, gain)
    margins = reference_margins(geometry, x[None])
    assume(float(margins.margin[0]) > 0)
    step = torch.randn(1, x.shape[0], generator=generator, dtype=DTYPE)
    scale = float(margins.margin[0] / margins.max_distance[0]) * radius * 2
    x_prime = x[None] + step / step.norm() * scale
    certificate = certify(geometry, margins, x_prime)
    assert certificate.agrees is not None and certificate.certified_exact is not None
    if bool(certificate.certified[0]):
        assert bool(certificate.agrees[0])
        assert bool(certificate.certified_exact[0])  # the exact radius is never tighter
    if bool(certificate.certified_exact[0]):
        assert bool(certificate.agrees[0])


@settings(max_examples=examples(200), deadline=None)
@given(case=heads_and_states(), seed=st.integers(0, 2**31 - 1), position=st.floats(0.0, 1.0))
def test_premise_free_test_equals_the_lemma_when_norms_are_equal(
    case: tuple[torch.Tensor, torch.Tensor], seed: int, position: float
) -> None:
    """Claim 5: with ‖x'‖ = ‖x‖, ``certified`` and the lemma's cosine test agree (away from
    float ties at the threshold)."""
    weight, x = case
    bound, _ = _lemma_bound(weight, x)
    assume(-1.0 < bound < 1.0)
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)
    cosine = -1 + 2 * position
    assume(abs(cosine - bound) > 1e-9)
    x_prime = _sphere_point(x, direction, cosine)
    certificate = certify(weight, x[None], x_prime[None])
    assert bool(certificate.certified[0]) == bool(certificate.certified_cosine[0])
    # float64 rescaling of a random direction: a few hundred ulps off 1 for extreme scales
    assert abs(float(certificate.norm_ratio[0]) - 1.0) < 1e-10


def test_exact_radius_is_the_distance_to_the_nearest_decision_boundary() -> None:
    """Claim 6: stepping ρ(x)(1 + 1e-6) toward the binding hyperplane flips the argmax."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        weight = torch.randn(15, 6, generator=generator, dtype=DTYPE)
        x = torch.randn(6, generator=generator, dtype=DTYPE)
        margins = reference_margins(weight, x[None])
        assert margins.exact_radius is not None
        top = int(margins.target_index[0])
        logits = weight @ x
        ratios = (logits[top] - logits) / (weight[top] - weight).norm(dim=1)
        ratios[top] = math.inf
        rival = int(ratios.argmin())
        assert float(margins.exact_radius[0]) == pytest.approx(float(ratios[rival]), rel=1e-9)
        normal = (weight[rival] - weight[top]) / (weight[rival] - weight[top]).norm()
        beyond = x + normal * float(margins.exact_radius[0]) * (1 + 1e-6)
        assert int((weight @ beyond).argmax()) != top


# ------------------------------------------------------------------------- head geometry
@settings(max_examples=examples(200), deadline=None)
@given(
    vocab=st.integers(2, 30),
    d_model=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
    folded=st.booleans(),
    duplicate=st.booleans(),
)
def test_max_row_distance_matches_a_brute_force_loop(
    vocab: int, d_model: int, seed: int, folded: bool, duplicate: bool
) -> None:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d_model, generator=generator, dtype=DTYPE)
    if duplicate:
        weight[-1] = weight[0]  # a zero distance must not break the clamp or the exclusion
    gain = torch.rand(d_model, generator=generator, dtype=DTYPE) + 0.1 if folded else None
    effective = weight if gain is None else weight * gain
    geometry = HeadGeometry(weight, gain, cache_size=8)
    rows = torch.randint(0, vocab, (7,), generator=generator)
    got = geometry.max_row_distance(rows)
    again = geometry.max_row_distance(rows)  # served from the cache
    for index, i in enumerate(rows.tolist()):
        expected = max(float((effective[i] - effective[j]).norm()) for j in range(vocab) if j != i)
        assert float(got[index]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert torch.equal(got, again)
    assert geometry.cache_info() <= 8


def test_max_row_distance_is_vectorised_for_a_49k_vocabulary() -> None:
    """A SmolLM2-sized head (49,152 x 576) takes one chunked matmul, not a vocabulary loop."""
    weight = torch.randn(49_152, 576, generator=torch.Generator().manual_seed(1))
    geometry = HeadGeometry(weight)
    rows = torch.tensor([5, 17, 5, 49_151])
    got = geometry.max_row_distance(rows)
    expected = (weight[17] - weight).norm(dim=1)
    expected[17] = -1
    assert float(got[1]) == pytest.approx(float(expected.max()), rel=1e-4)
    assert got[0] == got[2]
    assert geometry.cache_info() == 3


def test_cache_is_bounded_and_least_recently_used() -> None:
    weight = torch.randn(20, 4, dtype=DTYPE)
    geometry = HeadGeometry(weight, cache_size=2)
    geometry.max_row_distance(torch.tensor([0, 1]))
    geometry.max_row_distance(torch.tensor([0]))
    geometry.max_row_distance(torch.tensor([2]))
    assert geometry.cache_info() == 2
    assert set(geometry._max_distance) == {0, 2}


def test_greedy_margin_is_batched_over_tokens() -> None:
    weight = torch.randn(11, 5, dtype=DTYPE)
    x = torch.randn(3, 4, 5, dtype=DTYPE)
    margin, top = greedy_margin(weight, x)
    assert margin.shape == (3, 4) and top.shape == (3, 4)
    logits = x @ weight.T
    sorted_logits = logits.sort(dim=-1, descending=True).values
    assert torch.allclose(margin, sorted_logits[..., 0] - sorted_logits[..., 1])
    assert torch.equal(top, logits.argmax(dim=-1))


def test_cosine_bound_edge_cases() -> None:
    xi = torch.tensor([0.0, 1.0, 1.0, 100.0], dtype=DTYPE)
    norm = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=DTYPE)
    dist = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=DTYPE)
    bound = cosine_bound(xi, norm, dist)
    assert bound.tolist() == [1.0, 1.0, 1 - 1 / 8, 1 - 100**2 / 2]


# ---------------------------------------------------------------------- lemma spaces
def test_folded_space_gives_the_same_logits_and_the_residual_cosine() -> None:
    """The folded coordinates reproduce lm_head(final_norm(h)) and cos(h, h'), with
    ‖x‖ = sqrt(d) up to the norm's epsilon (the equal-norm premise nearly holds)."""
    torch.manual_seed(0)
    d_model, vocab = 16, 50
    norm = torch.nn.RMSNorm(d_model, eps=1e-6)
    setattr(norm, "variance_epsilon", 1e-6)  # noqa: B010  # the attribute name HF's norms use
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d_model) + 0.5)
    head = torch.nn.Linear(d_model, vocab, bias=False)
    h, h_prime = torch.randn(2, 7, d_model) * 4
    geometry = HeadGeometry.for_lm_head(head, norm, "folded")
    x = lemma_states(h, norm, "folded")
    with torch.no_grad():
        expected = head(norm(h))
    assert torch.allclose(geometry.logits(x), expected, atol=1e-4)
    cos = torch.nn.functional.cosine_similarity
    x_prime = lemma_states(h_prime, norm, "folded")
    assert torch.allclose(cos(x, x_prime, dim=-1), cos(h, h_prime, dim=-1), atol=1e-6)
    assert torch.allclose(x.norm(dim=-1), torch.full((7,), math.sqrt(d_model)), rtol=1e-5)
    normed = lemma_states(h, norm, "normed")
    plain = HeadGeometry.for_lm_head(head, norm, "normed")
    assert torch.allclose(plain.logits(normed), expected, atol=1e-4)


# ------------------------------------------------------------------------- bad input
def test_bad_input_gives_clear_errors() -> None:
    weight = torch.randn(10, 4)
    with pytest.raises(ValueError, match="at least 2 rows"):
        greedy_margin(torch.randn(1, 4), torch.randn(4))
    with pytest.raises(ValueError, match=r"\(\.\.\., 4\)"):
        greedy_margin(weight, torch.randn(3, 5))
    with pytest.raises(ValueError, match="NaN"):
        greedy_margin(weight, torch.full((2, 4), float("nan")))
    with pytest.raises(ValueError, match="empty"):
        certify(weight, torch.randn(0, 4), torch.randn(0, 4))
    with pytest.raises(ValueError, match="does not match"):
        certify(weight, torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="NaN"):
        certify(weight, torch.randn(3, 4), torch.full((3, 4), float("nan")))
    with pytest.raises(ValueError, match="channel_scale"):
        HeadGeometry(weight, torch.ones(3))
    with pytest.raises(IndexError, match="out of range"):
        HeadGeometry(weight).max_row_distance(torch.tensor([10]))
    with pytest.raises(ValueError, match="unknown lemma space"):
        lemma_states(torch.randn(2, 4), torch.nn.Identity(), "raw")  # type: ignore[arg-type]
