"""Spec-Bench (``knapspec bench spec-bench``) on a tiny random Llama: answer files that
Spec-Bench's own scripts read, our ``equal``, resume, the CLI end to end; the real model on
one question per category in the slow tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from knapspec.bench.methods import MethodSpec, select_methods
from knapspec.bench.records import LosslessnessError
from knapspec.bench.specbench import (
    CATEGORIES,
    Answer,
    QuestionFileError,
    SpecBenchOptions,
    SpecBenchRunData,
    Turn,
    answer_path,
    compare_answers,
    load_questions,
    packaged_questions,
    read_answers,
    run_spec_bench,
    select_questions,
    write_report,
)
from knapspec.bench.specbench.answers import append_answer, drop_partial_line
from knapspec.bench.specbench.calls import commits_after_prefill, generate_call
from knapspec.bench.specbench.cli import spec_bench_methods
from knapspec.bench.specbench.docs import DOCS_START, replace_section
from knapspec.bench.specbench.report import summarise
from knapspec.cli import main as knapspec_main
from knapspec.config import DecoderConfig

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "then", "it", ".", ","]
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["the cat sat", "and then the dog"]},
    {"question_id": 83, "category": "writing", "turns": ["a dog ran far", "then it sat"]},
    {"question_id": 161, "category": "translation", "turns": ["the mat , the cat ."]},
    {"question_id": 163, "category": "translation", "turns": ["it ran on the mat"]},
]
METHODS = ["generate", "ar", "knapspec", "hf-prompt-lookup", "lookup-k3"]
BASE = DecoderConfig.from_dict({"max_draft_length": 3})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 4-layer random Llama with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["[UNK]", "[EOS]", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(model_dir: Path) -> tuple[Any, Any]:
    from knapspec.model.loading.provision import load_model_and_tokenizer

    return load_model_and_tokenizer(str(model_dir), progress=False)


@pytest.fixture
def question_file(tmp_path: Path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS), encoding="utf-8")
    return path


def _options(out: Path, questions: Path, methods: list[str], **changes: Any) -> SpecBenchOptions:
    every = load_questions(questions)
    options = SpecBenchOptions(
        questions=select_questions(every, per_category=1),
        methods=select_methods(spec_bench_methods(), methods),
        output_dir=out,
        max_new_tokens=8,
        threads=1,
        base_config=BASE,
        warmup_tokens=2,
        progress=False,
        question_order=tuple(q.key for q in every),
    )
    return attrs.evolve(options, **changes)


def _answer(qid: int, ids: list[list[int]], method: str = "ar") -> Answer:
    turns = [
        Turn(" ".join(map(str, t)), len(t), 0.5, max(0, len(t) - 1), [1] * (len(t) - 1), 0.1, 7, t)
        for t in ids
    ]
    return Answer(qid, "writing", f"tiny-{method}-float32-temp-0.0", method, turns)


def test_packaged_dev_split_and_its_licence_ship() -> None:
    questions = load_questions(packaged_questions())
    assert len(questions) == 240
    assert {q.category for q in questions} == set(CATEGORIES)
    assert all(len(q.turns) == 2 for q in questions if q.category == "writing")
    assert "Apache" in (packaged_questions().parent / "LICENSE").read_text()
    chosen = select_questions(questions, ["writing", "qa"], per_category=2)
    assert [q.category for q in chosen] == ["writing", "writing", "qa", "qa"]
    with pytest.raises(QuestionFileError, match="no question of category"):
        select_questions(questions, ["poetry"])


def test_answer_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ar.jsonl"
    answers = [_answer(81, [[3, 4, 5], [6, 7]]), _answer(161, [[8, 9, 10, 11]])]
    for answer in answers:
        append_answer(path, answer)
    assert read_answers(path) == answers
    line = json.loads(path.read_text().splitlines()[0])
    assert set(line) >= {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
    choice = line["choices"][0]
    assert set(choice) == {
        "index",
        "turns",
        "decoding_steps",
        "new_tokens",
        "wall_time",
        "accept_lengths",
    }
    assert choice["new_tokens"] == [3, 2] and choice["decoding_steps"] == [2, 1]
    assert choice["accept_lengths"] == [1, 1, 1]  # flat over the turns, as eval.py writes it
    # An interrupted write leaves half a line: it is cut, and the answers before it stay.
    with path.open("a") as handle:
        handle.write('{"question_id": 99, "categ')
    assert read_answers(path) == answers
    assert drop_partial_line(path) and path.read_text().endswith("}\n")


def test_equal_catches_one_changed_token() -> None:
    reference = [_answer(81, [[3, 4, 5], [6, 7]]), _answer(83, [[5, 5]])]
    same = compare_answers(reference, reference, "knapspec", "ar")
    assert same.all_equal and same.compared == 2
    changed = [_answer(81, [[3, 4, 5], [6, 8]]), _answer(83, [[5, 5]])]
    result = compare_answers(changed, reference, "knapspec", "ar")
    assert not result.all_equal and result.equal == 1
    (difference,) = result.differences
    assert (difference.question_id, difference.turn, difference.position) == ("81", 1, 1)


def test_commits_after_prefill() -> None:
    # Plain decoding: prefill of 13 tokens, then one token per call, 12 new tokens.
    assert commits_after_prefill([0, *range(13, 24)], 25) == [1] * 11
    # Prompt lookup: the call at 14 verified candidates, and the next starts at 17.
    assert commits_after_prefill([0, 13, 14, 17], 20) == [1, 3, 2]
    assert commits_after_prefill([0], 14) == []


def test_generate_call_counts_prompt_lookup_rounds(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    prompt = torch.tensor([2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4])
    for extra in ({}, {"prompt_lookup_num_tokens": 3}):
        result = generate_call(model, prompt, 10, extra)
        assert sum(result.accept_lengths) == result.new_tokens - 1
        assert result.decoding_steps == len(result.accept_lengths)
        assert 0 < result.prefill_time <= result.wall_time


def _spec_bench_speed(path: Path, base: Path, tokenizer: Any) -> tuple[float, float, float]:
    """Spec-Bench's ``evaluation/speed.py`` (``speed()``, repository hemingkx/Spec-Bench),
    reading the files with exactly its access pattern (quoted in the comments)."""
    # for datapoint in data:
    #     tokens=sum(datapoint["choices"][0]['new_tokens'])
    #     times = sum(datapoint["choices"][0]['wall_time'])
    #     accept_lengths_list.extend(datapoint["choices"][0]['accept_lengths'])
    #     speeds.append(tokens/times)
    # ... and for the baseline's file:
    #     answer=datapoint["choices"][0]['turns']
    #     for i in answer:
    #         tokens += (len(tokenizer(i).input_ids) - 1)
    #     times = sum(datapoint["choices"][0]['wall_time'])
    # ... and: print("#Mean accepted tokens: ", np.mean(accept_lengths_list))
    speeds, accept_lengths_list = [], []
    for line in path.open(encoding="utf-8"):
        datapoint = json.loads(line)
        tokens = sum(datapoint["choices"][0]["new_tokens"])
        times = sum(datapoint["choices"][0]["wall_time"])
        accept_lengths_list.extend(datapoint["choices"][0]["accept_lengths"])
        speeds.append(tokens / times)
    speeds0 = []
    for line in base.open(encoding="utf-8"):
        datapoint = json.loads(line)
        answer = datapoint["choices"][0]["turns"]
        tokens = 0
        for i in answer:
            tokens += len(tokenizer(i).input_ids) - 1
        times = sum(datapoint["choices"][0]["wall_time"])
        speeds0.append(tokens / times)
    mean_accepted = float(np.mean(accept_lengths_list))
    return float(np.array(speeds).mean()), float(np.array(speeds0).mean()), mean_accepted


def _spec_bench_equal(path1: Path, path2: Path) -> bool:
    """Spec-Bench's ``evaluation/equal.py``: ``get_content`` writes
    ``str(datapoint["choices"][0]['turns'])`` per line, ``txt_compare`` compares the two
    files' lines with ``zip``."""
    lines = [
        [str(json.loads(line)["choices"][0]["turns"]) + "\n" for line in path.open()]
        for path in (path1, path2)
    ]
    return all(a == b for a, b in zip(*lines, strict=False))


