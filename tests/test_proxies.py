"""Value proxies: registration, configs, acceptance estimates on a tiny random Llama."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import binomtest
from transformers import LlamaConfig, LlamaForCausalLM

from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.proxies import (
    PROXIES,
    CosineProxy,
    CosineProxyConfig,
    MonteCarloAcceptanceProxy,
    MonteCarloProxyConfig,
    acceptance_probability,
    coupling_acceptance,
    mean_interval,
    wilson_interval,
)
from knapspec.proxies.lemma import LemmaSpace
from knapspec.sampling import SamplingParams, processed_probs
from knapspec.testing import examples
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

GREEDY = SamplingParams()
SAMPLING = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, verification="rejection")
KEYED = attrs.evolve(SAMPLING, verification="position-keyed")


# ------------------------------------------------------- rejection-sampling acceptance
def _exact_rejection_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(accept) of the rule "draw x ~ q, accept with prob. min(1, p(x)/q(x))", summed
    exactly over the outcomes x of the draft (q(x) = 0 outcomes never occur)."""
    total = 0.0
    for x in range(p.shape[0]):
        qx, px = float(q[x]), float(p[x])
        if qx > 0:
            total += qx * min(1.0, px / qx)
    return total


@st.composite
def distribution_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = draw(st.integers(1, 8))
    weights = st.floats(0.0, 10.0, allow_nan=False)
    raw_p = torch.tensor(
        draw(st.lists(weights, min_size=vocab, max_size=vocab)), dtype=torch.float64
    )
    raw_q = torch.tensor(
        draw(st.lists(weights, min_size=vocab, max_size=vocab)), dtype=torch.float64
    )
    raw_p[draw(st.integers(0, vocab - 1))] += 1.0  # never all zero
    raw_q[draw(st.integers(0, vocab - 1))] += 1.0
    if draw(st.booleans()):
        raw_q = raw_p.clone()
    return raw_p / raw_p.sum(), raw_q / raw_q.sum()


@settings(max_examples=examples(500), deadline=None)
@given(pair=distribution_pairs())
def test_sum_min_equals_the_exact_rejection_sampling_acceptance(
    pair: tuple[torch.Tensor, torch.Tensor],
) -> None:
    p, q = pair
    got = float(acceptance_probability(p, q))
    assert got == pytest.approx(_exact_rejection_acceptance(p, q), abs=1e-12)
    # ... and it is 1 exactly when the draft's distribution is the target's.
    identical = bool(torch.allclose(p, q, atol=1e-12, rtol=0))
    assert (abs(got - 1.0) < 1e-12) == identical


