"""The benchmark harness on a tiny random Llama (seconds): results, report, losslessness."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knapspec.bench import (
    BenchOptions,
    LosslessnessError,
    MethodSpec,
    OracleOptions,
    ReportError,
    Scenario,
    cli_main,
    default_methods,
    method_config,
    run_benchmark,
    select_methods,
    write_docs,
    write_report,
)
from knapspec.bench.oracle import expected_tokens_from_runs
from knapspec.bench.report import RunData, comparable_calls
from knapspec.bench.report.pages import NOTES, render_docs
from knapspec.bench.scenarios import SAMPLING
from knapspec.config import DecoderConfig
from knapspec.decoding.decoder import GenerationResult, SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.testing import tiny_llama

WORDS = [
    "the",
    "a",
    "and",
    "of",
    "to",
    "in",
    "was",
    "her",
    "she",
    "he",
    "it",
    "that",
    "not",
    "be",
    "had",
    "for",
    "with",
    "as",
    "his",
    "on",
    ",",
    ".",
    ";",
]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    """A 3-layer random Llama and a word-level tokenizer over common English words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["[UNK]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, unk_token="[UNK]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
    # Sharp logits (head_scale): no greedy ties between implementations.
    model = tiny_llama(3, vocab_size=len(vocab), head_scale=8.0)
    return model, tokenizer


SCENARIO = Scenario("tiny", "summarise", (24,), 6, description="tiny")
STATIC = MethodSpec(
    "static-2",
    {"planner": {"name": "static", "skipped_items": [1], "draft_length": 2}},
    description="skips item 1, drafts 2",
)


def _options(tmp_path: Path, methods: tuple[MethodSpec, ...], **changes: Any) -> BenchOptions:
    options = BenchOptions(
        scenarios=(SCENARIO,),
        methods=methods,
        prompts=1,
        pairs=2,
        threads=1,
        output_dir=tmp_path,
        run_name="smoke",
        base_config=DecoderConfig.from_dict({"max_draft_length": 2}),
        oracle=OracleOptions(max_draft_length=2, sizes=(1, 2), repeats=1, calibration_tokens=2),
        vcurve_repeats=1,
        warmup_tokens=2,
        progress=False,
    )
    return attrs.evolve(options, **changes)


def _reference() -> MethodSpec:
    return next(m for m in default_methods() if m.name == "ar")


def test_harness_writes_raw_results_and_report(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny
    generate = next(m for m in default_methods() if m.name == "generate")
    sampled = Scenario("tiny-sampled", "summarise", (24,), 6, SAMPLING)
    options = _options(tmp_path, (_reference(), generate, STATIC), scenarios=(SCENARIO, sampled))
    run_dir = run_benchmark(model, tokenizer, options)

    rows = [json.loads(line) for line in (run_dir / "raw.jsonl").read_text().splitlines()]
    methods = [row["method"] for row in rows if row["scenario"] == "tiny"]
    # Per pair round: AR, m1, AR, m2, AR -> 2 method calls and 3 AR calls; 2 rounds.
    assert methods.count("generate") == methods.count("static-2") == 2
    assert methods.count("ar") == 6
    for row in rows:
        for key in ("new_tokens", "wall_time", "accept_lengths", "decoding_steps", "env", "plans"):
            assert key in row, key
        assert row["env"]["threads"] == 1
        assert sum(row["accept_lengths"]) == row["new_tokens"] - 1  # first: prefill
    greedy_methods = [r for r in rows if r["scenario"] == "tiny" and r["role"] == "method"]
    assert all(r["lossless"] is True and r["speedup_vs_ar"] > 0 for r in greedy_methods)
    static_rows = [r for r in rows if r["method"] == "static-2"]
    assert all(r["plans"][0]["skipped_items"] == [1] for r in static_rows)
    assert all(r["lossless"] is None for r in rows if r["scenario"] == "tiny-sampled")

    oracle = [json.loads(line) for line in (run_dir / "oracle.jsonl").read_text().splitlines()]
    assert {o["scenario"] for o in oracle} == {"tiny", "tiny-sampled"}
    assert all(o["speedup"] >= 1.0 and len(o["verify_seconds"]) == 3 for o in oracle)
    assert {c["family"] for c in oracle[0]["candidates"]} == {
        "attention",
        "mlp",
        "layers",
        "greedy",
    }
    vcurves = [json.loads(line) for line in (run_dir / "vcurve.jsonl").read_text().splitlines()]
    assert {v["backend"] for v in vcurves} == {"engine", "engine-f.linear", "hf-dynamic-cache"}

    docs = tmp_path / "docs" / "benchmarks.md"
    report = write_report(run_dir, docs)
    text = report.read_text()
    assert "static-2" in text and "Oracle frontier" in text and "v(k)" in text
    assert (run_dir / "speedup_vs_context.png").stat().st_size > 0
    assert (run_dir / "vk_curves.png").stat().st_size > 0
    assert "../smoke/speedup_vs_context.png" in docs.read_text()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"


def test_docs_from_several_runs_compare_them_and_keep_each_report(
    tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = tiny
    run_dirs = [
        run_benchmark(
            model,
            tokenizer,
            _options(tmp_path, (_reference(), STATIC), run_name=name, oracle=None, vcurve=False),
        )
        for name in ("first", "second")
    ]
    docs = tmp_path / "docs" / "benchmarks.md"
    assert cli_main(["report", *map(str, run_dirs), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert all((run_dir / "report.md").exists() for run_dir in run_dirs)
    # Each run's report is a section, its headings one level down, its plots linked.
    assert "## Run `first`" in text and "## Run `second`" in text
    assert text.count("### Speed, acceptance and time split") == 2
    assert "../first/speedup_vs_context.png" in text and "../second/speedup_vs_context.png" in text
    # The across-runs row pools every call: 2 pair rounds per run.
    ratios = [
        row["speedup_vs_ar"]
        for run_dir in run_dirs
        for row in map(json.loads, (run_dir / "raw.jsonl").read_text().splitlines())
        if row["method"] == "static-2"
    ]
    assert len(ratios) == 4
    pooled = f"{np.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}] (4)"
    across = text.split("## Across runs: speedup vs AR")[1].split("## Run `first`")[0]
    static_rows = [line for line in across.splitlines() if "static-2" in line]
    assert len(static_rows) == 1 and static_rows[0].endswith(f"| {pooled} |")
    assert "| `first` | `second` |" in across
    assert "- `static-2`: skips item 1, drafts 2" in text  # the methods, described
    # No model.generate in these runs: no engine-vs-generate table. A title of one's own.
    assert "vs `model.generate`" not in text
    runs = [RunData.load(run_dir) for run_dir in run_dirs]
    titled = write_docs(runs, tmp_path / "ablations.md", title="Ablations").read_text()
    assert titled.startswith("# Ablations\n") and "--title Ablations" in titled
    # One run renders exactly as write_report's docs did: the run's report, no comparison.
    single = tmp_path / "single.md"
    write_docs([RunData.load(run_dirs[0])], single)
    assert "Across runs" not in single.read_text()
    assert single.read_text().endswith(
        (run_dirs[0] / "report.md")
        .read_text()
        .split("# Benchmark report\n\n", 1)[1]
        .replace("](speedup", "](first/speedup")
    )


def test_demoting_headings_leaves_code_blocks_alone() -> None:
    from knapspec.bench.report import demote_headings as _demoted

    text = "# Title\n## Part\n```\n# a shell comment\n```\ntext # not a heading"
    assert _demoted(text) == (
        "## Title\n### Part\n```\n# a shell comment\n```\ntext # not a heading"
    )


def test_pooling_leaves_out_sampled_calls_that_stopped_short() -> None:
    sampled = {"do_sample": True, "temperature": 0.7}
    greedy = {"do_sample": False}
    raw = [
        {"scenario": "s", "context": 8, "method": "ar", "new_tokens": 6, "sampling": sampled},
        {"scenario": "s", "context": 8, "method": "m", "new_tokens": 2, "sampling": sampled},
        {"scenario": "s", "context": 16, "method": "m", "new_tokens": 3, "sampling": sampled},
        {"scenario": "g", "context": 8, "method": "ar", "new_tokens": 6, "sampling": greedy},
        {"scenario": "g", "context": 8, "method": "m", "new_tokens": 4, "sampling": greedy},
    ]
    data = RunData(Path("run"), {}, raw, [], [], [])
    kept = comparable_calls(data)
    # The 2-token sampled call is out; a greedy call that stopped at EOS stays (every greedy
    # method stops at the same token), as does the longest call of another length.
    assert kept == [raw[0], raw[2], raw[3], raw[4]]


def test_sampled_calls_run_to_full_length_and_greedy_calls_stop_at_eos(
    tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    """Sampled methods draw different texts; an early EOS in one of them would compare a
    prefill-dominated time with full-length ones, so sampled calls never stop early."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    vocab = model.config.vocab_size
    model.generation_config.eos_token_id = list(range(0, vocab, 2))  # half the vocabulary
    generate = next(m for m in default_methods() if m.name == "generate")
    sampled = Scenario("tiny-sampled", "summarise", (24,), 6, SAMPLING)
    options = _options(
        tmp_path,
        (_reference(), generate, STATIC),
        scenarios=(SCENARIO, sampled),
        oracle=None,
        vcurve=False,
    )
    rows = [
        json.loads(line)
        for line in (run_benchmark(model, tokenizer, options) / "raw.jsonl")
        .read_text()
        .splitlines()
    ]
    sampled_rows = [r for r in rows if r["scenario"] == "tiny-sampled"]
    greedy_rows = [r for r in rows if r["scenario"] == "tiny"]
    assert sampled_rows and all(r["new_tokens"] == 6 for r in sampled_rows)
    # Greedy: every method stops where AR does, at its first even-numbered token.
    assert len({r["new_tokens"] for r in greedy_rows}) == 1
    assert greedy_rows[0]["new_tokens"] < 6


class _CorruptingDecoder:
    """Wraps a real decoder and changes one generated token: a deliberately broken method."""

    def __init__(self, engine: SublayerEngine, config: DecoderConfig) -> None:
        self.inner = SpeculativeDecoder.from_config(engine, config)
        self.vocab = engine.vocab_size

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> GenerationResult:
        result = self.inner.generate(input_ids, **kwargs)
        tokens = result.tokens.clone()
        tokens[-1] = (tokens[-1] + 1) % self.vocab
        return attrs.evolve(result, tokens=tokens)


def test_broken_method_fails_the_run_loudly(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny
    broken = MethodSpec(
        "broken", {"planner": {"name": "autoregressive"}}, factory=_CorruptingDecoder
    )
    options = _options(tmp_path, (_reference(), broken), oracle=None, vcurve=False)
    with pytest.raises(LosslessnessError, match="broken"):
        run_benchmark(model, tokenizer, options)
    run_dir = options.run_dir
    assert not (run_dir / "raw.jsonl").exists() and (run_dir / "raw.failed.jsonl").exists()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    with pytest.raises(ReportError, match="losslessness"):
        write_report(run_dir)


def test_existing_results_are_not_overwritten(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    model, tokenizer = tiny
    options = _options(tmp_path, (_reference(),), oracle=None, vcurve=False, pairs=1)
    run_benchmark(model, tokenizer, options)
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_benchmark(model, tokenizer, options)
    run_benchmark(model, tokenizer, attrs.evolve(options, overwrite=True))


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=3))
def test_expected_tokens_match_a_brute_force_round_count(rows: list[list[bool]]) -> None:
    width = min(len(row) for row in rows)
    agreement = np.array([row[:width] for row in rows], dtype=bool)
    max_draft = 4
    expected = expected_tokens_from_runs(agreement, max_draft)
    for b in range(agreement.shape[0]):
        for gamma in range(max_draft + 1):
            committed = []
            for start in range(width):
                accepted = 0
                while (
                    accepted < gamma and start + accepted < width and agreement[b, start + accepted]
                ):
                    accepted += 1
                committed.append(accepted + 1)
            assert expected[b, gamma] == pytest.approx(np.mean(committed))


def test_method_config_merges_same_component_and_replaces_another() -> None:
    base = DecoderConfig.from_dict(
        {"planner": {"name": "knapsack", "tau": 0.6}, "max_draft_length": 6}
    )
    same = method_config(base, {"planner": {"name": "knapsack", "decoupled": False}})
    assert same.planner.params.tau == 0.6 and same.planner.params.decoupled is False
    other = method_config(base, {"planner": {"name": "static", "draft_length": 3}})
    assert other.planner.name == "static" and other.max_draft_length == 6


def test_unknown_method_is_named_and_reference_always_runs() -> None:
    with pytest.raises(ValueError, match=r"nope.*valid: generate, ar"):
        select_methods(default_methods(), ["nope"])
    assert [m.name for m in select_methods(default_methods(), ["knapspec"])] == ["ar", "knapspec"]


def test_cli_report_of_missing_run_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["report", str(tmp_path / "absent")]) == 1
    assert "no such run directory" in capsys.readouterr().err
    assert cli_main(["--list"]) == 0
    assert "method knapspec-tied" in capsys.readouterr().out


def test_agreement_growth_adds_the_unit_that_keeps_the_most_agreement() -> None:
    from knapspec.bench.oracle import grow_by_agreement, teacher_forced_agreement
    from knapspec.planners import AutoregressivePlanner
    from knapspec.types import SublayerMask
    from test_dp import tiny_engine

    engine = tiny_engine(3, seed=1)
    prompt = torch.randint(0, engine.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    # The model's own greedy continuation, so that agreement differs between masks.
    decoder = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    continuation = decoder.generate(prompt, max_new_tokens=9).tokens
    cache = engine.new_cache(32)
    engine.forward(torch.cat([prompt, continuation[:-1]]), 0, cache, all_logits=False)
    units = [(item,) for item in range(engine.num_items)]
    order = grow_by_agreement(engine, cache, continuation, 10, units, 3, chunk=4)
    assert [len(skipped) for skipped in order] == [1, 2, 3]
    assert all(set(a) < set(b) for a, b in itertools.pairwise(order))
    previous: tuple[int, ...] = ()
    for chosen in order:  # brute force: no other single addition agrees more often
        options = [previous + unit for unit in units if unit[0] not in previous]
        masks = [SublayerMask.from_skipped(engine.num_layers, option) for option in options]
        rates = teacher_forced_agreement(engine, cache, masks, continuation, 10, 4).float()
        best = float(rates.mean(dim=1).max())
        mine = (
            teacher_forced_agreement(
                engine,
                cache,
                [SublayerMask.from_skipped(engine.num_layers, chosen)],
                continuation,
                10,
                4,
            )
            .float()
            .mean()
        )
        assert float(mine) == pytest.approx(best)
        previous = chosen


def _raw_call(method: str, role: str, wall: float, **fields: Any) -> dict[str, Any]:
    """One ``raw.jsonl`` call of scenario ``s`` at N = 8, prompt 0, with extra ``fields``."""
    return {
        "scenario": "s",
        "context": 8,
        "prompt_id": 0,
        "method": method,
        "role": role,
        "wall_time": wall,
        **fields,
    }


def test_decode_phase_table_compares_each_call_past_its_prefill() -> None:
    from knapspec.bench.drafter_report import decode_phase_table

    def call(method: str, role: str, wall: float, prefill: float) -> dict[str, Any]:
        return _raw_call(method, role, wall, prefill_seconds=prefill)

    raw = [
        call("ar", "reference", 10.0, 4.0),
        call("m", "method", 5.0, 4.0),  # decode 1 s against plain 6 s and 8 s
        call("ar", "reference", 12.0, 4.0),
        call("generate", "method", 9.0, 0.0),  # prefill not timed apart: left out
        call("ar", "reference", 12.0, 4.0),
    ]
    table = decode_phase_table(RunData(Path("run"), {}, raw, [], [], []))
    rows = [line for line in table.splitlines()[2:]]
    assert rows == ["| s | 8 | m | 7.00 [7.00-7.00] | 33% | 3.00 |"]


def test_the_lookup_oracle_share_compares_decode_phase_with_decode_phase() -> None:
    """The lookup oracle replays the decode phase only, so KnapSpec's share of it uses
    KnapSpec's decode-phase speedup, not its wall-time speedup (which pays the prefill)."""
    from knapspec.bench.drafter_report import lookup_oracle_table

    def call(method: str, role: str, wall: float, speedup: float | None) -> dict[str, Any]:
        return _raw_call(method, role, wall, prefill_seconds=4.0, speedup_vs_ar=speedup)

    raw = [
        call("ar", "reference", 12.0, None),
        call("knapspec", "method", 8.0, 1.5),  # decode 4 s against plain 8 s: 2.0x
        call("ar", "reference", 12.0, None),
    ]
    oracle = [{"scenario": "s", "context": 8, "context_length": 9, "speedup": 2.5, "lookup": []}]
    table = lookup_oracle_table(RunData(Path("run"), {}, raw, [], oracle, []))
    row = table.splitlines()[2].split(" | ")
    assert row[-3:] == ["1.50", "2.00", "80% |"]  # 2.0 / 2.5, not 1.5 / 2.5


def test_the_hand_written_notes_beside_the_runs_open_the_generated_page(tmp_path: Path) -> None:
    """``NOTES.md`` in the runs' folder goes above the generated tables, and survives every
    regeneration (the README's lab narrative lives there)."""
    root = Path(__file__).resolve().parents[1] / "results" / "bench"
    runs = [shutil.copytree(root / name, tmp_path / "bench" / name) for name in _SMALL_RUNS]
    docs = tmp_path / "docs" / "benchmarks.md"
    plain = render_docs([RunData.load(run) for run in runs], docs)
    assert "## What the runs say" not in plain
    (tmp_path / "bench" / NOTES).write_text("B = 4 gave 1.19x on that CPU.\n", encoding="utf-8")
    noted = render_docs([RunData.load(run) for run in runs], docs)
    section = noted.index("## What the runs say\n\nB = 4 gave 1.19x on that CPU.")
    assert section < noted.index("## Run `")
    assert noted.replace("## What the runs say\n\nB = 4 gave 1.19x on that CPU.\n\n", "") == plain


#: Two small committed runs (throughput only) for report tests that need real files.
_SMALL_RUNS = ("throughput-b4", "throughput-split")
