"""The Spec-Bench report of a run directory: tables by category, our ``equal``, a plot.

Speeds follow Spec-Bench's ``evaluation/speed.py``: a question's speed is its tokens over
its wall time, both summed over its turns; a method's tokens/s is the mean of its questions'
speeds, and its speedup over a baseline the ratio of the two means, on the questions both
answered. Beside it the report gives the median and range of the per-question ratios (the
methods ran interleaved, question by question), the mean accepted tokens (``speed.py``'s
mean of ``accept_lengths``), the wall and decode-phase times, and the prefill's share of
the wall time (prefill is the same for every method and bounds every wall-time ratio).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from knapspec.bench.markdown import markdown_table
from knapspec.bench.methods import GENERATE, HF_PROMPT_LOOKUP, REFERENCE
from knapspec.bench.specbench.answers import Answer, Equality, compare_answers, read_answers
from knapspec.bench.specbench.docs import DOCS_END, DOCS_START
from knapspec.bench.specbench.questions import CATEGORIES
from knapspec.bench.specbench.runner import ANSWERS, RUN_INFO

KNAPSPEC = "knapspec"
REPORT = "report.md"
PLOT = "speedup_by_category.png"
OVERALL = "overall"


class SpecBenchReportError(ValueError):
    """A run directory without answers to report on."""


@attrs.frozen
class Row:
    """One method on one category (or ``overall``)."""

    method: str
    category: str
    questions: int
    tokens_per_second: float
    vs_generate: float | None
    vs_ar: float | None
    vs_generate_per_question: tuple[float, float, float] | None
    mean_accepted: float
    wall_seconds: float
    decode_seconds: float | None
    prefill_share: float | None
    equal_ar: Equality | None
    equal_generate: Equality | None


@attrs.frozen
class SpecBenchRunData:
    """A run directory's ``run.json`` and answers (method -> answers, in file order)."""

    run_dir: Path
    info: dict[str, Any]
    answers: dict[str, list[Answer]]

    @classmethod
    def load(cls, run_dir: Path) -> SpecBenchRunData:
        """Raises: SpecBenchReportError: no answer file in ``run_dir``."""
        info_path = run_dir / RUN_INFO
        info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
        names = [m["name"] for m in info.get("methods", [])]
        files = sorted((run_dir / ANSWERS).glob("*.jsonl"))
        names += [path.stem for path in files if path.stem not in names]
        answers = {name: read_answers(run_dir / ANSWERS / f"{name}.jsonl") for name in names}
        answers = {name: rows for name, rows in answers.items() if rows}
        if not answers:
            raise SpecBenchReportError(f"{run_dir} holds no Spec-Bench answers")
        return cls(run_dir, info, answers)

    def categories(self) -> list[str]:
        present = {a.category for rows in self.answers.values() for a in rows}
        return [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES))


def _speed(answer: Answer) -> float:
    # speed.py: sum(choices[0]['new_tokens']) / sum(choices[0]['wall_time'])
    wall = sum(turn.wall_time for turn in answer.turns)
    return sum(turn.new_tokens for turn in answer.turns) / wall if wall > 0 else 0.0


def _ratio(mine: list[Answer], theirs: list[Answer] | None) -> tuple[float | None, Any]:
    """Spec-Bench's speedup (ratio of mean speeds) and the per-question ratios' median,
    min and max, over the questions both answered."""
    if not theirs:
        return None, None
    by_key = {a.key: a for a in theirs}
    pairs = [(_speed(a), _speed(by_key[a.key])) for a in mine if a.key in by_key]
    pairs = [(x, y) for x, y in pairs if y > 0]
    if not pairs:
        return None, None
    ratio = statistics.fmean(x for x, _ in pairs) / statistics.fmean(y for _, y in pairs)
    each = [x / y for x, y in pairs]
    return ratio, (statistics.median(each), min(each), max(each))


