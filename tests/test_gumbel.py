"""The position-keyed Gumbel stream and the keyed argmax (:mod:`knapspec.gumbel`).

The stream is checked against SplitMix64's published test vector and a pure-Python
transcription; the keyed argmax against the full-vocabulary argmax it prunes; its samples
against the distribution they should follow (chi-square), with power checks that the same
statistic rejects two plausible bugs: noise at half scale, and a stream with few keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from knapspec.gumbel import (
    FIRST_CANDIDATES,
    GUMBEL_MAX,
    GUMBEL_MIN,
    gumbel_noise,
    keyed_argmax,
    mix64,
    position_key,
    uniforms,
)
from knapspec.sampling import SamplingParams, processed_probs, processed_scores

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(state: int, count: int) -> list[int]:
    """SplitMix64 (Steele, Lea & Flood 2014), transcribed: ``count`` outputs from ``state``."""
    out = []
    for _ in range(count):
        state = (state + GOLDEN) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        out.append(z ^ (z >> 31))
    return out


def test_the_stream_is_splitmix64() -> None:
    # The reference implementation's first outputs from seed 1234567.
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert _splitmix64(1234567, 3) == expected
    assert [mix64((1234567 + (i + 1) * GOLDEN) & MASK) for i in range(3)] == expected


@given(key=st.integers(0, MASK), ids=st.lists(st.integers(0, 2**20), min_size=1, max_size=20))
def test_uniforms_are_the_top_bits_of_splitmix64_at_each_token_id(key: int, ids: list[int]) -> None:
    """torch's int64 arithmetic wraps like uint64 here; any slip changes the bits."""
    got = uniforms(key, torch.tensor(ids, dtype=torch.int64)).tolist()
    expected = [((_splitmix64(key, i + 1)[-1] >> 41) + 0.5) * 2.0**-23 for i in ids]
    assert got == expected
    assert all(0.0 < u < 1.0 for u in got)


def test_the_extreme_uniforms_give_finite_noise_within_the_span() -> None:
    # The grid's ends, (0 + 1/2) 2^-23 and (2^23 - 1/2) 2^-23, exactly in float32.
    ends = torch.tensor([0.5 * 2.0**-23, 1 - 0.5 * 2.0**-23], dtype=torch.float32)
    assert ends[1] < 1.0
    noise = ends.log().neg().log().neg()
    assert bool(torch.isfinite(noise).all())
    assert float(noise[0]) > GUMBEL_MIN + 0.4 and float(noise[1]) < GUMBEL_MAX - 0.4


def test_keys_differ_by_seed_and_by_position() -> None:
    keys = {position_key(seed, t) for seed in range(20) for t in range(500)}
    assert len(keys) == 20 * 500


@given(key=st.integers(0, MASK), ids=st.lists(st.integers(0, 999), min_size=1, max_size=50))
def test_a_tokens_noise_does_not_depend_on_which_others_are_computed(
    key: int, ids: list[int]
) -> None:
    full = gumbel_noise(key, torch.arange(1000))
    index = torch.tensor(ids, dtype=torch.int64)
    assert torch.equal(gumbel_noise(key, index), full[index])


scores_strategy = st.lists(
    st.one_of(st.floats(-60, 60), st.just(float("-inf"))), min_size=2, max_size=300
).filter(lambda values: any(math.isfinite(v) for v in values))


@given(values=scores_strategy, key=st.integers(0, MASK), scale=st.sampled_from([1.0, 1e3]))
def test_the_pruned_argmax_is_the_full_argmax(values: list[float], key: int, scale: float) -> None:
    scores = torch.tensor(values, dtype=torch.float32) * scale
    relative = scores - scores.max()  # as keyed_argmax computes it
    full = relative + gumbel_noise(key, torch.arange(len(values)))
    assert keyed_argmax(scores[None], [key]) == [int(full.argmax())]


@pytest.mark.parametrize(
    "spread", [100.0, 10.0, 0.0], ids=["first-candidates", "gathered", "whole-vocab"]
)
def test_each_pruning_path_gives_the_full_argmax(spread: float) -> None:
    """A sharp row is decided by its first candidates, a moderate one gathers the tokens
    within reach, a flat one computes the whole vocabulary."""
    vocab = 4 * FIRST_CANDIDATES
    scores = -spread * torch.rand(20, vocab, generator=torch.Generator().manual_seed(1))
    keys = [position_key(5, t) for t in range(20)]
    relative = scores - scores.max(-1, keepdim=True).values
    full = [
        int((relative[r] + gumbel_noise(k, torch.arange(vocab))).argmax())
        for r, k in enumerate(keys)
    ]
    assert keyed_argmax(scores, keys) == full