def test_cli_runs_two_questions_end_to_end(
    model_dir: Path, question_file: Path, tmp_path: Path, tiny: tuple[Any, Any]
) -> None:
    out = tmp_path / "run"
    common = ["--model", str(model_dir), "--questions", str(question_file), "--max-new-tokens"]
    args = [*common, "6", "--per-category", "1", "--threads", "1", "--output-dir", str(out)]
    args += ["--warmup-tokens", "2", "--no-progress", "--set", "max_draft_length=3"]
    assert knapspec_main(["bench", "spec-bench", *args, "--methods", *METHODS]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "completed" and info["environment"]["host_cpu"]
    assert "bf16_flags" in info["environment"]
    for method in METHODS:
        answers = read_answers(answer_path(out, method))
        assert [(a.question_id, a.category) for a in answers] == [
            (81, "writing"),
            (161, "translation"),
        ]
        assert [len(a.turns) for a in answers] == [2, 1]  # MT-bench: two turns
        assert all(t.output_ids is not None and t.prefill_time for a in answers for t in a.turns)
    # Turn 2 was asked after the method's own first answer, in one conversation.
    plain = read_answers(answer_path(out, "ar"))[0]
    first = plain.turns[0]
    assert plain.turns[1].prompt_tokens is not None and first.prompt_tokens is not None
    assert plain.turns[1].prompt_tokens > first.prompt_tokens + first.new_tokens
    # Spec-Bench's scripts read our files unchanged.
    _, tokenizer = tiny
    knapspec_file, generate_file = answer_path(out, "knapspec"), answer_path(out, "generate")
    speed, base, accepted = _spec_bench_speed(knapspec_file, generate_file, tokenizer)
    assert speed > 0 and base > 0 and accepted >= 1.0
    assert _spec_bench_equal(answer_path(out, "ar"), knapspec_file)
    # The report: by category, losslessness, the plot, the CPU and versions.
    report = (out / "report.md").read_text()
    assert (out / "speedup_by_category.png").stat().st_size > 0
    for needle in ("writing", "translation", "overall", "bf16/AMX flags", "torch", "= ar"):
        assert needle in report
    assert "NOT EQUAL" not in report
    rows = summarise(SpecBenchRunData.load(out))
    overall = {r.method: r for r in rows if r.category == "overall"}
    assert overall["knapspec"].equal_ar is not None and overall["knapspec"].equal_ar.all_equal
    assert overall["ar"].vs_generate is not None and overall["generate"].mean_accepted == 1.0
    # The docs section is written between its markers, and replaced on the next write.
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nother runs\n")
    assert knapspec_main(["bench", "spec-bench", "report", str(out), "--docs", str(docs)]) == 0
    assert knapspec_main(["bench", "spec-bench", "report", str(out), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert text.count(DOCS_START) == 1 and text.startswith("# Benchmarks\n\nother runs\n")
    assert replace_section(text, "X") == "# Benchmarks\n\nother runs\n\nX\n"


def test_bench_report_docs_keep_the_spec_bench_section(tmp_path: Path) -> None:
    from knapspec.bench import RunData, write_docs

    docs = tmp_path / "benchmarks.md"
    section = f"{DOCS_START}\n## Spec-Bench\n<!-- spec-bench:end -->"
    docs.write_text(f"# Old\n\n{section}\n")
    write_docs([RunData.load(Path(__file__).parents[1] / "results/bench/confirm")], docs)
    text = docs.read_text()
    assert "# Old" not in text and text.count(section) == 1


class _Interrupting:
    """Plain decoding that raises KeyboardInterrupt on its ``after``-th call."""

    def __init__(self, decoder: Any, after: int) -> None:
        self.decoder, self.after, self.calls = decoder, after, 0

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.after:
            raise KeyboardInterrupt
        return self.decoder.generate(*args, **kwargs)


class _Terminated(_Interrupting):
    """Plain decoding that sends its own process SIGTERM on its ``after``-th call (what
    ``timeout`` or a scheduler does)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.after:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return self.decoder.generate(*args, **kwargs)


def test_sigterm_ends_a_run_as_ctrl_c_does(
    tiny: tuple[Any, Any], question_file: Path, tmp_path: Path
) -> None:
    import signal

    from knapspec.decoding.decoder import SpeculativeDecoder

    model, tokenizer = tiny
    out = tmp_path / "run"
    terminated = MethodSpec(
        "lookup-k3",
        {"planner": {"name": "lookup", "draft_length": 3}},
        factory=lambda engine, config: _Terminated(
            SpeculativeDecoder.from_config(engine, config), after=4
        ),
    )
    options = _options(out, question_file, ["ar"])
    options = attrs.evolve(options, methods=(*options.methods, terminated))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        run_spec_bench(model, tokenizer, options)
    info = json.loads((out / "run.json").read_text())
    assert info["status"] == "interrupted" and "SIGTERM" in info["error"]
    assert [a.key for a in read_answers(answer_path(out, "lookup-k3"))] == ["81"]  # kept
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def test_resume_skips_answered_questions(
    tiny: tuple[Any, Any], question_file: Path, tmp_path: Path
) -> None:
    from knapspec.decoding.decoder import SpeculativeDecoder

    model, tokenizer = tiny
    out = tmp_path / "run"
    first = _options(out, question_file, ["ar", "knapspec"])
    run_spec_bench(model, tokenizer, first)
    before = {m: read_answers(answer_path(out, m)) for m in ("ar", "knapspec")}
    assert [a.key for a in before["ar"]] == ["81", "161"]
    # Two per category now, and an interruption in the middle of the new questions
    # (lookup-k3's call 1 warms up, 2-5 answer 81 and 83 (two turns each), 6 is 161's).
    interrupting = MethodSpec(
        "lookup-k3",
        {"planner": {"name": "lookup", "draft_length": 3}},
        factory=lambda engine, config: _Interrupting(
            SpeculativeDecoder.from_config(engine, config), after=6
        ),
    )
    every = select_questions(load_questions(question_file), per_category=2)
    second = attrs.evolve(first, questions=every, methods=(*first.methods, interrupting))
    with pytest.raises(KeyboardInterrupt):
        run_spec_bench(model, tokenizer, second)
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    partial = read_answers(answer_path(out, "lookup-k3"))
    assert [a.key for a in partial] == ["81", "83"]  # written before the interrupt: kept
    # The rerun answers only what is missing: the earlier answers stay as they were.
    third = attrs.evolve(second, methods=select_methods(spec_bench_methods(), ["ar", "lookup-k3"]))
    run_spec_bench(model, tokenizer, third)
    after = read_answers(answer_path(out, "ar"))
    assert [a.key for a in after] == ["81", "83", "161", "163"]  # question-file order
    kept = {a.key: a.answer_id for a in after}
    assert all(kept[a.key] == a.answer_id for a in before["ar"])
    completed = read_answers(answer_path(out, "lookup-k3"))
    assert [a.key for a in completed] == ["81", "83", "161", "163"]
    assert [a.answer_id for a in completed[:2]] == [a.answer_id for a in partial]
    # Another dtype or length would mix incomparable answers: refused.
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_spec_bench(model, tokenizer, attrs.evolve(third, max_new_tokens=9))
    # So would timings on another thread count (or another CPU).
    with pytest.raises(ValueError, match="threads"):
        run_spec_bench(model, tokenizer, attrs.evolve(third, threads=third.threads + 1))
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert settings["device"] and settings["cpu_flags_digest"] and settings["threads"]


class _OffByOne:
    """A decoder that changes the last token of every answer (a lossy 'speedup')."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        result = self.decoder.generate(*args, **kwargs)
        tokens = result.tokens.clone()
        tokens[-1] = (int(tokens[-1]) + 1) % 10
        return attrs.evolve(result, tokens=tokens)


def test_a_lossy_decoder_stops_the_run(
    tiny: tuple[Any, Any], question_file: Path, tmp_path: Path
) -> None:
    from knapspec.decoding.decoder import SpeculativeDecoder

    model, tokenizer = tiny
    lossy = MethodSpec(
        "lossy",
        {"planner": {"name": "autoregressive"}},
        factory=lambda engine, config: _OffByOne(SpeculativeDecoder.from_config(engine, config)),
    )
    options = _options(tmp_path / "run", question_file, ["ar"])
    options = attrs.evolve(options, methods=(*options.methods, lossy))
    with pytest.raises(LosslessnessError, match="lossy"):
        run_spec_bench(model, tokenizer, options)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"
    assert not answer_path(tmp_path / "run", "lossy").exists()
    # Told not to stop (bfloat16), the run goes on and the report marks the answers.
    going_on = attrs.evolve(options, output_dir=tmp_path / "on", stop_on_mismatch=False)
    run_spec_bench(model, tokenizer, going_on)
    rows = summarise(SpecBenchRunData.load(tmp_path / "on"))
    (lossy_row,) = [r for r in rows if r.method == "lossy" and r.category == "overall"]
    assert lossy_row.equal_ar is not None and lossy_row.equal_ar.equal == 0
    assert "NOT EQUAL" in write_report(tmp_path / "on").read_text()


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_one_question_per_category(tmp_path: Path) -> None:
    from knapspec.model.loading.provision import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(progress=False)
    methods = ["generate", "ar", "knapspec", "hf-prompt-lookup"]
    options = SpecBenchOptions(
        questions=select_questions(load_questions(packaged_questions()), per_category=1),
        methods=select_methods(spec_bench_methods(), methods),
        output_dir=tmp_path,
        max_new_tokens=16,
        threads=2,
        warmup_tokens=4,
        progress=False,
    )
    run_spec_bench(model, tokenizer, options)
    data = SpecBenchRunData.load(tmp_path)
    assert len(data.categories()) == len(CATEGORIES)
    for row in summarise(data):
        if row.category == "overall":
            assert row.questions == len(CATEGORIES)
            assert row.equal_ar is not None and row.equal_ar.all_equal, row.method
            assert row.equal_generate is not None and row.equal_generate.all_equal, row.method


def test_reused_turns_prefill_only_the_new_tokens_and_answer_the_same(
    tiny: tuple[Any, Any], question_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reuse_turns``: MT-bench's turn 2 resumes turn 1's cache (a prefill that starts past
    0 and is wider than any verification), and every answer is the cold run's."""
    from knapspec.model.engine import SublayerEngine

    model, tokenizer = tiny
    # One unrecorded run first: on an empty cache the decoder's first build measures this
    # machine (latency profile: verifications at position 128 of every width), and those
    # forwards are not the run's.
    run_spec_bench(model, tokenizer, _options(tmp_path / "warm", question_file, ["ar", "knapspec"]))
    calls: list[tuple[int, int]] = []
    forward = SublayerEngine.forward

    def recording(self: SublayerEngine, token_ids: Any, start: int, *args: Any, **kw: Any) -> Any:
        calls.append((start, int(token_ids.numel())))
        return forward(self, token_ids, start, *args, **kw)

    monkeypatch.setattr(SublayerEngine, "forward", recording)
    widest_verify = BASE.max_draft_length + 1
    answers = {}
    for reuse in (False, True):
        calls.clear()
        out = tmp_path / f"reuse-{reuse}"
        run_spec_bench(
            model, tokenizer, _options(out, question_file, ["ar", "knapspec"], reuse_turns=reuse)
        )
        resumed = [(s, n) for s, n in calls if s > 0 and n > widest_verify]
        assert bool(resumed) == reuse, resumed
        answers[reuse] = {m: read_answers(answer_path(out, m)) for m in ("ar", "knapspec")}
        assert json.loads((out / "run.json").read_text())["settings"]["reuse_turns"] == reuse
    for method in ("ar", "knapspec"):
        cold, warm = answers[False][method], answers[True][method]
        assert [t.output_ids for a in cold for t in a.turns] == [
            t.output_ids for a in warm for t in a.turns
        ]
