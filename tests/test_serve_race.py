"""The bookkeeping of the serving race (``knapspec.bench.race``, ``benchmarks/serve_race.py``):
no question asked twice in one server process, the systems' order rotating, repeats
summarised as median and min-max, latency and prefix-cache counters read right. Unit level:
no server, no vLLM."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
from benchmarks.serve_race import QUESTIONS, SeenGuard, first_turns
from hypothesis import given
from hypothesis import strategies as st

from knapspec.bench.race import (
    chunk_gaps,
    latency_summary,
    paired_ratios,
    percentile,
    plan_slices,
    prefix_cache_counts,
    race_report,
    rotation,
    spread,
    summarise_race,
)


@given(
    count=st.integers(32, 60),
    duplicated=st.integers(0, 10),
    sizes=st.lists(st.integers(0, 5), min_size=1, max_size=6),
    reserve=st.integers(0, 2),
    seed=st.integers(0, 5),
)
def test_slices_never_repeat_a_question(
    count: int, duplicated: int, sizes: list[int], reserve: int, seed: int
) -> None:
    base = [f"question {i}" for i in range(count)]
    questions = base + base[:duplicated]  # a file may hold a text twice
    reserved, slices = plan_slices(questions, sizes, reserve=reserve, seed=seed)
    assert len(reserved) == reserve
    assert [len(s) for s in slices] == sizes
    asked = reserved + [q for s in slices for q in s]
    assert max(Counter(asked).values(), default=1) == 1  # no question twice, across passes too
    assert set(asked) <= set(questions)
    # The same arguments give the same slices (every system and repeat asks alike).
    assert plan_slices(questions, sizes, reserve=reserve, seed=seed) == (reserved, slices)


def test_slices_refuse_a_set_too_small_to_stay_cold() -> None:
    questions = ["a", "b", "c", "a"]  # three distinct
    assert len({q for s in plan_slices(questions, [1, 2], reserve=0)[1] for q in s}) == 3
    with pytest.raises(ValueError, match="distinct questions"):
        plan_slices(questions, [1, 2], reserve=1)
    with pytest.raises(ValueError, match=">= 0"):
        plan_slices(questions, [-1])


def test_the_default_race_fits_the_question_set_and_mixes_categories() -> None:
    turns = first_turns()
    # 2 modes x C = 1, 4, 16 at --per-client 4 (16, 16, 64) plus the warm-up.
    warmup, slices = plan_slices(turns, [16, 16, 64] * 2, reserve=1)
    assert len({q for s in slices for q in s} | set(warmup)) == 1 + 2 * 96
    # The file is grouped by category: a shuffled slice of 16 spans several of them.
    lines = [json.loads(x) for x in QUESTIONS.read_text().splitlines() if x.strip()]
    category = {line["turns"][0]: line["category"] for line in lines}
    assert len({category[q] for q in slices[0]}) >= 4
    with pytest.raises(ValueError):
        plan_slices(turns, [len(turns)], reserve=1)


def test_the_guard_refuses_a_question_seen_by_the_process() -> None:
    guard = SeenGuard()
    guard.take(["a", "b"])
    guard.take(["c"])
    with pytest.raises(RuntimeError, match="repeat"):
        guard.take(["d", "a"])
    with pytest.raises(RuntimeError, match="repeat"):
        guard.take(["e", "e"])


def test_rotation_puts_each_system_first_once_per_cycle() -> None:
    systems = ["knapspec", "knapspec-ar", "vllm"]
    orders = [rotation(systems, r) for r in range(3)]
    assert [o[0] for o in orders] == systems
    assert all(sorted(o) == sorted(systems) for o in orders)
    assert rotation(systems, 3) == systems
    assert rotation([], 2) == []


def test_chunk_gaps_divide_by_the_tokens_of_the_later_chunk() -> None:
    gaps, per_token = chunk_gaps([0.0, 0.1, 0.4, 0.5], [1, 1, 3, 0])
    assert gaps == pytest.approx([0.1, 0.3, 0.1])
    assert per_token == pytest.approx([0.1, 0.1, 0.1])  # 0.3 over 3 tokens; 0 counts as 1
    assert chunk_gaps([1.0], [2]) == ([], [])
    with pytest.raises(ValueError):
        chunk_gaps([0.0, 1.0], [1])


def test_percentiles_and_latency_summary() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0  # nearest rank of 100 values
    assert percentile(values, 0.99) == 99.0
    assert percentile([math.nan, 2.0], 0.5) == 2.0
    assert percentile([], 0.5) is None
    summary = latency_summary([1.0, 2.0, 3.0], values, [0.5])
    assert summary["ttft_p50_s"] == 2.0
    assert summary["gap_p95_s"] == 95.0
    assert summary["token_gap_p99_s"] == 0.5
    assert len(summary) == 9


def test_prefix_cache_counts_read_knapspec_and_vllm_counters() -> None:
    knapspec = {"knapspec_prompt_tokens_total": 200.0, "knapspec_cached_prompt_tokens_total": 50.0}
    assert prefix_cache_counts(knapspec)["prefix_cache_hit_rate"] == 0.25
    vllm = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}
    assert prefix_cache_counts(vllm)["prefix_cache_hit_tokens"] == 10.0
    assert prefix_cache_counts({})["prefix_cache_hit_rate"] is None


def test_repeats_are_summarised_as_median_and_range_per_system() -> None:
    records = [
        {"pass": "cold", "mode": "greedy", "concurrency": 4, "system": s, "output_tokens_per_s": v}
        for s, values in (("a", [10.0, 30.0, 20.0]), ("b", [5.0, 7.0, 6.0]))
        for v in values
    ]
    rows = {r["system"]: r for r in summarise_race(records, ["output_tokens_per_s"])}
    assert rows["a"]["output_tokens_per_s"] == {"median": 20.0, "min": 10.0, "max": 30.0, "n": 3}
    assert rows["b"]["repeats"] == 3
    assert spread([None, 1.0]) == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}
    lines = [{"kind": "summary", "run": "r1", **row} for row in summarise_race(records)]
    table = race_report(lines)
    assert "| a | 4 | 20.0 (10.0-30.0) |" in table
    assert "| b | 4 | 6.0 (5.0-7.0) |" in table


@given(
    count=st.integers(20, 40),
    duplicated=st.integers(0, 8),
    groups=st.lists(st.sampled_from(["qa", "rag", "copy"]), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=3),
)
def test_vllm_proposer_levels_never_share_a_prompt(
    count: int, duplicated: int, groups: list[str], sizes: list[int]
) -> None:
    from benchmarks.vllm_proposer import level_slices, round_robin

    ids = [[i, i + 1] for i in range(count)] + [[i, i + 1] for i in range(duplicated)]
    named = [(f"{groups[i % len(groups)]}-{i}", x) for i, x in enumerate(ids)]
    levels = [1, 4, 16][: len(sizes)]
    warm, by_level = level_slices(round_robin(named), sizes, levels)
    sent = [tuple(warm[1])] + [tuple(x) for level in levels for _, x in by_level[level]]
    assert len(sent) == len(set(sent)) == 1 + sum(sizes)
    assert [len(by_level[level]) for level in levels] == sizes
    with pytest.raises(SystemExit):
        level_slices(round_robin(named), [count], [1])  # the warm-up too: one short


def test_ratios_pair_systems_within_each_repeat() -> None:
    def line(system: str, repeat: int, rate: float) -> dict[str, object]:
        return {
            "pass": "cold",
            "mode": "greedy",
            "concurrency": 16,
            "repeat": repeat,
            "system": system,
            "output_tokens_per_s": rate,
        }

    # Repeat 1 ran slower for everyone: paired within the repeat, the ratio holds.
    records = [
        line("knapspec", 0, 150.0),
        line("knapspec-ar", 0, 125.0),
        line("vllm", 0, 100.0),
        line("knapspec", 1, 75.0),
        line("knapspec-ar", 1, 60.0),
        line("vllm", 1, 50.0),
        line("knapspec", 2, 120.0),  # vLLM missing in repeat 2: no pair there
    ]
    rows = {r["ratio"]: r for r in paired_ratios(records)}
    assert rows["knapspec / vllm"]["value"] == {"median": 1.5, "min": 1.5, "max": 1.5, "n": 2}
    assert rows["knapspec-ar / vllm"]["value"]["median"] == pytest.approx(1.225)
    assert rows["knapspec / knapspec-ar"]["value"]["n"] == 2
    assert "knapspec / vllm-ngram" not in rows
    lines = [{"kind": "ratio", "run": "r", **row} for row in paired_ratios(records)]
    summary = [{"kind": "summary", "run": "r", **row} for row in summarise_race(records)]
    assert "| cold, greedy | 16 | knapspec / vllm |" in race_report(summary + lines)


def test_the_vllm_build_is_read_from_the_given_interpreter(tmp_path: Path) -> None:
    import sys

    from knapspec.bench.env import vllm_build

    build = vllm_build(sys.executable)  # no vLLM here: torch's capability alone
    assert build["torch"].startswith("2.") and build["torch_cpu_capability"]
    assert "distribution" not in build
    assert "error" in vllm_build(tmp_path / "no-python")
