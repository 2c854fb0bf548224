"""Lemma 4.1 without the equal-norm premise (docs/theory-lemma.md, "Any norm").

A bias-free head's argmax is invariant under positive scaling, so the cosine test
certifies ``x'`` whatever ``‖x'‖``: rescaling ``x'`` to ``‖x‖`` changes neither its cosine
with ``x`` nor its greedy token, and the equal-norm lemma applies to the rescaled point.
These tests check the claim on random and adversarial points of arbitrary norm, through
:func:`certify` (so the library's test, not only the geometry, is what is checked), pair
"certified ⇒ agrees" with candidates that are certified though far from ``x`` in
distance, and check that just below a tight bound nothing is certified and the argmax flips.
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from knapspec.proxies.lemma import HeadGeometry, certify, reference_margins
from knapspec.testing import examples
from test_lemma import _gap_tolerance, _lemma_bound, _sphere_point, heads_and_states, tight_cases

DTYPE = torch.float64
#: log10 of the factor applied to a candidate: from a thousandth to a thousand times ‖x‖.
LOG_SCALES = st.floats(-3.0, 3.0)


def _assert_sound(weight: torch.Tensor, x: torch.Tensor, points: torch.Tensor) -> None:
    """``certify``'s two tests each imply agreement for every row of ``points (k, d)``."""
    certificate = certify(weight, x.expand_as(points), points)
    assert certificate.agrees is not None
    wrong = ~certificate.agrees
    assert not bool((certificate.certified_cosine & wrong).any()), "cosine test certified a flip"
    assert not bool((certificate.certified & wrong).any()), "certified a flip"


@settings(max_examples=examples(150), deadline=None)
@given(
    case=heads_and_states(),
    seed=st.integers(0, 2**31 - 1),
    log_scales=st.lists(LOG_SCALES, min_size=16, max_size=16),
)
def test_cosine_test_is_sound_for_candidates_of_any_norm(
    case: tuple[torch.Tensor, torch.Tensor], seed: int, log_scales: list[float]
) -> None:
    """Random directions at cosines from the bound (inclusive) to 1, each scaled by
    10^U(-3, 3): i* stays an argmax, and the certificate never certifies a flip."""
    weight, x = case
    bound, top = _lemma_bound(weight, x)
    assume(bound < 1.0)
    generator = torch.Generator().manual_seed(seed)
    directions = torch.randn(16, x.shape[0], generator=generator, dtype=DTYPE)
    low = max(bound, -1.0)
    cosines = low + (1.0 - low) * torch.rand(16, generator=generator, dtype=DTYPE)
    cosines[0] = low
    points = torch.stack(
        [_sphere_point(x, d, float(c)) for d, c in zip(directions, cosines, strict=True)]
    )
    scales = torch.tensor([10.0**s for s in log_scales], dtype=DTYPE)
    scaled = points * scales[:, None]
    logits = scaled @ weight.T
    tolerance = _gap_tolerance(weight, x) * scales
    assert bool((logits[:, top] >= logits.max(dim=1).values - tolerance).all())
    _assert_sound(weight, x, scaled)
    # Strictly inside the bound the test certifies every one of them, whatever the norm.
    inside = cosines > low + 1e-6 * (1 - low)
    certificate = certify(weight, x.expand_as(scaled), scaled)
    assert bool(certificate.certified_cosine[inside].all())


@settings(max_examples=examples(150), deadline=None)
@given(case=heads_and_states(), log_scale=LOG_SCALES, strict=st.booleans())
def test_adversarial_points_at_the_bound_keep_argmax_at_any_norm(
    case: tuple[torch.Tensor, torch.Tensor], log_scale: float, strict: bool
) -> None:
    """For every rival j, x' on the bound's cone straight against w_i* - w_j, then scaled
    by 10^U(-3, 3): i* stays an argmax (the unique one just inside the bound)."""
    weight, x = case
    bound, top = _lemma_bound(weight, x)
    assume(-1.0 < bound < 1.0)
    cosine = bound + 1e-3 * (1.0 - bound) if strict else bound
    toward = weight - weight[top]
    unit = x / x.norm()
    orthogonal = toward - (toward @ unit)[:, None] * unit[None, :]
    usable = orthogonal.norm(dim=1) > 1e-9
    usable[top] = False
    assume(bool(usable.any()))
    directions = orthogonal[usable] / orthogonal[usable].norm(dim=1, keepdim=True)
    sine = math.sqrt(max(0.0, 1 - cosine * cosine))
    scale = 10.0**log_scale
    points = scale * x.norm() * (cosine * unit[None, :] + sine * directions)
    logits = points @ weight.T
    if strict:
        others = torch.cat([logits[:, :top], logits[:, top + 1 :]], dim=1)
        assert bool((logits[:, top] > others.max(dim=1).values).all())
    else:
        tolerance = _gap_tolerance(weight, x) * scale
        assert bool((logits[:, top] >= logits.max(dim=1).values - tolerance).all())
    _assert_sound(weight, x, points)


