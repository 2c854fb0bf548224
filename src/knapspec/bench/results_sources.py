"""Readers of the raw result lines in ``results/``: each turns one benchmark's files into
:class:`Figure` rows (one configuration's values at one commit on one CPU class and dtype)
for the generated page ``docs/results.md`` (:mod:`knapspec.bench.results_page`).

Like against like, by construction: a ratio pairs two records of the same commit, CPU,
prompt and pair index that produced the same number of new tokens (a prompt at whose end
the model stops at once is a prefill, not a decode, and is left out, counted in
``dropped``); the reference of each ratio is named in the row.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from knapspec.bench.race import paired_ratios

#: CPU classes in the page's order.
CPU_CLASSES = (
    "Intel Xeon with AMX",
    "AMD Zen 4",
    "AMD Zen 3 / AVX2",
    "other",
    "CPU flags not recorded",
)


@attrs.frozen
class Figure:
    """One configuration of one benchmark: its values (per pair or per repeat).

    Attributes:
        benchmark: the benchmark's name (a file family or a run directory).
        setting: what was measured and against what (``long-2048: default exact / generate
            float32``).
        values: ``(n,)`` ratios or rates, one per pair, prompt or repeat.
        unit: ``x`` (a ratio) or ``tok/s``.
    """

    benchmark: str
    cpu: str
    dtype: str
    commit: str
    setting: str
    values: tuple[float, ...]
    unit: str
    command: str
    source: str
    dropped: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.values)


def cpu_class(record: Mapping[str, Any]) -> str:
    """The CPU class of a results line from its ``host_cpu`` and ``cpu_flags``."""
    name = str(record.get("host_cpu", ""))
    flags = set(record.get("cpu_flags") or ())
    if not flags:  # runs from before the flags were recorded: the class is unknown
        return "CPU flags not recorded"
    if "amx_bf16" in flags or "amx_tile" in flags:
        return "Intel Xeon with AMX"
    if "AMD" in name and "avx512f" in flags:
        return "AMD Zen 4"
    if "AMD" in name and "avx2" in flags:
        return "AMD Zen 3 / AVX2"
    return "other"


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def latest_commit(records: Sequence[Mapping[str, Any]]) -> str:
    """The commit of the last record (results files are appended to)."""
    return str(records[-1].get("commit", "?"))


def _groups(
    records: Iterable[dict[str, Any]], key: Any
) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        out.setdefault(key(record), []).append(record)
    return out


def exactness_cost(root: Path) -> Iterator[Figure]:
    """``benchmarks/exactness_cost.py``: each knapspec method's tokens/s over each
    ``model.generate``'s at the same prompt, per prompt set."""
    for path in sorted((root / "exactness").glob("cost*.jsonl")):
        records = read_lines(path)
        by_machine = _groups(records, lambda r: (cpu_class(r), r["dtype"]))
        for (cpu, dtype), group in by_machine.items():
            commit = latest_commit(group)
            group = [r for r in group if r["commit"] == commit]
            references = sorted(
                {
                    r["method"]
                    for r in group
                    if r["method"].startswith(("generate", "model.generate"))
                }
            )
            methods = [m for m in dict.fromkeys(r["method"] for r in group) if m not in references]
            for prompt_set in dict.fromkeys(str(r.get("prompt_set", "")) for r in group):
                rows = [r for r in group if str(r.get("prompt_set", "")) == prompt_set]
                for reference in references:
                    for method in methods:
                        values, dropped = _paired(rows, method, reference, "prompt")
                        if values:
                            yield Figure(
                                f"exactness cost ({path.name})",
                                cpu,
                                dtype,
                                commit,
                                f"{prompt_set or 'prompts'}: {method} / {reference}",
                                tuple(values),
                                "x",
                                str(rows[0].get("command", "")),
                                str(path.relative_to(root.parent)),
                                dropped,
                            )


def _is_generate(method: str) -> bool:
    return method.startswith(("generate", "model.generate"))