def _exact_coupling_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(log p + G) = argmax(log q + G)), the race-of-exponentials sum over i."""
    total = 0.0
    for i in range(p.shape[0]):
        if p[i] > 0 and q[i] > 0:
            total += float(1.0 / torch.maximum(p / p[i], q / q[i]).sum())
    return total


@settings(max_examples=examples(300), deadline=None)
@given(pair=distribution_pairs(), candidates=st.integers(1, 10))
def test_the_coupling_acceptance_is_a_lower_bound_exact_with_every_candidate(
    pair: tuple[torch.Tensor, torch.Tensor], candidates: int
) -> None:
    p, q = pair
    exact = _exact_coupling_acceptance(p, q)
    a = float(acceptance_probability(p, q))
    got = float(coupling_acceptance(p, q, candidates))
    assert a / (2 - a) - 1e-9 <= got <= exact + 1e-9 <= a + 2e-9
    if candidates >= p.shape[0]:
        assert got == pytest.approx(exact, abs=1e-9)


def test_acceptance_probability_is_batched_and_checks_shapes() -> None:
    p = torch.softmax(torch.randn(3, 5, 11), dim=-1)
    q = torch.softmax(torch.randn(3, 5, 11), dim=-1)
    assert acceptance_probability(p, q).shape == (3, 5)
    with pytest.raises(ValueError, match="same shape"):
        acceptance_probability(p, q[..., :10])
    with pytest.raises(ValueError, match="NaN"):
        acceptance_probability(p, torch.full_like(q, float("nan")))


# ---------------------------------------------------------------------- intervals
@settings(max_examples=examples(200), deadline=None)
@given(trials=st.integers(1, 300), data=st.data(), confidence=st.sampled_from([0.8, 0.95, 0.99]))
def test_wilson_interval_matches_scipy(trials: int, data: st.DataObject, confidence: float) -> None:
    successes = data.draw(st.integers(0, trials))
    ours = wilson_interval(successes, trials, confidence)
    theirs = binomtest(successes, trials).proportion_ci(confidence, method="wilson")
    assert ours.low == pytest.approx(theirs.low, abs=1e-9)
    assert ours.high == pytest.approx(theirs.high, abs=1e-9)
    assert ours.alpha == successes / trials and ours.samples == trials


def test_mean_interval_contains_the_mean_and_shrinks_with_samples() -> None:
    generator = torch.Generator().manual_seed(0)
    small = mean_interval(torch.rand(10, generator=generator))
    large = mean_interval(torch.rand(1000, generator=generator))
    assert small.low <= small.alpha <= small.high
    assert large.high - large.low < small.high - small.low
    assert mean_interval(torch.tensor([0.3])).low == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        mean_interval(torch.empty(0))
    with pytest.raises(ValueError, match="at least one token"):
        wilson_interval(0, 0)


# ------------------------------------------------------------------ tiny random Llama
@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    with torch.no_grad():  # a non-trivial final gain, so "folded" and "normed" differ
        model.model.norm.weight.copy_(torch.rand(32) + 0.5)
    return SublayerEngine(model)


@pytest.fixture(scope="module")
def window(engine: SublayerEngine) -> tuple[ReferenceWindow, KVCache]:
    tokens = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(1))
    cache = engine.new_cache(64)
    out = engine.forward(tokens, 0, cache, capture_points=True, capture_last=10)
    assert out.points is not None
    ref = ReferenceWindow(
        points=out.points,
        token_ids=tokens[-10:],
        target_tokens=out.logits[-10:].argmax(dim=-1),
        start=14,
    )
    return ref, cache


def _candidates(engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache]) -> torch.Tensor:
    ref, cache = window
    masks = [
        SublayerMask.full(3),
        SublayerMask.from_skipped(3, [1]),
        SublayerMask.from_skipped(3, [0, 3]),
        SublayerMask.from_skipped(3, [0, 1, 2, 3, 4]),
    ]
    final: torch.Tensor = engine.run_masks(masks, ref.points[0], ref.positions, cache, ref.start)
    return final


def test_registered_by_name_and_built_from_config(engine: SublayerEngine) -> None:
    assert PROXIES.get("cosine") is CosineProxy
    assert PROXIES.get("montecarlo") is MonteCarloAcceptanceProxy
    for name in ("cosine", "montecarlo"):
        cls = PROXIES.get(name)
        proxy = cls.from_config(cls.config_class(), engine)
        assert isinstance(proxy, cls)
    with pytest.raises(ValueError, match="acceptance"):
        CosineProxyConfig(acceptance="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="confidence"):
        MonteCarloProxyConfig(confidence=1.0)
    with pytest.raises(ValueError, match="needs the engine"):
        MonteCarloAcceptanceProxy(score="neg-kl")


def test_full_mask_scores_one_and_is_fully_accepted(
    engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache]
) -> None:
    ref, _ = window
    candidates = _candidates(engine, window)
    cosine = CosineProxy()
    scores = cosine.score(ref.final_hidden, candidates)
    assert scores.shape == (4,)
    assert float(scores[0]) == pytest.approx(1.0, abs=1e-5)
    assert bool((scores[1:] < scores[0] + 1e-6).all())
    montecarlo = MonteCarloAcceptanceProxy()
    for sampling in (GREEDY, SAMPLING):
        estimate = montecarlo.estimate_acceptance(engine, ref, candidates, sampling)[0]
        assert estimate.alpha == pytest.approx(1.0, abs=1e-5) and estimate.samples == 10
    full_certificate = cosine.certificate(engine, ref, candidates[:1])[0]
    assert full_certificate.certified_fraction == 1.0  # x' = x is certified wherever ξ > 0


def test_montecarlo_matches_a_per_token_brute_force(
    engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache]
) -> None:
    ref, _ = window
    candidates = _candidates(engine, window)
    proxy = MonteCarloAcceptanceProxy(confidence=0.9)
    greedy = proxy.estimate_acceptance(engine, ref, candidates, GREEDY)
    sampled = proxy.estimate_acceptance(engine, ref, candidates, SAMPLING)
    keyed = proxy.estimate_acceptance(engine, ref, candidates, KEYED)
    for branch, candidate in enumerate(candidates):
        agree, expected_sampled, coupling_floor, coupling_exact = 0, 0.0, 0.0, 0.0
        for t in range(ref.size):
            target_logits = engine.logits(ref.final_hidden[t]).detach()
            draft_logits = engine.logits(candidate[t]).detach()
            agree += int(int(draft_logits.argmax()) == int(ref.target_tokens[t]))
            p = processed_probs(target_logits, SAMPLING).double()
            q = processed_probs(draft_logits, SAMPLING).double()
            expected_sampled += _exact_rejection_acceptance(p, q) / ref.size
            a = _exact_rejection_acceptance(p, q)
            coupling_floor += a / (2 - a) / ref.size
            coupling_exact += _exact_coupling_acceptance(p, q) / ref.size
        assert greedy[branch].alpha == agree / ref.size
        assert greedy[branch].low <= greedy[branch].alpha <= greedy[branch].high
        assert sampled[branch].alpha == pytest.approx(expected_sampled, abs=1e-5)
        assert sampled[branch].low <= sampled[branch].alpha <= sampled[branch].high
        # Position-keyed: the coupling's acceptance, priced from below but above its floor.
        assert coupling_floor - 1e-5 <= keyed[branch].alpha <= coupling_exact + 1e-5
        assert keyed[branch].alpha <= sampled[branch].alpha + 1e-6


@pytest.mark.parametrize("space", ["folded", "normed"])
def test_certificates_are_sound_and_floor_the_cosine_alpha(
    engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache], space: LemmaSpace
) -> None:
    ref, _ = window
    candidates = _candidates(engine, window)
    agreement = CosineProxy(space=space)
    certified = CosineProxy(acceptance="certified", space=space)
    exact = CosineProxy(acceptance="certified-exact", space=space)
    alphas = agreement.estimate_acceptance(engine, ref, candidates, GREEDY)
    floors = certified.estimate_acceptance(engine, ref, candidates, GREEDY)
    tighter = exact.estimate_acceptance(engine, ref, candidates, GREEDY)
    certificates = agreement.certificate(engine, ref, candidates, exact_radius=True)
    for alpha, floor, tight, certificate in zip(alphas, floors, tighter, certificates, strict=True):
        assert certificate.agrees is not None and certificate.certified_exact is not None
        assert bool((certificate.agrees | ~certificate.certified).all())  # certified ⇒ agrees
        assert bool((certificate.certified_exact | ~certificate.certified).all())
        assert floor.alpha <= tight.alpha <= alpha.alpha
        assert floor.high == 1.0
        stats = certificate.norm_ratio_stats()
        assert stats["min"] <= stats["mean"] <= stats["max"]
    if space == "folded":  # equal norms up to eps (1e-6 against tiny random states)
        assert certificates[2].norm_ratio_stats()["max_abs_log"] < 1e-3


def test_neg_kl_score_is_zero_for_the_full_model(
    engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache]
) -> None:
    ref, _ = window
    candidates = _candidates(engine, window)
    proxy = MonteCarloAcceptanceProxy.from_config(MonteCarloProxyConfig(score="neg-kl"), engine)
    scores = proxy.score(ref.final_hidden, candidates)
    assert float(scores[0]) == pytest.approx(0.0, abs=1e-5)
    assert bool((scores[1:] < 0).all())


def test_bad_input_gives_clear_errors(
    engine: SublayerEngine, window: tuple[ReferenceWindow, KVCache]
) -> None:
    ref, _ = window
    candidates = _candidates(engine, window)
    cosine, montecarlo = CosineProxy(), MonteCarloAcceptanceProxy()
    with pytest.raises(ValueError, match="does not match"):
        cosine.score(ref.final_hidden, candidates[:, :5])
    with pytest.raises(ValueError, match=r"\(branches, r, d\)"):
        cosine.score(ref.final_hidden, candidates[0])
    with pytest.raises(ValueError, match="empty"):
        cosine.score(ref.final_hidden[:0], candidates[:, :0])
    nan = candidates.clone()
    nan[1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cosine.score(ref.final_hidden, nan)
    with pytest.raises(ValueError, match="NaN"):
        montecarlo.estimate_acceptance(engine, ref, nan, GREEDY)
    empty = attrs.evolve(
        ref,
        points=ref.points[:, :0],
        token_ids=ref.token_ids[:0],
        target_tokens=ref.target_tokens[:0],
    )
    for proxy in (cosine, montecarlo):
        with pytest.raises(ValueError, match="empty"):
            proxy.estimate_acceptance(engine, empty, candidates[:, :0], GREEDY)
    with pytest.raises(ValueError, match="does not match reference"):
        montecarlo.estimate_acceptance(engine, ref, candidates[..., :16], GREEDY)