@settings(max_examples=examples(150), deadline=None)
@given(
    case=heads_and_states(),
    seed=st.integers(0, 2**31 - 1),
    log_scales=st.lists(LOG_SCALES, min_size=32, max_size=32),
    spread=st.floats(1e-4, 3.0),
    folded=st.booleans(),
)
def test_no_certificate_certifies_a_flip_for_arbitrary_candidates(
    case: tuple[torch.Tensor, torch.Tensor],
    seed: int,
    log_scales: list[float],
    spread: float,
    folded: bool,
) -> None:
    """Unconstructed candidates: x plus noise of any size, at any norm, folded gain or not.
    Neither test (nor the exact radius) certifies a candidate whose argmax differs."""
    weight, x = case
    generator = torch.Generator().manual_seed(seed)
    gain = torch.rand(x.shape[0], generator=generator, dtype=DTYPE) + 0.5 if folded else None
    geometry = HeadGeometry(weight, gain)
    noise = torch.randn(32, x.shape[0], generator=generator, dtype=DTYPE)
    points = (x[None] + spread * x.norm() * noise / math.sqrt(x.shape[0])) * torch.tensor(
        [10.0**s for s in log_scales], dtype=DTYPE
    )[:, None]
    margins = reference_margins(geometry, x.expand_as(points).contiguous())
    certificate = certify(geometry, margins, points)
    assert certificate.agrees is not None and certificate.certified_exact is not None
    wrong = ~certificate.agrees
    for name in ("certified_cosine", "certified", "certified_exact"):
        assert not bool((getattr(certificate, name) & wrong).any()), f"{name} certified a flip"


def test_a_candidate_of_another_norm_is_certified_though_the_distance_test_fails() -> None:
    """Certified ⇒ agrees is not vacuous: x' = 3·(x + small orthogonal step) has cosine
    0.9995 and norm ratio 3, is certified by the cosine test (and ``certified``), agrees,
    and would not be certified by the distance test on x' alone (‖x - x'‖ ≈ 2‖x‖)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(30, 8, generator=generator, dtype=DTYPE)
    x = 4.0 * weight[0] / weight[0].norm()  # along the first row: a wide margin
    margins = reference_margins(weight, x[None])
    assert int(margins.target_index[0]) == 0
    bound = float(margins.bound[0])
    assert bound < 0.999  # the test has room below cosine 1
    step = torch.randn(8, generator=generator, dtype=DTYPE)
    cosine = 1 - (1 - bound) / 2  # halfway between the bound and 1
    x_prime = 3.0 * _sphere_point(x, step, cosine)
    certificate = certify(weight, margins, x_prime[None])
    assert float(certificate.cosine[0]) < 1 - 1e-6  # not a positive multiple of x
    assert abs(float(certificate.norm_ratio[0]) - 3.0) < 1e-9
    assert bool(certificate.certified_cosine[0]) and bool(certificate.certified[0])
    assert certificate.agrees is not None and bool(certificate.agrees[0])
    distance_only = float(margins.max_distance[0]) * float(certificate.distance[0])
    assert distance_only > float(margins.margin[0])  # the old test would have refused it


@settings(max_examples=examples(100), deadline=None)
@given(case=tight_cases(), log_scale=LOG_SCALES)
def test_just_below_a_tight_bound_nothing_is_certified_and_the_argmax_flips(
    case: tuple[torch.Tensor, torch.Tensor, int, int, float], log_scale: float
) -> None:
    """Non-vacuity at any norm: past the flip angle (2 % beyond, where cos is below the
    bound) the scaled candidate's argmax is the rival, and no test certifies it."""
    weight, x, top, rival, xi = case
    bound, _ = _lemma_bound(weight, x)
    a = weight[top] - weight[rival]
    b = float((a - (a @ x) / (x @ x) * x).norm())
    flip_angle = math.atan(xi / (float(x.norm()) * b))
    beyond = math.cos(flip_angle * 1.02)
    assert beyond < bound
    x_prime = 10.0**log_scale * _sphere_point(x, -a, beyond)
    certificate = certify(weight, x[None], x_prime[None])
    assert certificate.agrees is not None and not bool(certificate.agrees[0])
    assert not bool(certificate.certified_cosine[0]) and not bool(certificate.certified[0])