def _paired(
    rows: Sequence[Mapping[str, Any]], method: str, reference: str, key: str
) -> tuple[list[float], int]:
    """Tokens/s ratios of ``method`` over ``reference`` per ``key`` value (the i-th of each
    with the i-th of the other), kept only where both made the same, full, number of new
    tokens; (ratios, pairs dropped)."""
    full = max(int(r["new_tokens"]) for r in rows)
    mine = _groups((dict(r) for r in rows if r["method"] == method), lambda r: (r[key],))
    theirs = _groups((dict(r) for r in rows if r["method"] == reference), lambda r: (r[key],))
    values, dropped = [], 0
    for prompt, own in mine.items():
        for a, b in zip(own, theirs.get(prompt, []), strict=False):
            if a["new_tokens"] != b["new_tokens"] or a["new_tokens"] != full:
                dropped += 1
                continue
            values.append(b["wall_time_s"] / a["wall_time_s"])
    return values, dropped


def engine_vs_generate(root: Path) -> Iterator[Figure]:
    """``benchmarks/engine_vs_generate.py``: the plain engine (and, where recorded, the
    default decoder) over ``model.generate``, per model, CPU class and dtype."""
    for path in sorted((root / "engine").glob("engine_vs_generate*.jsonl")):
        records = read_lines(path)
        keyed = _groups(records, lambda r: (r.get("model", "?"), cpu_class(r), r["dtype"]))
        for (model, cpu, dtype), group in keyed.items():
            commit = latest_commit(group)
            group = [r for r in group if r["commit"] == commit]
            by_context = _groups(
                group, lambda r, own=dtype: (r["context"], r.get("generate_dtype", own))
            )
            for (context, generate_dtype), rows in by_context.items():
                against = f"model.generate {generate_dtype}"
                systems = [("speedup", "plain engine")]
                if all("default_speedup" in r for r in rows):
                    systems.append(("default_speedup", "default decoder"))
                for key, system in systems:
                    yield Figure(
                        "engine vs generate",
                        cpu,
                        dtype,
                        commit,
                        f"{model}, ~{context} prompt tokens: {system} / {against}",
                        tuple(r[key] for r in rows),
                        "x",
                        f"python benchmarks/engine_vs_generate.py --model {model}"
                        if path.name != "engine_vs_generate.jsonl"
                        else "python benchmarks/engine_vs_generate.py",
                        str(path.relative_to(root.parent)),
                    )
            yield from _engine_rates(path, root, model, cpu, dtype, commit, group)


def _engine_rates(
    path: Path,
    root: Path,
    model: str,
    cpu: str,
    dtype: str,
    commit: str,
    group: Sequence[dict[str, Any]],
) -> Iterator[Figure]:
    """Tokens per second of each system in ``engine_vs_generate`` lines (prefill
    included), per context: what a reader sets beside llama.cpp's rates. Calls that made
    fewer than the run's full count of new tokens are left out (counted)."""
    for context, rows in _groups(group, lambda r: (r["context"],)).items():
        full = max(int(r["new_tokens"]) for r in rows)
        systems: dict[str, list[float]] = {}
        dropped = 0
        engine_pairs: set[Any] = set()  # a pair's engine calls are on each of its lines
        for r in rows:
            if int(r["new_tokens"]) != full or int(r.get("generate_new_tokens", full)) != full:
                dropped += 1
                continue
            if r["pair"] not in engine_pairs:
                engine_pairs.add(r["pair"])
                systems.setdefault("plain engine", []).append(full / r["engine_s"])
                if "default_s" in r:
                    systems.setdefault("default decoder", []).append(full / r["default_s"])
            generate = f"model.generate {r.get('generate_dtype', dtype)}"
            systems.setdefault(generate, []).append(full / r["generate_s"])
        for system, values in systems.items():
            yield Figure(
                "engine vs generate, rates",
                cpu,
                dtype,
                commit,
                f"{model}, ~{context[0]} prompt tokens: {system}, {full} new tokens",
                tuple(values),
                "tok/s",
                f"python benchmarks/engine_vs_generate.py --model {model}",
                str(path.relative_to(root.parent)),
                dropped,
            )


