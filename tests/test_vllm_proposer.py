"""The vLLM proposer against vLLM's ``custom_class`` calling convention, without vLLM.

vLLM 0.32's model runner (``vllm/v1/worker/gpu_model_runner.py``, inherited by the CPU
runner) builds the class with the ``VllmConfig``, calls ``load_model(model)``, then after
every step ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)`` with ``token_ids_cpu`` already holding the committed tokens. A fake
runner here does the same on fixed "true" sequences: verification accepts the drafts that
equal the truth and commits one more token, as vLLM's greedy rejection sampler does, and a
fake clock charges each step by its width. tests/test_vllm_real.py checks the same class
against the installed vLLM (skipped without it).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import numpy as np
import pytest

from knapspec.integrations.vllm import KnapspecProposer
from knapspec.integrations.vllm_config import VllmProposerConfig, VllmProposerError
from knapspec.integrations.vllm_pricing import StepCostCurve, price_batch
from knapspec.request import Request

MAX_LEN = 600


def vllm_config(k: int = 8, max_model_len: int = MAX_LEN) -> SimpleNamespace:
    """The attributes of vLLM's ``VllmConfig`` the proposer reads."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="custom_class",
            model="knapspec.integrations.vllm.KnapspecProposer",
            num_speculative_tokens=k,
        ),
        model_config=SimpleNamespace(
            model="/models/fake", dtype="torch.bfloat16", max_model_len=max_model_len
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """vLLM's input batch and greedy verification over known true sequences."""

    def __init__(
        self,
        proposer: KnapspecProposer,
        clock: Clock,
        step_seconds: Callable[[int], float],
        rows: int = 4,
    ) -> None:
        self.proposer = proposer
        self.clock = clock
        self.step_seconds = step_seconds
        self.token_ids_cpu = np.zeros((rows, MAX_LEN), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(rows, dtype=np.int32)
        self.truth: list[list[int]] = []
        self.ends: list[int] = []
        self.drafts: list[list[int]] = []
        self.accepted = 0
        self.drafted = 0
        self.calls = 0

    def start(self, truths: Sequence[list[int]], prompt_lengths: Sequence[int]) -> None:
        """Admit requests (their prefill step commits the first output token)."""
        self.truth = [list(t) for t in truths]
        self.ends = [len(t) for t in truths]
        sampled = []
        for i, (truth, n) in enumerate(zip(truths, prompt_lengths, strict=True)):
            self.token_ids_cpu[i, : n + 1] = truth[: n + 1]
            self.num_tokens_no_spec[i] = n + 1
            sampled.append([truth[n]])
        self.clock.now += self.step_seconds(sum(prompt_lengths))
        self._propose(sampled)

    def _propose(self, sampled: list[list[int]]) -> None:
        self.drafts = self.proposer.propose(
            sampled, self.num_tokens_no_spec, self.token_ids_cpu, slot_mappings=None
        )
        self.calls += 1
        assert len(self.drafts) == len(sampled)
        for draft in self.drafts:
            assert len(draft) <= self.proposer.k
            assert all(isinstance(t, int) for t in draft)

    def step(self) -> bool:
        """One verify step of every live row; False when all rows are done."""
        sampled: list[list[int]] = []
        width = 0
        for i, truth in enumerate(self.truth):
            n = int(self.num_tokens_no_spec[i])
            draft = self.drafts[i] if n < self.ends[i] else []
            width += 1 + len(draft)
            accepted = 0
            while accepted < len(draft) and n + accepted < self.ends[i]:
                if draft[accepted] != truth[n + accepted]:
                    break
                accepted += 1
            committed = truth[n : min(n + accepted + 1, self.ends[i])]
            self.token_ids_cpu[i, n : n + len(committed)] = committed
            self.num_tokens_no_spec[i] = n + len(committed)
            self.accepted += accepted
            self.drafted += len(draft)
            sampled.append(committed)
        if not any(sampled):
            return False
        self.clock.now += self.step_seconds(width)
        self._propose(sampled)
        return True

    def run(self, limit: int = 10_000) -> None:
        for _ in range(limit):
            if not self.step():
                return

    def outputs(self) -> list[list[int]]:
        return [
            self.token_ids_cpu[i, : self.num_tokens_no_spec[i]].tolist()
            for i in range(len(self.truth))
        ]


def flat_cost(width: int) -> float:
    """A step whose extra tokens are nearly free (memory-bound, as bf16 on AMX)."""
    return 0.05 * (1.0 + 0.02 * (width - 1))


def compute_bound(width: int) -> float:
    """A step that costs every token in full."""
    return 0.05 * width


def make(
    *, k: int = 8, max_model_len: int = MAX_LEN, **settings: Any
) -> tuple[KnapspecProposer, Clock]:
    clock = Clock()
    config = VllmProposerConfig(cache=False, **settings)
    return KnapspecProposer(vllm_config(k, max_model_len), config, clock=clock), clock


def copying_truth(seed: int, prompt: int = 120, output: int = 120) -> list[int]:
    """A prompt of random tokens whose 'answer' quotes long spans of it."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1000, 30000) for _ in range(prompt)]
    while len(tokens) < prompt + output:
        start = rng.randrange(0, prompt - 30)
        tokens.extend(tokens[start : start + rng.randrange(10, 30)])
    return tokens[: prompt + output]


def distinct_truth(seed: int, length: int = 160) -> list[int]:
    """Nothing ever repeats: nothing to copy."""
    return random.Random(seed).sample(range(1000, 40000), length)


def test_interface_matches_vllm_custom_class() -> None:
    proposer, _ = make()
    assert callable(proposer.propose)
    proposer.load_model(object())  # the target model: unused
    drafts = proposer.propose(
        [[]], np.zeros(4, np.int32), np.zeros((4, MAX_LEN), np.int32), slot_mappings={}
    )
    assert drafts == [[]]  # a row in prefill gets no draft


def test_copying_rows_draft_and_verify_to_the_truth() -> None:
    proposer, clock = make()
    runner = FakeRunner(proposer, clock, flat_cost)
    truths = [copying_truth(seed) for seed in range(4)]
    runner.start(truths, [120] * 4)
    runner.run()
    assert runner.outputs() == truths
    assert runner.drafted > 50
    assert runner.accepted / runner.drafted > 0.5
    assert runner.calls < 4 * 120 / 2  # fewer steps than one token per row and step
    assert proposer.stats.accepted_tokens == runner.accepted
    # Drafts made for a row's last step are never verified (the request finished).
    assert proposer.stats.drafted_tokens >= runner.drafted
    assert proposer.stats.timed_steps > 10  # the curve learned from the steps


def test_nothing_to_copy_gets_gamma_zero() -> None:
    proposer, clock = make()
    runner = FakeRunner(proposer, clock, flat_cost, rows=1)
    truth = distinct_truth(0)
    runner.start([truth], [40])
    runner.run()
    assert runner.outputs() == [truth]
    assert runner.drafted == 0
    assert proposer.stats.proposed_rows == 0


def test_compute_bound_steps_are_not_drafted() -> None:
    # Every drafted token costs a full token's time: no draft with reach < 1 pays.
    proposer, clock = make()
    proposer.curve = StepCostCurve(seconds={n: compute_bound(n) for n in range(1, 40)})
    runner = FakeRunner(proposer, clock, compute_bound)
    runner.start([copying_truth(seed) for seed in range(4)], [120] * 4)
    runner.run()
    assert runner.drafted == 0


def test_fixed_pricing_drafts_whole_proposals() -> None:
    proposer, clock = make(pricing="fixed")
    runner = FakeRunner(proposer, clock, compute_bound)
    runner.start([copying_truth(1)], [120])
    runner.step()
    assert len(runner.drafts[0]) == len(proposer.rows[0].proposal) > 0  # type: ignore[union-attr]


def test_pricing_off_never_drafts() -> None:
    proposer, clock = make(pricing="off")
    runner = FakeRunner(proposer, clock, flat_cost)
    truths = [copying_truth(seed) for seed in range(2)]
    runner.start(truths, [120] * 2)
    runner.run()
    assert runner.outputs() == truths and runner.drafted == 0
    assert proposer.stats.proposed_rows > 0  # it still looked up (and learned)


def test_drafts_respect_the_cap_and_the_model_length() -> None:
    proposer, clock = make(k=3, max_model_len=124)
    runner = FakeRunner(proposer, clock, flat_cost, rows=1)
    truth = [5, 6, 7, 8] * 40
    runner.start([truth[:124]], [100])
    lengths = []
    while runner.step():
        n = int(runner.num_tokens_no_spec[0])
        assert len(runner.drafts[0]) <= max(0, 124 - n - 1)  # room for the bonus token
        lengths.append(len(runner.drafts[0]))
    assert max(lengths) == 3


def test_each_row_holds_its_request_and_drafts_within_its_limit() -> None:
    """A row's record is knapspec's Request (the prompt the proposer first saw, the limit
    the model's length sets), and its drafts are cut by that record's limit: a request
    given a smaller limit gets fewer drafts, which a cap computed from the model length
    beside the record would not give."""
    proposer, _ = make(k=8, pricing="fixed")  # fixed: γ is the whole proposal, up to the room
    sequence = [5, 6, 7, 8] * 40
    tokens = np.zeros((1, MAX_LEN), np.int32)
    tokens[0, :120] = sequence[:120]
    lengths = np.array([120], np.int32)
    drafts = proposer.propose([[sequence[119]]], lengths, tokens)
    row = proposer.rows[0]
    assert row is not None and isinstance(row.request, Request)
    assert row.request.prompt.tolist() == sequence[:120]
    assert row.request.max_new_tokens == MAX_LEN - 120 == row.remaining
    assert len(drafts[0]) == 8  # the model's length leaves room for every draft
    limited = attrs.evolve(row.request, max_new_tokens=4)
    row.request = limited
    tokens[0, 120] = sequence[120]
    lengths[0] = 121
    drafts = proposer.propose([[sequence[120]]], lengths, tokens)
    assert proposer.rows[0] is row and row.request is limited  # the row went on
    assert row.remaining == 3
    assert drafts[0] == sequence[121:123]  # 3 tokens left: 2 drafts and the step's own


def test_a_swapped_in_request_is_indexed_afresh() -> None:
    proposer, clock = make()
    runner = FakeRunner(proposer, clock, flat_cost, rows=1)
    first = copying_truth(3)
    runner.start([first], [120])
    for _ in range(5):
        runner.step()
    # vLLM puts another request of the same length in row 0 (a finished one's slot).
    second = copying_truth(4)
    n = int(runner.num_tokens_no_spec[0])
    runner.token_ids_cpu[0, :n] = second[:n]
    drafts = proposer.propose([[second[n - 1]]], runner.num_tokens_no_spec, runner.token_ids_cpu)
    row = proposer.rows[0]
    assert row is not None and row.index.tokens == second[:n]
    assert len(drafts[0]) <= 8


def test_history_copies_an_earlier_request() -> None:
    truth = distinct_truth(7, 200)
    proposer, clock = make(history_tokens=4096)
    runner = FakeRunner(proposer, clock, flat_cost, rows=1)
    runner.start([truth], [60])
    runner.run()
    assert runner.drafted == 0
    # The same request again: its output is in the history now.
    proposer.propose([], np.zeros(1, np.int32), runner.token_ids_cpu)  # the row left
    again = FakeRunner(proposer, clock, flat_cost, rows=1)
    again.start([truth], [60])
    again.run()
    assert again.drafted > 50
    assert again.accepted == again.drafted


def test_price_batch_cuts_at_the_batch_optimum() -> None:
    flat = StepCostCurve(seconds={n: 1.0 for n in range(1, 64)})
    linear = StepCostCurve(seconds={n: float(n) for n in range(1, 64)})
    reaches = [np.array([0.9, 0.8, 0.5]), np.array([]), np.array([0.2])]
    gammas, tpt, plain = price_batch(reaches, flat)
    assert gammas == [3, 0, 1] and tpt > plain
    gammas, tpt, plain = price_batch(reaches, linear)
    assert gammas == [0, 0, 0] and tpt == plain
    # A cost that rises with width: only the likeliest tokens pay.
    curve = StepCostCurve(seconds={n: 1.0 + 0.3 * (n - 1) for n in range(1, 64)})
    gammas, _, _ = price_batch([np.array([0.95, 0.9, 0.1])], curve)
    assert gammas == [2]
    assert price_batch([], flat) == ([], 0.0, 0.0)


def _price_batch_before_the_shared_order(
    reaches: Sequence[np.ndarray], curve: StepCostCurve
) -> tuple[list[int], float, float]:
    """price_batch as it was before it took its order from the batch search
    (``planners.batch.allocation.order_increments``): the oracle of the test below."""
    rows = len(reaches)
    if rows == 0:
        return [], 0.0, 0.0
    tokens = [
        (float(reach[j]), row, j)
        for row, reach in enumerate(reaches)
        for j in range(len(reach))
        if reach[j] > 0.0
    ]
    tokens.sort(key=lambda item: (-item[0], item[1], item[2]))
    gain = rows + np.concatenate(([0.0], np.cumsum([t[0] for t in tokens])))
    cost = curve.predict([rows + m for m in range(len(tokens) + 1)])
    tpt = gain / cost
    best = int(np.argmax(tpt))
    gammas = [0] * rows
    for _, row, _ in tokens[:best]:
        gammas[row] += 1
    return gammas, float(tpt[best]), float(tpt[0])


def test_price_batch_is_bitwise_the_loop_it_replaced() -> None:
    """Reusing the batch search's greedy order changed nothing: the same γs and the same
    floats, on rows with ties (a coarse grid of reaches), zeros, NaN, rows that rise
    (outside the contract) and curves flat, rising and measured."""
    rng = random.Random(66)
    grid = [0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0]
    checked = drafted = 0
    for case in range(400):
        reaches = []
        for _ in range(rng.randint(0, 6)):
            row = [rng.choice(grid) if case % 2 else rng.random() for _ in range(rng.randint(0, 8))]
            if case % 3 == 0:
                row.sort(reverse=True)
            if case % 37 == 0 and row:
                row[0] = float("nan")
            reaches.append(np.array(row, dtype=np.float32 if case % 5 == 0 else np.float64))
        slope = rng.choice([0.0, 0.02, 0.1, 0.5])
        curve = StepCostCurve(prior_slope=slope)
        for _ in range(rng.randint(0, 20)):
            curve.observe(rng.randint(1, 40), rng.uniform(0.01, 0.05))
        new, old = price_batch(reaches, curve), _price_batch_before_the_shared_order(reaches, curve)
        assert new[0] == old[0] and new[1:] == old[1:], (reaches, new, old)
        assert all(isinstance(g, int) for g in new[0])
        checked += 1
        drafted += sum(new[0]) > 0
    assert checked == 400 and drafted > 50  # the cases drafted, not only plain steps


def test_step_cost_curve_learns_interpolates_and_round_trips() -> None:
    curve = StepCostCurve(window=8, prior_slope=0.1)
    assert curve.predict([1, 3]).tolist() == pytest.approx([1.0, 1.2])  # the prior
    for _ in range(4):
        assert curve.observe(1, 0.02)
        assert curve.observe(5, 0.03)
    assert not curve.observe(5, 1.0)  # a stall, not the width's cost
    assert not curve.observe(0, 0.1) and not curve.observe(2, float("nan"))
    predicted = curve.predict([1, 3, 5, 9])
    assert predicted[1] == pytest.approx(0.025)  # between measured widths
    assert predicted[3] == pytest.approx(0.03 * 1.8 / 1.4)  # scaled past the last one
    curve.observe(7, 0.01)  # noise below a narrower width's cost
    assert np.all(np.diff(curve.predict(list(range(1, 10)))) >= 0)
    # One slow sample of a width is outvoted by many fast ones of a wider width.
    # (A median is worth at most its window of samples: 16 here.)
    skewed = StepCostCurve(seconds={1: 0.15, 17: 0.05}, counts={1: 1, 17: 19})
    pooled = (0.15 + 16 * 0.05) / 17
    assert skewed.predict([1, 17]).tolist() == pytest.approx([pooled, pooled])
    again = StepCostCurve.from_json(curve.to_json())
    assert again.seconds == curve.seconds and again.counts == curve.counts
    with pytest.raises(ValueError, match="schema"):
        StepCostCurve.from_json(json.dumps({"schema": 99, "step_seconds": {}}))


def test_step_cost_bursts_do_not_lead_the_curve() -> None:
    """Step times come with bursts of several times the usual (seen on a 2-core Zen 4:
    28 ms steps with 49, 87 and 337 ms among them); a width's cost is its recent median,
    so early bursts neither price the width nor, through the monotone pooling, every
    wider one."""
    curve = StepCostCurve(window=4)
    for width, samples in {1: [0.028] * 20, 3: [0.09, 0.11, 0.028, 0.028, 0.028]}.items():
        for seconds in samples:
            assert curve.observe(width, seconds)
    assert curve.seconds[3] == pytest.approx(0.028)  # the median of the last four
    assert curve.predict([1, 2, 3]).tolist() == pytest.approx([0.028] * 3)
    # A loaded value is one sample of its width: new samples outvote it.
    loaded = StepCostCurve.from_json(curve.to_json().replace("0.028", "0.2"), window=3)
    for seconds in (0.03, 0.03):
        loaded.observe(1, seconds)
    assert loaded.seconds[1] == pytest.approx(0.03)


def test_learned_costs_are_cached_and_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    clock = Clock()
    proposer = KnapspecProposer(vllm_config(), VllmProposerConfig(), clock=clock)
    runner = FakeRunner(proposer, clock, flat_cost, rows=2)
    runner.start([copying_truth(5), copying_truth(6)], [120, 120])
    runner.run()
    assert proposer.save_curve()
    files = list((tmp_path / "profiles").glob("vllm-fake-*.json"))
    assert len(files) == 1
    later = KnapspecProposer(vllm_config(), VllmProposerConfig(), clock=Clock())
    assert later.curve.seconds == pytest.approx(proposer.curve.seconds)
    # An explicit profile is read as it is.
    named = KnapspecProposer(
        vllm_config(), VllmProposerConfig(profile=str(files[0]), cache=False), clock=Clock()
    )
    assert named.curve.seconds == pytest.approx(proposer.curve.seconds)


def test_a_corrupt_cache_file_costs_a_warning_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    first = KnapspecProposer(vllm_config(), VllmProposerConfig(), clock=Clock())
    first.curve.observe(1, 0.05)
    assert first.save_curve()
    path = next((tmp_path / "profiles").glob("vllm-*.json"))
    path.write_text("{not json", encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        proposer = KnapspecProposer(vllm_config(), VllmProposerConfig(), clock=Clock())
    assert proposer.curve.seconds == {}


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(VllmProposerError, match="num_speculative_tokens"):
        KnapspecProposer(SimpleNamespace(speculative_config=None), VllmProposerConfig())
    with pytest.raises(VllmProposerError, match="KNAPSPEC_VLLM_PRICING"):
        VllmProposerConfig(pricing="greedy")
    with pytest.raises(VllmProposerError, match="KNAPSPEC_VLLM_HISTORY_TOKENS"):
        VllmProposerConfig.from_environment({"KNAPSPEC_VLLM_HISTORY_TOKENS": "lots"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[vllm]\nhistory = 3\n", encoding="utf-8")
    with pytest.raises(VllmProposerError, match=r"unknown .*history.*known: max_ngram"):
        VllmProposerConfig.from_environment({"KNAPSPEC_VLLM_CONFIG": str(bad)})
    with pytest.raises(VllmProposerError, match="KNAPSPEC_VLLM_PROFILE"):
        KnapspecProposer(vllm_config(), VllmProposerConfig(profile=str(tmp_path / "none.json")))
    with pytest.raises(VllmProposerError, match="cannot read"):
        VllmProposerConfig.from_environment({"KNAPSPEC_VLLM_CONFIG": str(tmp_path / "x")})


def test_config_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "knapspec-vllm.toml"
    path.write_text('[vllm]\nhistory_tokens = 8192\npricing = "fixed"\n', encoding="utf-8")
    config = VllmProposerConfig.from_environment(
        {
            "KNAPSPEC_VLLM_CONFIG": str(path),
            "KNAPSPEC_VLLM_PRICING": "tpt",
            "KNAPSPEC_VLLM_CACHE": "0",
        }
    )
    assert (config.history_tokens, config.pricing, config.cache) == (8192, "tpt", False)
    assert VllmProposerConfig.from_environment({}) == VllmProposerConfig()


def test_the_trace_records_every_call(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    proposer, clock = make(trace=str(trace))
    runner = FakeRunner(proposer, clock, flat_cost, rows=2)
    runner.start([copying_truth(8), distinct_truth(9, 240)], [120, 120])
    runner.run()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == runner.calls
    gammas = [sum(r["gamma"] for r in rec["rows"]) for rec in records]
    assert sum(gammas) == proposer.stats.drafted_tokens >= runner.drafted
    assert any(rec["measured_step_s"] for rec in records)


def test_the_core_never_imports_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, knapspec, knapspec.integrations.vllm; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