def _row(data: SpecBenchRunData, method: str, category: str) -> Row:
    def pick(name: str) -> list[Answer] | None:
        rows = data.answers.get(name)
        if rows is None:
            return None
        return [a for a in rows if category == OVERALL or a.category == category]

    mine = pick(method) or []
    generate, plain = pick(GENERATE), pick(REFERENCE)
    vs_generate, spread = _ratio(mine, generate)
    vs_ar, _ = _ratio(mine, plain)
    turns = [turn for answer in mine for turn in answer.turns]
    accepted = [n for turn in turns for n in turn.accept_lengths]
    wall = sum(turn.wall_time for turn in turns)
    timed = all(turn.prefill_time is not None for turn in turns)
    prefill = sum(turn.prefill_time or 0.0 for turn in turns)
    return Row(
        method=method,
        category=category,
        questions=len(mine),
        tokens_per_second=statistics.fmean(_speed(a) for a in mine) if mine else 0.0,
        vs_generate=vs_generate,
        vs_ar=vs_ar,
        vs_generate_per_question=spread,
        mean_accepted=statistics.fmean(accepted) if accepted else 0.0,
        wall_seconds=wall,
        decode_seconds=wall - prefill if timed else None,
        prefill_share=prefill / wall if timed and wall > 0 else None,
        equal_ar=compare_answers(mine, plain, method, REFERENCE) if plain is not None else None,
        equal_generate=(
            compare_answers(mine, generate, method, GENERATE) if generate is not None else None
        ),
    )


def summarise(data: SpecBenchRunData) -> list[Row]:
    """One row per method and category, then per method ``overall``."""
    groups = [*data.categories(), OVERALL]
    return [_row(data, method, group) for method in data.answers for group in groups]


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _equal(equality: Equality | None) -> str:
    if equality is None or equality.compared == 0:
        return "–"
    mark = "" if equality.all_equal else " **NOT EQUAL**"
    return f"{equality.equal}/{equality.compared}{mark}"


def by_category_table(rows: Sequence[Row]) -> str:
    """Speedup over ``model.generate`` per category (rows) and method (columns)."""
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != GENERATE]
    groups = list(dict.fromkeys(r.category for r in rows))
    cell = {(r.method, r.category): r for r in rows}
    # The default decoder against transformers' prompt lookup (a goal of issue #30).
    versus = KNAPSPEC in methods and HF_PROMPT_LOOKUP in methods
    body = []
    for group in groups:
        n = max((cell[m, group].questions for m in methods if (m, group) in cell), default=0)
        line = [f"**{group}**" if group == OVERALL else group, str(n)]
        line += [_x(cell[m, group].vs_generate) if (m, group) in cell else "–" for m in methods]
        if versus:
            ours, theirs = cell[KNAPSPEC, group].vs_generate, cell[HF_PROMPT_LOOKUP, group]
            ratio = ours / theirs.vs_generate if ours and theirs.vs_generate else None
            line.append(_x(ratio))
        body.append(line)
    extra = [f"{KNAPSPEC} vs {HF_PROMPT_LOOKUP}"] if versus else []
    return markdown_table(["category", "questions", *methods, *extra], body)


def detail_table(rows: Sequence[Row]) -> str:
    """Every metric of every method and category."""
    header = [
        "method",
        "category",
        "n",
        "tokens/s",
        "vs generate",
        "per question [min-max]",
        "vs ar",
        "mean accepted",
        "wall s",
        "decode s",
        "prefill share",
        "= ar",
        "= generate",
    ]
    body = []
    for r in rows:
        spread = r.vs_generate_per_question
        body.append(
            [
                r.method,
                f"**{r.category}**" if r.category == OVERALL else r.category,
                str(r.questions),
                f"{r.tokens_per_second:.1f}",
                _x(r.vs_generate),
                "–" if spread is None else f"{spread[0]:.2f} [{spread[1]:.2f}-{spread[2]:.2f}]",
                _x(r.vs_ar),
                f"{r.mean_accepted:.2f}",
                f"{r.wall_seconds:.1f}",
                "–" if r.decode_seconds is None else f"{r.decode_seconds:.1f}",
                "–" if r.prefill_share is None else f"{100 * r.prefill_share:.1f} %",
                _equal(r.equal_ar),
                _equal(r.equal_generate),
            ]
        )
    return markdown_table(header, body)