def llamacpp_runs(root: Path) -> Iterator[Figure]:
    """``benchmarks/llamacpp_gguf.py``: llama.cpp's tokens per second (prefill included)
    on a GGUF, per model, CPU class and context, at the latest commit; the dtype column is
    the GGUF's weight format. Calls that stopped early are left out (counted)."""
    for path in sorted((root / "engine").glob("llamacpp-*.jsonl")):
        records = read_lines(path)
        keyed = _groups(records, lambda r: (r.get("model", "?"), cpu_class(r)))
        for (model, cpu), group in keyed.items():
            commit = latest_commit(group)
            group = [r for r in group if r["commit"] == commit]
            weights = Path(str(group[0]["gguf"])).stem.rsplit("-", 1)[-1].upper()
            for context, rows in _groups(group, lambda r: (r["context"],)).items():
                full = max(int(r["new_tokens"]) for r in rows)
                kept = [r for r in rows if int(r["new_tokens"]) == full]
                extra = "" if rows[0].get("extra_buffer_types", True) else ", extra buffers off"
                yield Figure(
                    "llama.cpp",
                    cpu,
                    f"GGUF {weights}",
                    commit,
                    f"{model}, ~{context[0]} prompt tokens: llama-cpp-python "
                    f"{rows[0].get('llama_cpp_python', '?')}, {full} new tokens{extra}",
                    tuple(full / r["seconds"] for r in kept),
                    "tok/s",
                    "python benchmarks/llamacpp_gguf.py time ... (see its docstring)",
                    str(path.relative_to(root.parent)),
                    len(rows) - len(kept),
                )


def bench_runs(root: Path) -> Iterator[Figure]:
    """``knapspec bench run`` directories: each method's speed over plain decoding (its
    reference) per scenario and context, lossless rows only; a run not completed is left
    out."""
    for run_file in sorted((root / "bench").glob("*/run.json")):
        run = json.loads(run_file.read_text(encoding="utf-8"))
        raw = run_file.parent / "raw.jsonl"
        if run.get("status") != "completed" or not raw.exists():
            continue
        env = run.get("environment", {})
        rows = [r for r in read_lines(raw) if r.get("speedup_vs_ar") is not None]
        keyed = _groups(rows, lambda r: (r["scenario"], r["context"], r["method"]))
        for (scenario, context, method), group in keyed.items():
            kept = [r for r in group if r.get("lossless") is not False]
            if not kept:
                continue
            yield Figure(
                f"bench run {run_file.parent.name}",
                cpu_class(env),
                str(env.get("dtype")),
                str(env.get("commit")),
                f"{scenario} ({context}): {method} / plain",
                tuple(r["speedup_vs_ar"] for r in kept),
                "x",
                str(run.get("command", "")),
                str(raw.relative_to(root.parent)),
                len(group) - len(kept),
            )


def throughput_runs(root: Path) -> Iterator[Figure]:
    """``knapspec bench throughput`` directories: a method's batch tokens/s over the plain
    batch's (``ar``) at the same pair, batch size and context."""
    for path in sorted((root / "bench").glob("*/throughput.jsonl")):
        run_file = path.parent / "run.json"
        run = json.loads(run_file.read_text(encoding="utf-8")) if run_file.exists() else {}
        records = read_lines(path)
        env = records[0].get("env", {}) if records else {}
        keyed = _groups(records, lambda r: (r["batch_size"], r["context"]))
        for (batch, context), group in keyed.items():
            plain = {r["pair"]: r for r in group if r["method"] == "ar"}
            for method in dict.fromkeys(r["method"] for r in group if r["method"] != "ar"):
                values = [
                    r["tokens_per_second"] / plain[r["pair"]]["tokens_per_second"]
                    for r in group
                    if r["method"] == method and r["pair"] in plain
                ]
                if values:
                    yield Figure(
                        f"bench throughput {path.parent.name}",
                        cpu_class(env),
                        str(env.get("dtype")),
                        str(env.get("commit")),
                        f"batch {batch} x {context}: {method} / plain batch",
                        tuple(values),
                        "x",
                        str(run.get("command", "")),
                        str(path.relative_to(root.parent)),
                    )


