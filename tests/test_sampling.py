"""Lossless speculative sampling: the rejection rule and the decoder's output distribution.

Both verification schemes are checked: position-keyed (the default) and rejection
sampling. The statistical tests use a fixed seed, so they are deterministic; each is paired
with a power check showing the same test rejects a sampler that is *not* lossless (outputs
taken straight from the draft), so a pass is evidence, not luck.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import attrs
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

import knapspec.decoding.sampler as sampler_module
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.decoding.sampler import TokenSampler
from knapspec.decoding.verify import Verdict, residual_distribution, verify_sampling
from knapspec.drafters.base import Draft
from knapspec.planners import LookupPlanner, StaticPlanner
from knapspec.planners.lookup import LookupPlannerConfig
from knapspec.sampling import REJECTION, SamplingParams, processed_probs, sample_token
from knapspec.types import SublayerMask

VOCAB = 6


def _distribution(values: list[float]) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=torch.float64) + 1e-3
    return tensor / tensor.sum()


@given(
    p=st.lists(st.floats(0, 1), min_size=VOCAB, max_size=VOCAB),
    q=st.lists(st.floats(0, 1), min_size=VOCAB, max_size=VOCAB),
)
def test_rejection_rule_output_distribution_is_exactly_p(p: list[float], q: list[float]) -> None:
    """Exact arithmetic: P(out = x) = q(x) min(1, p(x)/q(x)) + P(reject) residual(x) = p(x)."""
    p_t, q_t = _distribution(p), _distribution(q)
    accept = q_t * torch.minimum(torch.ones_like(p_t), p_t / q_t)
    reject = 1 - accept.sum()
    out = accept + reject * residual_distribution(p_t, q_t)
    torch.testing.assert_close(out, p_t, atol=1e-12, rtol=0)


def test_verify_sampling_first_token_matches_p_empirically() -> None:
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])
    draws = 20_000
    counts = Counter()
    drafts = torch.multinomial(q, draws, replacement=True, generator=generator).tolist()
    target = torch.stack([p, p])
    for draft in drafts:
        verdict = verify_sampling([draft], q.unsqueeze(0), target, generator)
        counts[verdict.tokens[0]] += 1
    observed = [counts[x] for x in range(5)]  # token 5 has p = 0: never emitted
    assert counts[5] == 0
    assert chisquare(observed, (p[:5] * draws).tolist()).pvalue > 1e-3


def _small_vocab_model() -> LlamaForCausalLM:
    torch.manual_seed(4)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # spread the distributions away from uniform
    return model


def _exact_joint(
    model: LlamaForCausalLM, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """Exact target probability of every continuation of ``length`` tokens (one batch)."""
    continuations = list(itertools.product(range(VOCAB), repeat=length))
    ids = torch.tensor([prompt + list(continuation) for continuation in continuations])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]  # (cells, length, vocab)
    probs = processed_probs(logits.reshape(-1, VOCAB), params).double()
    probs = probs.reshape(len(continuations), length, VOCAB)
    chosen = probs.gather(2, torch.tensor(continuations).unsqueeze(-1)).squeeze(-1)
    joint = chosen.prod(dim=1).tolist()
    return dict(zip(continuations, joint, strict=True))


def _chi_square_pvalue(
    samples: Counter[tuple[int, ...]], joint: dict[tuple[int, ...], float]
) -> float:
    total = sum(samples.values())
    observed, expected = [], []
    pooled_observed, pooled_expected = 0.0, 0.0
    for cell, probability in joint.items():
        if probability * total >= 5:
            observed.append(samples[cell])
            expected.append(probability * total)
        else:  # pool sparse cells so the chi-square approximation holds
            pooled_observed += samples[cell]
            pooled_expected += probability * total
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    elif pooled_observed > 0:
        return 0.0  # a continuation of probability zero was sampled
    scale = sum(observed) / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def _sample(
    decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams, runs: int, length: int
) -> Counter[tuple[int, ...]]:
    """``runs`` seeded generations; asserts that rounds really drafted ``length - 2`` tokens."""
    counts: Counter[tuple[int, ...]] = Counter()
    drafted_at_position = [0] * length
    for seed in range(runs):
        result = decoder.generate(
            torch.tensor(prompt),
            max_new_tokens=length,
            sampling=attrs.evolve(params, seed=seed),
        )
        counts[tuple(result.tokens.tolist())] += 1
        for position, drafted in enumerate(result.stats.drafted_at_position):
            drafted_at_position[position] += drafted
    # The first round after the prefill drafts length - 2 tokens (one token comes from the
    # prefill, one is the verifier's bonus): every run drafts at positions 0 .. length - 3.
    assert drafted_at_position[length - 3] >= runs, drafted_at_position
    return counts


PROMPT = [1, 4, 2, 0, 3]
LENGTH = 5  # token 1 from the prefill; tokens 2-4 drafted in one round, 5 its bonus
RUNS = 2000
BAD_DRAFT = SublayerMask.from_skipped(3, [0, 1, 2, 3, 5])  # keeps one item: a poor draft


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, temperature=1.0),
        SamplingParams(do_sample=True, temperature=0.7, top_p=0.9),
        SamplingParams(do_sample=True, temperature=1.5, top_k=3),
        SamplingParams(do_sample=True, temperature=1.0, verification=REJECTION),
        # The rejection scheme's second setting runs in the slow tier (docs/reliability.md).
        pytest.param(
            SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, verification=REJECTION),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["T=1", "T=0.7,top_p=0.9", "T=1.5,top_k=3", "T=1,rejection", "T=0.7,top_p=0.9,rejection"],
)
def test_speculative_samples_are_distributed_as_the_target(params: SamplingParams) -> None:
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(BAD_DRAFT, LENGTH), confidence_threshold=0
    )
    joint = _exact_joint(model, PROMPT, params, LENGTH)
    samples = _sample(decoder, PROMPT, params, RUNS, LENGTH)
    assert _chi_square_pvalue(samples, joint) > 1e-3


def test_the_chi_square_check_has_power_against_a_lossy_sampler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accepting every draft token (output ~ the draft) must be caught by the same test."""

    accepted: list[int] = []

    def accept_everything(drafts, draft_probs, target_probs, generator):  # type: ignore[no-untyped-def]
        accepted.append(len(drafts))
        bonus = int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))
        return Verdict(len(drafts), [*drafts, bonus])

    monkeypatch.setattr(sampler_module, "verify_sampling", accept_everything)
    params = SamplingParams(do_sample=True, temperature=1.0, verification=REJECTION)
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(BAD_DRAFT, LENGTH), confidence_threshold=0
    )
    joint = _exact_joint(model, PROMPT, params, LENGTH)
    samples = _sample(decoder, PROMPT, params, RUNS, LENGTH)
    assert sum(accepted) > RUNS, "the lossy verifier never judged a draft"
    assert _chi_square_pvalue(samples, joint) < 1e-6