def equality_lines(rows: Sequence[Row]) -> list[str]:
    """Our ``equal`` over all questions, with the first difference of any unequal method."""
    lines, seen = [], set()
    for r in rows:
        if r.category != OVERALL:
            continue
        for equality in (r.equal_ar, r.equal_generate):
            pair = None if equality is None else frozenset((equality.method, equality.reference))
            if equality is None or pair in seen or equality.method == equality.reference:
                continue
            seen.add(pair)
            verdict = "identical" if equality.all_equal else "DIFFERENT"
            line = (
                f"- `{r.method}` vs `{equality.reference}`: {equality.equal} of "
                f"{equality.compared} answers {verdict}"
            )
            if equality.differences:
                first = equality.differences[0]
                line += f" (first: question {first.question_id}, turn {first.turn + 1}, "
                line += f"{first.detail})"
            lines.append(line)
    return lines


def plot_by_category(rows: Sequence[Row], path: Path) -> None:
    """Grouped bars: speedup over ``model.generate`` per category and method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != GENERATE]
    groups = list(dict.fromkeys(r.category for r in rows))
    cell = {(r.method, r.category): r.vs_generate for r in rows}
    figure, axis = plt.subplots(figsize=(3.0 + 0.2 * len(groups) * max(4, len(methods)), 4.5))
    width = 0.8 / max(1, len(methods))
    for index, method in enumerate(methods):
        xs = [g + (index - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        ys = [cell.get((method, group)) or 0.0 for group in groups]
        axis.bar(xs, ys, width=width, label=method)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(groups)), groups, rotation=35, ha="right")
    axis.set_ylabel("tokens/s over model.generate's")
    axis.set_title("Spec-Bench by category")
    axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # off the bars
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _environment_lines(info: dict[str, Any]) -> list[str]:
    env = info.get("environment", {})
    settings = info.get("settings", {})
    return [
        f"- CPU: {env.get('host_cpu', env.get('device', '?'))}; bf16/AMX flags: "
        f"{', '.join(env.get('bf16_flags', [])) or 'none'} (vector flags: "
        f"{', '.join(env.get('cpu_flags', [])) or '?'}); threads: {info.get('threads', '?')}",
        f"- model {settings.get('model', '?')}, dtype {settings.get('dtype', '?')}, greedy, "
        f"batch 1, at most {settings.get('max_new_tokens', '?')} new tokens per turn; "
        + (
            "our decoders answered later turns in one conversation, keeping the KV cache "
            "(--reuse-turns)"
            if settings.get("reuse_turns")
            else "every turn prefilled the whole conversation"
        ),
        f"- torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}, "
        f"knapspec commit `{env.get('commit', '?')}`, status: {info.get('status', '?')}",
        f"- questions: `{info.get('question_file') or 'not recorded'}`",
        *(
            f"- command: `{command}`"
            for command in info.get("commands", [info.get("command")])
            if command  # a run started through the Python API records none
        ),
    ]


def render(data: SpecBenchRunData) -> str:
    """The Markdown report of one run."""
    rows = summarise(data)
    parts = [
        f"# Spec-Bench: {data.run_dir.name}",
        "",
        *_environment_lines(data.info),
        "",
        "## Speedup over `model.generate` by category",
        "",
        "Spec-Bench's `speed.py` definition: the mean of the questions' tokens/s over the "
        "baseline's, on the questions both answered; wall time, prefill included.",
        "",
        by_category_table(rows),
        "",
        f"![speedup by category]({PLOT})",
        "",
        "## Losslessness (our `equal`: token ids per turn)",
        "",
        *equality_lines(rows),
        "",
        "## Every metric",
        "",
        "`per question`: median [min-max] of the per-question speed ratios against "
        "`model.generate` (the methods ran interleaved, question by question). `decode s`: "
        "wall time after the prefill (for `model.generate`, after its first forward).",
        "",
        detail_table(rows),
        "",
        "Spec-Bench's own scripts read the answer files in `model_answer/` unchanged. From "
        'a checkout of Spec-Bench: `python -c "from evaluation.speed import '
        "get_single_speedup; get_single_speedup('RUN/model_answer/knapspec.jsonl', "
        "'RUN/model_answer/generate.jsonl', 'MODEL_DIR')\"` (its command line always runs "
        "`get_mean_speedup()` on the authors' hard-coded paths: `--mean-report` is a "
        "`store_true` flag that defaults to true) and `python evaluation/equal.py "
        "--file-path RUN/model_answer/ --jsonfile1 ar.jsonl --jsonfile2 knapspec.jsonl`, "
        "`RUN` this directory and `MODEL_DIR` the model's (`knapspec` caches it under "
        "`~/.cache/knapspec/models/`). (`speed.py` counts the baseline's tokens by "
        "re-tokenising its answers minus one for a BOS token; SmolLM2's tokenizer adds none, "
        "so its baseline speeds are about one token per turn low.)",
        "",
    ]
    return "\n".join(parts)


def write_report(run_dir: Path) -> Path:
    """Write ``report.md`` and the plot into ``run_dir``; returns the report's path.

    Raises:
        SpecBenchReportError: no answers in ``run_dir``.
    """
    data = SpecBenchRunData.load(run_dir)
    plot_by_category(summarise(data), run_dir / PLOT)
    path = run_dir / REPORT
    path.write_text(render(data), encoding="utf-8")
    return path


def docs_section(runs: Sequence[SpecBenchRunData], docs: Path, reproduce: str) -> str:
    """The Spec-Bench section of ``docs/benchmarks.md``: how to reproduce, then each run's
    table by category."""
    import os

    parts = [
        DOCS_START,
        "## Spec-Bench",
        "",
        "Spec-Bench (Xia et al., ACL 2024 Findings): MT-bench (two turns), WMT14 translation, "
        "CNN/DM summarization, Natural Questions, GSM8K and RAG, greedy, batch 1. "
        "`knapspec bench spec-bench` writes one answer file per method in Spec-Bench's format "
        "(its `evaluation/speed.py` and `equal.py` read them) and a report by category. "
        "The goal run (the development split shipped in `knapspec/data/spec_bench/`, 5 "
        "questions per category, 256 new tokens per turn, fp32) on a quiet machine:",
        "",
        "```bash",
        reproduce,
        "```",
        "",
        "It runs `model.generate`, plain decoding through our engine (`ar`), the default "
        "decoder (`knapspec`) and transformers' prompt lookup (`hf-prompt-lookup`, k = 10), "
        "105 turns each (about two hours on 2 cores); an interrupted run resumes when the "
        "command is repeated. Without `--methods`, KnapSpec with the lookup drafter only "
        "(`knapspec-lookup-only`) and with layer skipping only (`knapspec-no-lookup`) run "
        "too (`--list` names every method). bfloat16: the same with `--dtype bfloat16 --output-dir "
        "results/bench/spec-bench-bf16 --no-stop-on-mismatch` (the report then counts the "
        "answers that differ from plain decoding instead of stopping at the first). "
        "`knapspec bench spec-bench report RUN_DIR [RUN_DIR ...] --docs docs/benchmarks.md` "
        "rewrites this section from the runs' answer files; `knapspec bench report --docs` "
        "keeps it.",
        "",
    ]
    for data in runs:
        rows = summarise(data)
        link = os.path.relpath((data.run_dir / REPORT).resolve(), docs.parent.resolve())
        note = data.run_dir / "NOTE.md"  # what the numbers mean, written beside the run
        noted = []
        if note.exists():
            title = note.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
            target = os.path.relpath(note.resolve(), docs.parent.resolve())
            noted = [f"**{title}**: see [its note]({target}).", ""]
        parts += [
            f"### `{data.run_dir.name}` ([report]({link}))",
            "",
            *noted,
            *_environment_lines(data.info),
            "",
            by_category_table(rows),
            "",
            *equality_lines(rows),
            "",
        ]
    parts.append(DOCS_END)
    return "\n".join(parts)


__all__ = [
    "PLOT",
    "REPORT",
    "Row",
    "SpecBenchReportError",
    "SpecBenchRunData",
    "by_category_table",
    "detail_table",
    "docs_section",
    "plot_by_category",
    "render",
    "summarise",
    "write_report",
]
