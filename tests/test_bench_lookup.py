"""The bench's prompt-lookup pieces: the quote / edit scenarios, the lookup methods
(ours and transformers'), and the oracle's lookup family against brute force."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import test_bench
from knapspec.bench import (
    MethodSpec,
    Scenario,
    default_methods,
    prompts,
    run_benchmark,
    write_report,
)
from knapspec.bench.methods import HF_PROMPT_LOOKUP, available, lookup_methods
from knapspec.bench.oracle import lookup_candidates, lookup_replay
from knapspec.bench.prompts import EDIT_REPLACEMENTS, edit_prompt, quote_prompt
from knapspec.bench.runner import lookup_drafter_factory
from knapspec.bench.scenarios import default_scenarios
from knapspec.drafters.base import DraftRequest

tiny = test_bench.tiny  # the tiny random Llama and word-level tokenizer fixture


# ---------------------------------------------------------------- scenarios (real tokenizer)
@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from knapspec.model.loading.provision import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path(progress=False))


@pytest.mark.real_model
@pytest.mark.parametrize("text", ["default", "pydoc"])
@pytest.mark.parametrize("kind", ["quote", "edit"])
@pytest.mark.parametrize("length", [512, 2048])
def test_quote_and_edit_prompts_have_the_requested_length(
    smollm2_tokenizer: Any, kind: str, length: int, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if text == "pydoc":  # the corpus on a machine without the Austen texts
        pydoc = ("pydoc_data.topics", prompts.pydoc_corpus())
        monkeypatch.setattr(prompts, "corpus", lambda: pydoc)
    builder = quote_prompt if kind == "quote" else edit_prompt
    for seed in (1000, 1001):  # both quote questions (even and odd seeds)
        ids = builder(smollm2_tokenizer, length, seed)
        # N passage tokens plus the template, the question and the assistant's primer.
        assert length <= ids.numel() <= length + 160, (kind, seed, ids.numel())
        text = smollm2_tokenizer.decode(ids)
        assert text.count("<|im_start|>assistant") == 1
        opening = text.rsplit("<|im_start|>assistant\n", 1)[1]
        assert len(opening.split()) >= 6  # the assistant's turn is primed
        if kind == "edit":
            word, _ = next(
                pair for pair in EDIT_REPLACEMENTS if f"replacing every '{pair[0]}'" in text
            )
            passage = text.split("otherwise unchanged.", 1)[1]
            assert f" {word}" in passage
        else:
            # The primer's words are quoted from the passage (not invented).
            quoted = opening.split('"', 1)[1]
            assert quoted and quoted in text.split("<|im_start|>assistant")[0]


def test_default_scenarios_include_quote_and_edit() -> None:
    for quick in (False, True):
        kinds = {s.name: s.kind for s in default_scenarios(quick=quick)}
        assert kinds["qa-quote"] == "quote" and kinds["edit"] == "edit"


# ---------------------------------------------------------------- methods on a tiny model
def test_hf_prompt_lookup_is_lossless_and_drafts_on_a_repeating_prompt(
    tiny: tuple[Any, Any],
) -> None:
    """transformers' prompt lookup reproduces plain greedy decoding token for token, on a
    prompt where it does find matches (the prompt repeats a span the output continues)."""
    model, _ = tiny
    generator = torch.Generator().manual_seed(3)
    span = torch.randint(1, model.config.vocab_size, (12,), generator=generator)
    prompt = torch.cat([span, span, span[:4]]).unsqueeze(0)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": 24,
        "do_sample": False,
    }
    plain = model.generate(prompt, **kwargs)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=10, **kwargs)
    assert torch.equal(plain, lookup)
    # The prompt's 3-gram suffix occurs earlier: the candidate generator has a draft to offer.
    suffix = prompt[0, -3:].tolist()
    ids = prompt[0].tolist()
    assert any(ids[i : i + 3] == suffix for i in range(len(ids) - 3))


def test_lookup_methods_run_through_the_harness_losslessly(
    tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = tiny
    reference = next(m for m in default_methods() if m.name == "ar")
    methods = (reference, *lookup_methods())
    assert any(m.name == HF_PROMPT_LOOKUP for m in methods)  # needs only transformers
    scenarios = (
        Scenario("tiny-quote", "quote", (24,), 8, description="tiny"),
        Scenario("tiny-edit", "edit", (24,), 8, description="tiny"),
    )
    options = test_bench._options(tmp_path, methods, scenarios=scenarios, pairs=1)
    assert options.oracle is not None
    options = attrs.evolve(options, oracle=attrs.evolve(options.oracle, families=()))
    run_dir = run_benchmark(model, tokenizer, options)
    rows = [json.loads(line) for line in (run_dir / "raw.jsonl").read_text().splitlines()]
    measured = {(r["scenario"], r["method"]) for r in rows if r["role"] == "method"}
    assert measured == {(s.name, m.name) for s in scenarios for m in methods[1:]}
    assert all(r["lossless"] is True for r in rows)  # every greedy call equals AR's
    oracle = [json.loads(line) for line in (run_dir / "oracle.jsonl").read_text().splitlines()]
    assert len(oracle) == len(scenarios)
    for line in oracle:
        assert line["candidates"] == []  # the layer-skip sweep was off
        if lookup_drafter_factory() is not None:
            assert [c["draft_length"] for c in line["lookup"]] == [1, 2]  # k = 1 .. D
            assert line["speedup"] == max(1.0, *(c["speedup"] for c in line["lookup"]))
    report = write_report(run_dir).read_text()
    assert "Machine:" in report
    info = json.loads((run_dir / "run.json").read_text())
    hf = next(m for m in info["methods"] if m["name"] == HF_PROMPT_LOOKUP)
    assert hf["generate_kwargs"] == {"prompt_lookup_num_tokens": 10}
    for row in rows:
        if row["method"] not in ("ar", HF_PROMPT_LOOKUP):
            counted = sum(c["drafted"] for c in row["drafters"].values())
            assert counted == row["drafted_tokens"]


def test_a_method_this_installation_cannot_build_is_left_out() -> None:
    missing = MethodSpec("nope", {"planner": {"name": "no-such-planner"}})
    assert not available(missing)
    assert available(MethodSpec("generate", kind="generate"))


# ---------------------------------------------------------------- the oracle's lookup family
@attrs.define
class NaiveLookup:
    """Brute-force prompt lookup: rescans the whole context every round for the most recent
    earlier occurrence of its longest suffix (up to 3 tokens) and proposes what followed."""

    tokens: list[int] = attrs.field(factory=list)

    @attrs.frozen
    class Proposal:
        tokens: tuple[int, ...]

    def reset(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, request: DraftRequest) -> NaiveLookup.Proposal:
        seq, max_tokens = self.tokens, request.budget
        for n in (3, 2, 1):
            if len(seq) <= n:
                continue
            suffix = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == suffix:
                    follow = seq[start + n : start + n + max_tokens]
                    return NaiveLookup.Proposal(tuple(follow))
        return NaiveLookup.Proposal(())


def brute_force_speedups(
    prompt: Sequence[int], continuation: Sequence[int], prices: Sequence[float]
) -> dict[int, tuple[int, int, float]]:
    """k -> (rounds, accepted, speedup) by simulating fixed-k lookup decoding one token at a
    time: each round re-derives the whole context, drafts, and checks tokens one by one."""
    result = {}
    total = len(continuation)
    for k in range(1, len(prices)):
        generated = 1  # the first token comes from prefill
        time_spent, rounds, accepted_total = 0.0, 0, 0
        while generated < total:
            proposer = NaiveLookup()
            proposer.reset([*prompt, *continuation[:generated]])
            room = total - generated - 1
            draft = list(proposer.propose(DraftRequest(min(k, room))).tokens) if room > 0 else []
            accepted = 0
            for offset, token in enumerate(draft):
                if token != continuation[generated + offset]:
                    break
                accepted += 1
            generated += accepted + 1
            time_spent += prices[len(draft)]
            rounds += 1
            accepted_total += accepted
        plain = (total - 1) * prices[0]
        result[k] = (rounds, accepted_total, plain / time_spent)
    return result


@given(
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    continuation=st.lists(st.integers(0, 3), min_size=2, max_size=24),
    steps=st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4),
)
def test_lookup_family_matches_brute_force(
    prompt: list[int], continuation: list[int], steps: list[float]
) -> None:
    prices = [1.0]
    for step in steps:  # v(k) non-decreasing, as measured
        prices.append(prices[-1] + step)
    candidates = lookup_candidates(NaiveLookup, prompt, continuation, prices)
    expected = brute_force_speedups(prompt, continuation, prices)
    assert [c.draft_length for c in candidates] == list(expected)
    for candidate in candidates:
        rounds, accepted, speedup = expected[candidate.draft_length]
        assert candidate.rounds == rounds
        assert candidate.accepted == accepted
        assert candidate.drafted >= candidate.accepted
        # The replay adds its own (tiny) measured lookup time to the priced rounds.
        priced = (len(continuation) - 1) * prices[0] / speedup
        assert candidate.speedup == pytest.approx(
            (len(continuation) - 1) * prices[0] / (priced + candidate.lookup_seconds)
        )
    best = max(candidates, key=lambda c: c.speedup)
    brute_best = max(expected, key=lambda k: expected[k][2])
    assert expected[best.draft_length][2] == pytest.approx(expected[brute_best][2], rel=1e-3)


def test_lookup_replay_commits_the_whole_continuation() -> None:
    prompt = [5, 6, 7, 8, 9]
    continuation = [1, 5, 6, 7, 8, 9, 2]
    rounds, _ = lookup_replay(NaiveLookup(), prompt, continuation, 3)
    assert sum(accepted + 1 for _, accepted in rounds) == len(continuation) - 1
    # After "1", the context's suffix "1" never occurred: a plain step; then "5" matches
    # the prompt and 3 tokens "6 7 8" are drafted and accepted.
    assert rounds[:2] == [(0, 0), (3, 3)]


@pytest.mark.parametrize("k", [3, 10])
def test_lookup_replay_reproduces_the_decoders_fixed_k_rounds(
    tiny: tuple[Any, Any], k: int
) -> None:
    """The oracle's replay of the AR output is the ``lookup-k`` method's actual run: same
    rounds, same drafted and accepted tokens (so its pricing prices what the method does)."""
    factory = lookup_drafter_factory()
    if factory is None:
        pytest.skip("this installation has no lookup drafter")
    from knapspec.config import DecoderConfig
    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.model.engine import SublayerEngine

    model, _ = tiny
    engine = SublayerEngine(model)
    config = DecoderConfig.from_dict(
        {"planner": {"name": "lookup", "draft_length": k}, "max_draft_length": 10}
    )
    decoder = SpeculativeDecoder.from_config(engine, config)
    generator = torch.Generator().manual_seed(5)
    span = torch.randint(1, model.config.vocab_size, (10,), generator=generator)
    prompt = torch.cat([span, span, span[:3]])
    result = decoder.generate(prompt, max_new_tokens=40)
    rounds, _ = lookup_replay(factory(), prompt.tolist(), result.tokens.tolist(), k)
    assert [accepted + 1 for _, accepted in rounds] == list(result.stats.accept_lengths)
    assert sum(d for d, _ in rounds) == result.stats.drafted_tokens > 0
    assert sum(a for _, a in rounds) == result.stats.accepted_tokens
