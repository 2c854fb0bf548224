"""The bench's throughput scenario on a tiny random Llama (seconds): batches of B prompts
through transformers' batched ``model.generate``, our batched plain decoding and our
batched speculation; records, the losslessness check per row, and the report's table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import test_bench
from knapspec.bench import (
    LosslessnessError,
    MethodSpec,
    ReportError,
    Scenario,
    cli_main,
    default_methods,
    run_benchmark,
    write_report,
)
from knapspec.bench.methods import HF_PROMPT_LOOKUP, lookup_methods
from knapspec.bench.report import RunData, summarise_throughput, throughput_table
from knapspec.bench.scenarios import SAMPLING, THROUGHPUT_METHODS, default_scenarios
from knapspec.bench.throughput import left_padded, until_eos
from knapspec.config import DecoderConfig
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine

tiny = test_bench.tiny  # the tiny random Llama and word-level tokenizer fixture

BATCHES = (1, 2, 3)
THROUGHPUT = Scenario(
    "tiny-batch", "summarise", (24,), 6, batch_sizes=BATCHES, methods=THROUGHPUT_METHODS
)


def _method(name: str) -> MethodSpec:
    return next(m for m in (*default_methods(), *lookup_methods()) if m.name == name)


def _options(tmp_path: Path, methods: tuple[MethodSpec, ...]) -> Any:
    return test_bench._options(
        tmp_path, methods, scenarios=(THROUGHPUT,), oracle=None, vcurve=False
    )


def test_throughput_scenario_records_every_batch_and_the_report_renders_it(
    tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = tiny
    # static and hf-prompt-lookup are not the scenario's: neither runs in it.
    methods = tuple(_method(n) for n in ("ar", "generate", "knapspec", "static", HF_PROMPT_LOOKUP))
    options = _options(tmp_path, methods)
    run_dir = run_benchmark(model, tokenizer, options)

    assert not (run_dir / "raw.jsonl").exists()  # no single-prompt scenario ran
    lines = [json.loads(line) for line in (run_dir / "throughput.jsonl").read_text().splitlines()]
    calls = {(r["batch_size"], r["pair"], r["method"]) for r in lines}
    expected = {(b, p, m) for b in BATCHES for p in range(2) for m in THROUGHPUT_METHODS}
    assert calls == expected and len(lines) == len(expected)
    for row in lines:
        assert len(row["prompt_ids"]) == len(row["prompt_tokens"]) == row["batch_size"]
        assert len(set(row["prompt_ids"])) == row["batch_size"]
        assert row["new_tokens"] == sum(row["row_new_tokens"]) > 0
        assert all(0 < n <= 6 for n in row["row_new_tokens"])
        assert row["seconds"] > 0
        assert row["tokens_per_second"] == pytest.approx(row["new_tokens"] / row["seconds"])
        assert row["env"]["threads"] == 1 and row["env"]["device"]  # the CPU, named
        assert "kernel_table" in row["env"] and "commit" in row["env"]
        if row["method"] == "generate":
            assert row["lossless"] is None and row["drafted_tokens"] == 0
            assert 0 <= row["rows_equal"] <= row["batch_size"]
        else:
            assert row["lossless"] is True and row["rows_equal"] == row["batch_size"]
    # Same prompts, same greedy rows: every engine call of a batch size made the same tokens.
    for batch in BATCHES:
        counts = {
            tuple(r["row_new_tokens"])
            for r in lines
            if r["batch_size"] == batch and r["method"] != "generate"
        }
        assert len(counts) == 1
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "completed"
    assert info["scenarios"][0]["batch_sizes"] == list(BATCHES)

    text = write_report(run_dir).read_text()
    assert "## Throughput: batches of prompts" in text
    assert "Speed, acceptance and time split" not in text  # no single-prompt calls
    assert f"*Machine: {lines[0]['env']['device']}, 1 threads" in text
    table = throughput_table(RunData.load(run_dir))
    body = table.splitlines()[2:]
    assert len(body) == len(BATCHES) * len(THROUGHPUT_METHODS)
    for row in summarise_throughput(RunData.load(run_dir)):
        assert row.calls == 2 and row.tokens_per_second is not None
        assert (row.vs_generate is None) == (row.method == "generate")
        assert (row.vs_plain is None) == (row.method == "ar")


def _call(method: str, pair: int, tokens_per_second: float, batch: int = 4) -> dict[str, Any]:
    return {
        "scenario": "throughput",
        "context": 2048,
        "batch_size": batch,
        "method": method,
        "pair": pair,
        "prompt_tokens": [2000] * batch,
        "new_tokens": 100,
        "tokens_per_second": tokens_per_second,
        "rows_equal": batch if method != "generate" else batch - 1,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
    }


def test_throughput_ratios_divide_each_call_by_its_own_round() -> None:
    calls = [
        _call("generate", 0, 10.0),
        _call("ar", 0, 15.0),
        _call("knapspec", 0, 30.0),
        _call("generate", 1, 20.0),
        _call("ar", 1, 20.0),
        _call("knapspec", 1, 22.0),
    ]
    data = RunData(Path("run"), {}, [], [], [], [], calls)
    rows = {row.method: row for row in summarise_throughput(data)}
    spec = rows["knapspec"]
    assert spec.vs_generate is not None and spec.vs_plain is not None
    # Round 0: 30/10, 30/15; round 1: 22/20, 22/20.
    assert (spec.vs_generate.low, spec.vs_generate.high) == pytest.approx((1.1, 3.0))
    assert (spec.vs_plain.low, spec.vs_plain.high) == pytest.approx((1.1, 2.0))
    assert rows["ar"].vs_generate is not None
    assert rows["ar"].vs_generate.median == pytest.approx(1.25)
    assert rows["generate"].rows_equal == 6 and rows["generate"].rows == 8
    assert "| throughput | 2048 | 4 | knapspec | 100 |" in throughput_table(data)


def test_the_decode_phase_ratio_divides_each_round_after_its_prefills() -> None:
    def timed(method: str, pair: int, seconds: float, prefill: float | None) -> dict[str, Any]:
        call = _call(method, pair, 100 / seconds)
        return {**call, "seconds": seconds, "prefill_seconds": prefill}

    calls = [
        timed("generate", 0, 40.0, None),
        timed("ar", 0, 24.0, 15.0),  # decode 9 s
        timed("knapspec", 0, 21.0, 15.0),  # decode 6 s: 1.5x
        timed("ar", 1, 25.0, 15.0),  # decode 10 s
        timed("knapspec", 1, 23.0, 15.0),  # decode 8 s: 1.25x
    ]
    data = RunData(Path("run"), {}, [], [], [], [], calls)
    rows = {row.method: row for row in summarise_throughput(data)}
    decode = rows["knapspec"].decode_vs_plain
    assert decode is not None and (decode.low, decode.high) == pytest.approx((1.25, 1.5))
    share = rows["ar"].prefill_share
    assert share is not None and share.median == pytest.approx((15 / 24 + 15 / 25) / 2)
    assert rows["generate"].decode_vs_plain is None and rows["ar"].decode_vs_plain is None
    table = throughput_table(data)
    assert "1.38 [1.25-1.50]" in table and "61 %" in table
    # Records from before prefills were timed: no decode-phase figures, no error.
    old = RunData(
        Path("run"), {}, [], [], [], [], [_call("ar", 0, 10.0), _call("knapspec", 0, 12.0)]
    )
    assert {row.decode_vs_plain for row in summarise_throughput(old)} == {None}


class _CorruptingBatchDecoder:
    """A real decoder whose batched output has one token of its last row changed."""

    def __init__(self, engine: SublayerEngine, config: DecoderConfig) -> None:
        self.inner = SpeculativeDecoder.from_config(engine, config)
        self.engine = engine

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        result = self.inner.generate(input_ids, **kwargs)
        if not isinstance(input_ids, list):
            return result
        tokens = [t.clone() for t in result.tokens]
        tokens[-1][-1] = (tokens[-1][-1] + 1) % self.engine.vocab_size
        return attrs.evolve(result, tokens=tokens)


def test_a_batched_method_that_changes_a_row_fails_the_run(
    tiny: tuple[Any, Any], tmp_path: Path
) -> None:
    model, tokenizer = tiny
    broken = MethodSpec(
        "knapspec", {"planner": {"name": "autoregressive"}}, factory=_CorruptingBatchDecoder
    )
    options = _options(tmp_path, (_method("ar"), broken))
    with pytest.raises(LosslessnessError, match=r"'knapspec' in the batch of 2 .*row 1"):
        run_benchmark(model, tokenizer, options)
    assert json.loads((options.run_dir / "run.json").read_text())["status"] == "failed"
    with pytest.raises(ReportError, match="losslessness"):
        write_report(options.run_dir)


def test_a_throughput_scenario_is_greedy_with_positive_batch_sizes() -> None:
    with pytest.raises(ValueError, match="greedy"):
        Scenario("t", "summarise", (24,), 6, SAMPLING, batch_sizes=(2,))
    with pytest.raises(ValueError, match="batch_sizes"):
        Scenario("t", "summarise", (24,), 6, batch_sizes=(0, 2))
    full = {s.name: s for s in default_scenarios()}["throughput"]
    assert full.batch_sizes == (1, 4, 8) and full.contexts == (2048,) and full.greedy
    assert full.methods == ("generate", "ar", "knapspec")


def test_padding_and_eos_cuts_match_what_model_generate_expects() -> None:
    ids, mask = left_padded([torch.tensor([5, 6, 7]), torch.tensor([8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert until_eos([3, 2, 9, 2], [2]) == [3, 2]
    assert until_eos([3, 4], None) == [3, 4]


def test_cli_lists_the_batch_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["run", "--list"]) == 0
    assert "scenario throughput:" in capsys.readouterr().out
    assert cli_main(["run", "--list", "--quick"]) == 0
    assert "B = (1, 4)" in capsys.readouterr().out
