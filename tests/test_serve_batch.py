"""The scheduler's engine, :class:`~knapspec.decoding.continuous.ContinuousBatch`, in
process on a tiny random Llama: rows that join and leave between rounds equal their
prompts decoded alone (greedy and seeded sampling), a cancelled row frees its lane, and a
row whose logits turn NaN mid-decode fails alone."""

from __future__ import annotations

import attrs
import pytest
import torch

from knapspec import SpeculativeDecoder
from knapspec.decoding.continuous import CANCELLED, FAILED
from knapspec.request import Request
from knapspec.sampling import SamplingParams
from knapspec.testing.models import tiny_llama

VOCAB = 96
Outcome = tuple[list[int], str]


def _decoder(prefix_cache_mib: float = 0) -> SpeculativeDecoder:
    model = tiny_llama(4, vocab_size=VOCAB, hidden_size=32, layer_damping=0.3, head_scale=8)
    return SpeculativeDecoder(model, {"prefix_cache_mib": prefix_cache_mib})


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 30, 12, 3, 21][:count]
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _alone(decoder: SpeculativeDecoder, request: Request) -> list[int]:
    sampling = attrs.evolve(request.sampling, seed=request.seed)
    result = decoder.generate(
        request.prompt, max_new_tokens=request.max_new_tokens, sampling=sampling
    )
    tokens: list[int] = result.tokens.tolist()
    return tokens


def _drive(decoder: SpeculativeDecoder, requests: list[Request], lanes: int) -> list[Outcome]:
    """Feed ``requests`` through ``lanes`` rows as lanes free up; per request, its tokens
    and stop reason."""
    batch = decoder.continuous_batch(lanes, 160)
    queue = list(enumerate(requests))
    owner: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while queue or batch.active:
        while queue and batch.free_lanes:
            key, request = queue.pop(0)
            update = batch.add(request)
            owner[update.lane], tokens[key] = key, list(update.tokens)
            reasons[key] = update.stop_reason
        for update in batch.step():
            key = owner[update.lane]
            tokens[key].extend(update.tokens)
            reasons[key] = update.stop_reason
    return [(tokens[k], reasons[k]) for k in range(len(requests))]


@pytest.mark.parametrize("prefix_cache_mib", [0, 64])
def test_rows_joining_and_leaving_equal_each_prompt_alone(prefix_cache_mib: float) -> None:
    """With the prefix cache (as the server runs), each prompt comes twice: the second
    admission reuses the first's K/V."""
    decoder = _decoder(prefix_cache_mib)
    prompts = _prompts(7)
    sampled = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9)
    requests = [Request(p, 12 + 5 * i) for i, p in enumerate(prompts)]
    requests += [Request(p, 25, sampling=sampled, seed=40 + i) for i, p in enumerate(prompts)]
    alone = [_alone(decoder, request) for request in requests]
    together = _drive(decoder, requests, lanes=3)
    assert [tokens for tokens, _ in together] == alone
    assert {reason for _, reason in together} == {"max_new_tokens"}


def test_stop_ids_and_limits_are_per_row() -> None:
    decoder = _decoder()
    prompt = _prompts(1)[0]
    free = _alone(decoder, Request(prompt, 20))
    stop = free[6]
    requests = [Request(prompt, 20, stop_ids=frozenset({stop})), Request(prompt, 9)]
    (stopped, reason), (limited, limit_reason) = _drive(decoder, requests, lanes=2)
    assert stopped == free[: free.index(stop) + 1] and reason == "eos"
    assert limited == free[:9] and limit_reason == "max_new_tokens"


def test_a_cancelled_row_frees_its_lane() -> None:
    decoder = _decoder()
    first, second = _prompts(2)
    batch = decoder.continuous_batch(1, 160)
    lane = batch.add(Request(first, 100)).lane
    batch.step()
    assert batch.free_lanes == 0
    batch.cancel(lane)
    assert batch.free_lanes == 1 and not batch.active
    assert batch.rows[lane].stats.stop_reason == CANCELLED
    update = batch.add(Request(second, 10))
    tokens = list(update.tokens)
    while batch.active:
        tokens += [t for u in batch.step() for t in u.tokens]
    assert tokens == _alone(decoder, Request(second, 10))


def test_a_row_with_nan_logits_mid_decode_fails_alone() -> None:
    """The token a row will feed at its third step gets a NaN embedding: that row stops
    with ``"error"`` at that round; a row that never sees the token goes on unharmed."""
    decoder = _decoder()
    prompts = _prompts(7, seed=3)
    outputs = [_alone(decoder, Request(p, 16)) for p in prompts]
    for victim, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        poison = output[2]
        others = [
            i for i in range(len(prompts)) if i != victim and poison not in prompts[i] + outputs[i]
        ]
        if poison not in prompt and poison not in output[:2] and others:
            break
    else:
        raise AssertionError("no prompt pair fits the test; change the seed")
    bystander = others[0]
    embeddings = decoder.engine.model.get_input_embeddings().weight
    with torch.no_grad():
        saved = embeddings[poison].clone()
        embeddings[poison] = float("nan")
    try:
        results = _drive(
            decoder, [Request(prompts[victim], 16), Request(prompts[bystander], 16)], 2
        )
    finally:
        with torch.no_grad():
            embeddings[poison] = saved
    (failed_tokens, failed_reason), (tokens, reason) = results
    assert failed_reason == FAILED
    assert failed_tokens == output[: len(failed_tokens)] and len(failed_tokens) < 16
    assert tokens == outputs[bystander] and reason == "max_new_tokens"
