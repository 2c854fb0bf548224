"""The hindsight drafters of ``benchmarks/batched_oracle.py`` on a tiny random Llama: every
method decodes each prompt exactly as plain decoding does, the lookup oracle never drafts
a token the target rejects, and the perfect drafter drafts only accepted tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from benchmarks.batched_oracle import ANSWERS, build_methods, run_batch

from knapspec import SpeculativeDecoder
from knapspec.testing.models import tiny_llama

VOCAB = 48


@pytest.fixture
def answers() -> Iterator[dict[tuple[int, ...], list[int]]]:
    ANSWERS.clear()
    yield ANSWERS
    ANSWERS.clear()


def test_every_method_reproduces_plain_decoding_and_the_oracles_waste_nothing(
    answers: dict[tuple[int, ...], list[int]],
) -> None:
    model = tiny_llama(3, vocab_size=VOCAB, hidden_size=32, layer_damping=0.3, head_scale=8)
    decoder = SpeculativeDecoder(model)
    generator = torch.Generator().manual_seed(3)
    # Short repeating prompts: a small random model loops, so lookup finds drafts.
    prompts = [(torch.randint(0, VOCAB, (n,), generator=generator).tolist() * 3) for n in (4, 6, 5)]
    methods = build_methods(decoder, cap=8, perfect=[3], fixed=[2], capacity=160)
    assert next(iter(methods)) == "ar"
    reference = run_batch(methods["ar"](2), prompts, 2, frozenset(), max_new_tokens=40)
    assert reference["drafted_tokens"] == 0
    for prompt, answer in zip(prompts, reference["answers"], strict=True):
        alone = decoder.generate(prompt, max_new_tokens=40).tokens.tolist()
        assert answer == alone
        answers[tuple(prompt)] = answer
    results = {}
    for name, build in methods.items():
        result = run_batch(build(2), prompts, 2, frozenset(), max_new_tokens=40)
        assert result["answers"] == reference["answers"], name
        results[name] = result
    oracle, perfect = results["lookup-oracle"], results["perfect-3"]
    assert oracle["accepted_tokens"] == oracle["drafted_tokens"] > 0
    assert perfect["accepted_tokens"] == perfect["drafted_tokens"] > 0
    # Never wrong and three tokens a round: far fewer rounds than plain decoding.
    assert perfect["rounds"] < reference["rounds"] / 2