def spec_bench_runs(root: Path) -> Iterator[Figure]:
    """``knapspec bench spec-bench`` directories: each method's speed over
    ``model.generate`` per question (its turns' new tokens over their wall time), only
    questions whose answers have as many new tokens as generate's."""
    for run_file in sorted((root / "bench").glob("spec-bench-*/run.json")):
        run = json.loads(run_file.read_text(encoding="utf-8"))
        answers = run_file.parent / "model_answer"
        reference = answers / "generate.jsonl"
        if run.get("status") != "completed" or not reference.exists():
            continue
        env = run.get("environment", {})
        base = {a["question_id"]: a["choices"][0] for a in read_lines(reference)}
        for path in sorted(answers.glob("*.jsonl")):
            if path == reference:
                continue
            values, dropped = [], 0
            for answer in read_lines(path):
                own, theirs = answer["choices"][0], base.get(answer["question_id"])
                if theirs is None or own["new_tokens"] != theirs["new_tokens"]:
                    dropped += 1
                    continue
                rate = sum(own["new_tokens"]) / sum(own["wall_time"])
                values.append(rate / (sum(theirs["new_tokens"]) / sum(theirs["wall_time"])))
            if values:
                yield Figure(
                    f"spec-bench {run_file.parent.name}",
                    cpu_class(env),
                    str(env.get("dtype")),
                    str(env.get("commit")),
                    f"per question: {path.stem} / model.generate",
                    tuple(values),
                    "x",
                    str(run.get("command", "")),
                    str(answers.relative_to(root.parent)),
                    dropped,
                )


#: The race's per-pass fields on the page: (field, label after the system, unit).
RACE_FIELDS = (
    ("output_tokens_per_s", "", "tok/s"),
    ("ttft_p95_s", ", TTFT p95", "s"),
    ("gap_p95_s", ", chunk gap p95", "s"),
    ("token_gap_p95_s", ", per-token gap p95", "s"),
)


def serve_race(root: Path) -> Iterator[Figure]:
    """``benchmarks/serve_load.py``'s cold race: each system's output tokens/s and tail
    latency per pass, mode and concurrency over the repeats of the latest run."""
    path = root / "serve" / "race.jsonl"
    if not path.exists():
        return
    passes = [r for r in read_lines(path) if r.get("kind") == "pass" and "output_tokens_per_s" in r]
    if not passes:
        return
    run = passes[-1]["run"]
    latest = [r for r in passes if r["run"] == run]
    keyed = _groups(
        latest,
        lambda r: (cpu_class(r), r["dtype"], r["pass"], r["mode"], r["concurrency"], r["system"]),
    )
    command = str(latest[-1].get("command", "python benchmarks/serve_load.py"))
    source = str(path.relative_to(root.parent))
    for (cpu, dtype), lines in _groups(latest, lambda r: (cpu_class(r), r["dtype"])).items():
        for row in paired_ratios(lines):
            yield Figure(
                f"serve race ({row['pass']})",
                cpu,
                dtype,
                str(lines[0]["commit"]),
                f"{row['mode']}, {row['concurrency']} client(s): {row['ratio']} (per repeat)",
                tuple(row["values"]),
                "x",
                command,
                source,
            )
    for (cpu, dtype, name, mode, concurrency, system), group in keyed.items():
        for field, label, unit in RACE_FIELDS:
            values = tuple(r[field] for r in group if r.get(field) is not None)
            if values:
                yield Figure(
                    f"serve race ({name})",
                    cpu,
                    dtype,
                    str(group[0]["commit"]),
                    f"{mode}, {concurrency} client(s): {system}{label}",
                    values,
                    unit,
                    str(group[0].get("command", "python benchmarks/serve_load.py")),
                    str(path.relative_to(root.parent)),
                )


#: Every reader, in the page's order within a CPU class and dtype.
SOURCES = (
    exactness_cost,
    engine_vs_generate,
    llamacpp_runs,
    bench_runs,
    throughput_runs,
    spec_bench_runs,
    serve_race,
)


def all_figures(root: Path) -> list[Figure]:
    """Every figure of ``root`` (a ``results/`` directory)."""
    return [figure for source in SOURCES for figure in source(root)]


__all__ = [
    "CPU_CLASSES",
    "SOURCES",
    "Figure",
    "all_figures",
    "bench_runs",
    "cpu_class",
    "engine_vs_generate",
    "exactness_cost",
    "llamacpp_runs",
    "serve_race",
    "spec_bench_runs",
    "throughput_runs",
]