def test_a_floor_temperature_picks_the_argmax_and_breaks_exact_ties_by_noise() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    params = SamplingParams(do_sample=True, temperature=1e-30)
    scores = processed_scores(logits, params)
    picks = {keyed_argmax(scores, [position_key(seed, 0)])[0] for seed in range(50)}
    assert picks == {1, 2}


# ------------------------------------------------------------------ the distribution
DRAWS = 10_000


def _target() -> tuple[torch.Tensor, SamplingParams]:
    logits = torch.tensor([2.0, 1.5, 0.3, -0.4, 0.9, -2.0, 1.1])
    return logits, SamplingParams(do_sample=True, temperature=0.7, top_k=6)


def _pvalue(picks: list[int], probs: torch.Tensor) -> float:
    live = probs > 0
    counts = torch.bincount(torch.tensor(picks), minlength=probs.numel()).double()
    if float(counts[~live].sum()) > 0:
        return 0.0  # a filtered token was drawn
    expected = probs[live].double() / probs[live].double().sum() * len(picks)
    return float(chisquare(counts[live].tolist(), expected.tolist()).pvalue)


def _keyed_samples(noise_scale: float = 1.0, distinct_seeds: int | None = None) -> list[int]:
    """One draw per seed at one position; the variants are the power checks' bugs."""
    logits, params = _target()
    scores = processed_scores(logits, params)
    index = torch.arange(scores.numel())
    picks = []
    for seed in range(DRAWS):
        seed = seed % distinct_seeds if distinct_seeds else seed
        key = position_key(seed, 1234)
        if noise_scale == 1.0 and distinct_seeds is None:
            picks.append(keyed_argmax(scores[None], [key])[0])
        else:
            picks.append(int((scores + noise_scale * gumbel_noise(key, index)).argmax()))
    return picks


def test_keyed_samples_over_seeds_are_distributed_as_the_processed_target() -> None:
    logits, params = _target()
    assert _pvalue(_keyed_samples(), processed_probs(logits, params)) > 1e-3


def test_keyed_samples_over_positions_are_distributed_as_the_processed_target() -> None:
    logits, params = _target()
    scores = processed_scores(logits, params)
    picks = [keyed_argmax(scores[None], [position_key(7, t)])[0] for t in range(DRAWS)]
    assert _pvalue(picks, processed_probs(logits, params)) > 1e-3


@pytest.mark.parametrize(
    "bug", [{"noise_scale": 0.5}, {"distinct_seeds": 16}], ids=["half-noise", "16-keys"]
)
def test_the_chi_square_check_has_power_against_a_lossy_stream(bug: dict[str, float]) -> None:
    logits, params = _target()
    assert _pvalue(_keyed_samples(**bug), processed_probs(logits, params)) < 1e-6  # type: ignore[arg-type]


# ------------------------------------------------------------------ the coupling
def _coupling_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Exact P(argmax(log p + G) = argmax(log q + G)) (race of exponentials):
    ``sum_i 1 / sum_j max(p_j / p_i, q_j / q_i)`` over tokens both give mass."""
    total = 0.0
    for i in range(p.numel()):
        if p[i] > 0 and q[i] > 0:
            total += float(1.0 / torch.maximum(p / p[i], q / q[i]).sum())
    return total


@settings(max_examples=30, deadline=None)
@given(
    p_logits=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
    q_logits=st.lists(st.floats(-3, 3), min_size=4, max_size=4),
)
def test_the_gumbel_coupling_accepts_between_a_over_2_minus_a_and_a(
    p_logits: list[float], q_logits: list[float]
) -> None:
    """Drafting with the target's noise: the acceptance is the coupling's exact formula,
    within ``[a / (2 - a), a]`` for ``a = sum min(p, q)`` (the best any coupling does)."""
    p = torch.softmax(torch.tensor(p_logits, dtype=torch.float64), -1)
    q = torch.softmax(torch.tensor(q_logits, dtype=torch.float64), -1)
    exact = _coupling_acceptance(p, q)
    a = float(torch.minimum(p, q).sum())
    assert a / (2 - a) - 1e-9 <= exact <= a + 1e-9


def test_the_coupling_formula_matches_drafting_with_the_same_noise() -> None:
    p = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 0.7]), -1)
    q = torch.softmax(torch.tensor([0.1, 0.9, -0.2, 0.6]), -1)
    draws = 10_000
    agree = sum(
        keyed_argmax(p.log()[None], [position_key(s, 3)])
        == keyed_argmax(q.log()[None], [position_key(s, 3)])
        for s in range(draws)
    )
    exact = _coupling_acceptance(p.double(), q.double())
    assert abs(agree / draws - exact) < 4 * math.sqrt(exact * (1 - exact) / draws)
    assert exact < float(torch.minimum(p, q).sum())  # below rejection sampling's here