def accept_every_keyed_draft(
    self: TokenSampler, draft: Draft, logits: torch.Tensor, position: int
) -> Verdict:
    """The lossy position-keyed verifier: every draft token is kept (output ~ the draft,
    which drew it with the right noise), then the target's keyed token after them."""
    k = len(draft)
    bonus = self.choose(logits[k], position + k)[0]
    return Verdict(k, [*draft.tokens, bonus])


def test_the_chi_square_check_has_power_against_a_lossy_keyed_verifier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    verdicts = counting(monkeypatch, TokenSampler, "verify", accept_every_keyed_draft)
    params = SamplingParams(do_sample=True, temperature=1.0)
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(BAD_DRAFT, LENGTH), confidence_threshold=0
    )
    joint = _exact_joint(model, PROMPT, params, LENGTH)
    samples = _sample(decoder, PROMPT, params, RUNS, LENGTH)
    assert verdicts, "the lossy verifier never judged a draft"
    assert _chi_square_pvalue(samples, joint) < 1e-6


def counting(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, replacement: Any
) -> list[object]:
    """Put ``replacement`` at ``owner.name`` for the test and return the list its calls'
    results are appended to (so a power check can show that its mutant ran)."""
    results: list[object] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = replacement(*args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(owner, name, recorded)
    return results


def test_sampling_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(do_sample=True, top_k=-1)
    with pytest.raises(ValueError, match="verification must be one of"):
        SamplingParams(do_sample=True, verification="gumbel")
    with pytest.raises(TypeError, match="verification"):
        SamplingParams(do_sample=True, verification=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"top_k": "3"}, TypeError, "top_k"),
        ({"temperature": "0.7"}, TypeError, "temperature"),
        ({"top_p": None}, TypeError, "top_p"),
        ({"do_sample": "yes"}, TypeError, "do_sample"),
        ({"seed": 2**70}, ValueError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1.0}, TypeError, "seed"),
    ],
)
def test_sampling_parameter_types_are_checked(
    kwargs: dict[str, object], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_parameters_accept_any_integer_kind() -> None:
    import numpy as np

    params = SamplingParams(do_sample=True, temperature=1, top_k=np.int64(3), seed=np.uint64(2**63))
    assert params == SamplingParams(do_sample=True, temperature=1.0, top_k=3, seed=2**63)
    assert type(params.top_k) is int and type(params.temperature) is float


@pytest.mark.parametrize("temperature", [1e-30, 1e-36, 1e-40, 1e-300, 5e-324])
def test_tiny_temperature_samples_greedily(temperature: float) -> None:
    """Below the documented floor the distribution is a point mass on the argmax (1e-40
    used to overflow float32 into NaN probabilities and sample token vocab - 1)."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 8
    probs = processed_probs(logits, SamplingParams(do_sample=True, temperature=temperature))
    assert bool(torch.isfinite(probs).all())
    expected = torch.nn.functional.one_hot(logits.argmax(-1), 49152).float()
    assert torch.equal(probs, expected)


def test_tiny_temperature_decodes_as_greedy() -> None:
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(BAD_DRAFT, 3), confidence_threshold=0)
    greedy = decoder.generate(torch.tensor(PROMPT), max_new_tokens=12).tokens
    params = SamplingParams(do_sample=True, temperature=1e-40, seed=1)
    sampled = decoder.generate(torch.tensor(PROMPT), max_new_tokens=12, sampling=params).tokens
    assert torch.equal(sampled, greedy)


def test_unseeded_sampling_follows_torch_global_seed() -> None:
    """As with ``model.generate``: ``torch.manual_seed(s)`` makes an unseeded call repeat."""
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(BAD_DRAFT, 3), confidence_threshold=0)
    params = SamplingParams(do_sample=True, temperature=1.5)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(decoder.generate(torch.tensor(PROMPT), max_new_tokens=24, sampling=params))
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert not torch.equal(runs[0].tokens, runs[2].tokens)


def test_seeded_sampling_is_reproducible() -> None:
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(BAD_DRAFT, 3), confidence_threshold=0)
    params = SamplingParams(do_sample=True, temperature=0.9, seed=123)
    first = decoder.generate(torch.tensor(PROMPT), max_new_tokens=12, sampling=params).tokens
    second = decoder.generate(torch.tensor(PROMPT), max_new_tokens=12, sampling=params).tokens
    assert torch.equal(first, second)


def _nucleus_oracle(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k then top-p by the definition, in float64 with a full sort: ``(vocab,)`` probs."""
    scores = logits.double() / params.temperature
    order = torch.argsort(scores, descending=True)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    candidates = order[: params.top_k] if params.top_k > 0 else order
    mass = scores[candidates].softmax(-1)
    total = 0.0
    for token, probability in zip(candidates.tolist(), mass.tolist(), strict=True):
        if total >= params.top_p:
            break
        keep[token] = True
        total += probability
    return scores.masked_fill(~keep, float("-inf")).softmax(-1)


@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 3000),
    scale=st.floats(0.05, 30.0),
    temperature=st.floats(0.3, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.sampled_from([0, 0, 1, 5, 100]),
)
def test_processed_probs_matches_the_sorted_definition(
    seed: int, vocab: int, scale: float, temperature: float, top_p: float, top_k: int
) -> None:
    """The top-64-first nucleus search equals a full sort, however large the nucleus."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    params = SamplingParams(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    expected = _nucleus_oracle(logits, params)
    # A prefix whose mass is within float32 rounding of top_p may fall either way.
    cumulative = torch.sort(expected[expected > 0], descending=True).values.cumsum(0)
    assume(bool(((cumulative - top_p).abs() > 1e-5).all()))
    actual = processed_probs(logits, params).double()
    assert torch.equal(actual > 0, expected > 0)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_processed_probs_finds_each_rows_nucleus_in_a_batch() -> None:
    """Rows with nuclei of 1, ~200 and ~2000 tokens share one call."""
    generator = torch.Generator().manual_seed(7)
    flat = torch.randn(3000, generator=generator) * 0.05
    peaked = torch.randn(3000, generator=generator) * 40.0
    middle = torch.randn(3000, generator=generator) * 4.0
    logits = torch.stack([peaked, middle, flat])
    params = SamplingParams(do_sample=True, temperature=1.0, top_p=0.8)
    actual = processed_probs(logits, params)
    sizes = (actual > 0).sum(-1).tolist()
    assert sizes[0] < 10 and sizes[2] > 1000, sizes
    for row, logits_row in zip(actual, logits, strict=True):
        expected_row = _nucleus_oracle(logits_row, params)
        torch.testing.assert_close(row.double(), expected_row, atol=1e-6, rtol=1e-5)


def test_a_tie_at_the_nucleus_boundary_keeps_every_tied_token() -> None:
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, -3.0])
    probs = processed_probs(logits, SamplingParams(do_sample=True, top_p=0.6))
    assert (probs[:4] > 0).all() and probs[4] == 0


def test_sample_token_is_distributed_as_its_input_and_never_draws_a_zero() -> None:
    probs = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2, 0.1, 0.05, 0.0])
    generator = torch.Generator().manual_seed(3)
    draws = 20_000
    counts = Counter(sample_token(probs, generator) for _ in range(draws))
    assert set(counts) <= {1, 3, 4, 5, 6}
    live = [1, 3, 4, 5, 6]
    observed = [counts[x] for x in live]
    assert chisquare(observed, (probs[live] * draws).tolist()).pvalue > 1e-3
    # The same check catches a sampler that is off by one token.
    shifted = [counts[x] for x in [3, 4, 5, 6, 1]]
    assert chisquare(shifted, (probs[live] * draws).tolist()).pvalue < 1e-6


@given(
    weights=st.lists(st.one_of(st.just(0.0), st.floats(1e-30, 1e3)), min_size=1, max_size=40),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_token_only_draws_tokens_with_mass(weights: list[float], seed: int) -> None:
    probs = torch.tensor(weights, dtype=torch.float32)
    assume(bool((probs > 0).any()))
    generator = torch.Generator().manual_seed(seed)
    for _ in range(20):
        assert probs[sample_token(probs, generator)] > 0


def test_sample_token_handles_a_point_that_rounds_up_to_the_total(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """u * total can round up to total; the draw must still be a token with mass."""
    probs = torch.tensor([0.3, 0.7, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(1, dtype=torch.float64))
    assert sample_token(probs) == 1


@pytest.mark.parametrize("vocab", [2, 5])
def test_one_hot_draft_rule_gives_exactly_p(vocab: int) -> None:
    """A deterministic draft x (q one-hot): accept with p(x), else resample from p without
    x. Summed exactly over both branches, the committed token is distributed as p."""
    torch.manual_seed(vocab)
    p = torch.softmax(torch.randn(vocab, dtype=torch.float64), -1)
    for x in range(vocab):
        q = torch.zeros(vocab, dtype=torch.float64)
        q[x] = 1.0
        residual = residual_distribution(p, q)
        assert residual[x] == 0
        output = (1 - p[x]) * residual
        output[x] += p[x]
        assert torch.allclose(output, p)


def _exact_joint_batched(
    model: LlamaForCausalLM, prompt: list[int], params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """:func:`_exact_joint` in one batched forward (``VOCAB ** length`` rows)."""
    continuations = list(itertools.product(range(VOCAB), repeat=length))
    ids = torch.tensor([prompt + list(c) for c in continuations])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt) - 1 : -1]  # (rows, length, vocab)
    probs = processed_probs(logits.reshape(-1, VOCAB), params).double().reshape(logits.shape)
    chosen = probs.gather(-1, ids[:, len(prompt) :, None])[..., 0].prod(-1)
    return dict(zip(continuations, chosen.tolist(), strict=True))


LOOKUP_PROMPT = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1]  # every token recurs: lookup fires
LOOKUP_LENGTH = 5  # token 1 from the prefill, then a round of 3 lookup drafts + 1 target token
LOOKUP_RUNS = 3000


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, temperature=1.0),
        SamplingParams(do_sample=True, temperature=0.7, top_p=0.9),
        pytest.param(
            SamplingParams(do_sample=True, temperature=1.0, verification=REJECTION),
            marks=pytest.mark.slow,  # the rejection scheme's lookup check: slow tier
        ),
    ],
    ids=["T=1", "T=0.7,top_p=0.9", "T=1,rejection"],
)
def test_lookup_drafts_sample_exactly_the_target(params: SamplingParams) -> None:
    """One-hot lookup drafts through either verifier: the 5-token continuations are
    distributed as the target's, and the rounds really drafted 3 tokens."""
    model = _small_vocab_model()
    decoder = SpeculativeDecoder(model, planner=LookupPlanner(LookupPlannerConfig(3)))
    joint = _exact_joint_batched(model, LOOKUP_PROMPT, params, LOOKUP_LENGTH)
    samples: Counter[tuple[int, ...]] = Counter()
    three_token_rounds = accepted_drafts = 0
    for seed in range(LOOKUP_RUNS):
        result = decoder.generate(
            torch.tensor(LOOKUP_PROMPT),
            max_new_tokens=LOOKUP_LENGTH,
            sampling=attrs.evolve(params, seed=seed),
        )
        samples[tuple(result.tokens.tolist())] += 1
        stats = result.stats
        three_token_rounds += len(stats.drafted_at_position) >= 3
        accepted_drafts += stats.accepted_tokens
    assert three_token_rounds == LOOKUP_RUNS  # every call drafted a 3-token lookup round
    assert accepted_drafts > LOOKUP_RUNS // 10  # and drafts were accepted, not just tried
    assert _chi_square_pvalue(samples, joint) > 1e-3
