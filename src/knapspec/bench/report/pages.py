"""Pages: a run's ``report.md`` and the docs page built from one or more runs."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from knapspec.bench.drafter_report import (
    ORACLE_SHARE_THRESHOLD,
    decode_phase_table,
    drafter_table,
    lookup_oracle_table,
    machine_caption,
)
from knapspec.bench.report.plots import (
    MASKS_PLOT,
    SPEEDUP_PLOT,
    VK_PLOT,
    plot_masks,
    plot_speedup,
    plot_vcurves,
)
from knapspec.bench.report.stats import ReportError, RunData, run_name, summarise
from knapspec.bench.report.tables import (
    across_runs_table,
    engine_vs_generate_table,
    method_table,
    oracle_table,
    setup_table,
    vcurve_table,
)
from knapspec.bench.report.throughput import throughput_table
from knapspec.bench.specbench.docs import keep_section

REPORT = "report.md"


def _environment_lines(info: dict[str, Any]) -> list[str]:
    env = info.get("environment", {})
    keys = (
        "model",
        "dtype",
        "device",
        "threads",
        "attn_implementation",
        "cache",
        "torch",
        "transformers",
        "knapspec",
        "commit",
        "python",
    )
    return [f"- {key}: `{env[key]}`" for key in keys if key in env]


def _method_lines(data: RunData) -> list[str]:
    """The methods list: one line per measured method with its description (run.json)."""
    described = {
        m["name"]: m.get("description", "") for m in data.info.get("methods", []) if "name" in m
    }
    lines = [f"- `{name}`: {described[name]}" for name in data.methods() if described.get(name)]
    return ["Methods:", "", *lines, ""] if lines else []


def _table_section(data: RunData, title: str, intro: str, table: str) -> list[str]:
    """A report section: heading, what the table shows, the table, the machine it ran on."""
    return [f"## {title}", "", intro, "", table, "", machine_caption(data), ""]


def render(data: RunData, image_prefix: str = "") -> str:
    """The report as Markdown; images are referenced as ``image_prefix + file name``."""
    rows = summarise(data)
    info = data.info
    parts = [
        f"Run `{info.get('run_name', data.run_dir.name)}` ({info.get('status', 'unknown')}): "
        f"{info.get('prompts', '?')} prompt(s) per length, {info.get('pairs', '?')} pair "
        "round(s) per prompt, interleaved `AR, method, AR, ...` after a warm-up; speedups are "
        "medians of per-pair ratios with [min-max].",
        "",
        "Reproduce with:",
        "",
        "```",
        info.get("command", "knapspec bench"),
        f"knapspec bench report {data.run_dir}",
        "```",
        "",
        "Environment:",
        "",
        *_environment_lines(info),
        "",
        *_method_lines(data),
    ]
    if rows:
        parts += [
            "## Speed, acceptance and time split",
            "",
            method_table(rows),
            "",
            machine_caption(data),
            "",
            f"![speedup vs context]({image_prefix}{SPEEDUP_PLOT})",
            "",
        ]
    if data.throughput:
        parts += _table_section(
            data,
            "Throughput: batches of prompts",
            "New tokens over all rows (each up to its EOS) per second of the whole batched "
            "call, prefill included, per batch size B: `generate` is transformers' batched "
            "`model.generate` on the left-padded batch, `ar` our batched plain decoding, the "
            "others our batched speculation (B = 1: the single-sequence path). Median "
            "[min-max] over pair rounds; the ratios divide each call by `model.generate`'s "
            "and `ar`'s in the same round. `rows = ar`: rows identical to plain decoding's "
            "(`model.generate`'s padded batch may differ in a few; an engine method that "
            "differs fails the run).",
            throughput_table(data),
        )
    if data.oracle:
        parts += _table_section(
            data,
            "Oracle frontier",
            "Best fixed (mask, γ) in hindsight, planning free, from teacher-forced acceptance on "
            "the first prompt's AR continuation and costs measured with the engine "
            "(`knapspec.bench.oracle`). 1.00 means nothing beats plain decoding.",
            oracle_table(data),
        )
        if any(line.get("lookup") for line in data.oracle):
            parts += _table_section(
                data,
                "Oracle: layer skip vs prompt lookup",
                "The lookup family: the first prompt's AR continuation replayed through the "
                "lookup drafter with a fixed k (k = 1 .. D), each round priced with the measured "
                "t_verify(drafted + 1) plus the replay's measured lookup time "
                "(`knapspec.bench.oracle.lookup_replay`), decode phase only: the prefill is "
                "not in it. The column *knapspec of oracle* is KnapSpec's decode-phase median "
                f"speedup over the best of both families, where that exceeds "
                f"{ORACLE_SHARE_THRESHOLD}x (like for like; wall-time speedups also pay the "
                "prefill).",
                lookup_oracle_table(data),
            )
    if any(row.get("drafters") for row in data.raw):
        parts += _table_section(
            data,
            "Who drafted: per-drafter counts and overhead",
            "Rounds, drafted and accepted tokens per drafter (`none`: plain steps, γ = 0), "
            "summed over every call; overhead is planning time, proposing lookup drafts "
            "included, over wall time.",
            drafter_table(data),
        )
    decode_phase = decode_phase_table(data)
    if decode_phase.count("\n") > 1:
        parts += _table_section(
            data,
            "Decoding phase alone (prefill excluded)",
            "No drafter shortens the prefill; `ceiling` (plain wall time over plain prefill) "
            "caps every wall-time speedup above. Each call's decode time (wall minus "
            "prefill) against the mean of the plain calls around it; median [min-max]. "
            "`model.generate` rows are absent: their prefill is not timed apart.",
            decode_phase,
        )
    if (data.run_dir / MASKS_PLOT).exists():
        parts += ["## Masks KnapSpec chose", "", f"![masks]({image_prefix}{MASKS_PLOT})", ""]
    if data.vcurve:
        parts += _table_section(
            data,
            "Verification cost v(k)",
            "v(k) = time of one step over k new tokens / time of a 1-token step, at the "
            "prompt's context; `engine` is knapspec's preallocated cache, grouped-query "
            "attention and few-row linear kernel (after), `engine-f.linear` the same engine "
            "with the model's own `nn.Linear` layers (before), `hf-dynamic-cache` the model's "
            "own forward with a `DynamicCache`. The 1-token step column compares absolute "
            "speed.",
            vcurve_table(data),
        )
        parts += [f"![v(k)]({image_prefix}{VK_PLOT})", ""]
    if data.setup:
        parts += ["## One-time set-up (not timed in the calls)", "", setup_table(data), ""]
    return "\n".join(parts)


def write_report(run: Path | RunData, docs: Path | None = None) -> Path:
    """Write plots and ``report.md`` into the run's directory; optionally regenerate ``docs``.

    Args:
        run: a run directory, or one already loaded.

    Returns:
        The path of ``report.md``.

    Raises:
        ReportError: see :meth:`RunData.load`.
    """
    data = run if isinstance(run, RunData) else RunData.load(run)
    run_dir = data.run_dir
    rows = summarise(data)
    if rows:
        plot_speedup(data, rows, run_dir / SPEEDUP_PLOT)
    plot_masks(data, run_dir / MASKS_PLOT)
    plot_vcurves(data, run_dir / VK_PLOT)
    report = run_dir / REPORT
    report.write_text("# Benchmark report\n\n" + render(data) + "\n", encoding="utf-8")
    if docs is not None:
        write_docs([data], docs)
    return report


#: Hand-written notes beside the runs (``results/bench/NOTES.md``), put on the generated
#: page above its tables: the prose the numbers need lives with the results, not in the
#: README, and survives every regeneration.
NOTES = "NOTES.md"

DOCS_NOTE = "<!-- Generated by `knapspec bench report` from committed results; do not edit. -->"


def demote_headings(markdown: str) -> str:
    """Every heading one level deeper (a run's report becomes a section of the page);
    lines inside fenced code blocks are left alone."""
    lines, fenced = [], False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        lines.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(lines)


def render_docs(runs: Sequence[RunData], docs: Path, title: str = "Benchmarks") -> str:
    """The page ``docs`` for ``runs`` (first: the main run); images are linked relative to
    its folder.

    One run renders as its report. Several open with the hand-written notes of their
    folder (:data:`NOTES`, when it exists: what the runs show, in prose), then tables that
    put the runs side by side (speedup vs AR of each method measured in two or more runs,
    with all calls pooled; plain decoding against ``model.generate``), where they have
    something to compare, then each run's report in order.
    """
    if not runs:
        raise ReportError("no runs to render")
    header = f"# {title}\n\n{DOCS_NOTE}\n\n"

    def prefix(data: RunData) -> str:
        return Path(_relative(data.run_dir, docs.parent)).as_posix().rstrip("/") + "/"

    if len(runs) == 1:
        return header + render(runs[0], image_prefix=prefix(runs[0])) + "\n"
    listed = [
        f"- `{run_name(data)}` (`{data.run_dir.as_posix()}`, commit "
        f"`{data.info.get('environment', {}).get('commit', '?')}`): "
        f"`{data.info.get('command', 'knapspec bench')}`"
        for data in runs
    ]
    title_option = "" if title == "Benchmarks" else f" --title {shlex.quote(title)}"
    parts = [
        f"This page is generated from {len(runs)} committed runs of the same harness; each "
        "run's own report follows the tables that compare them.",
        "",
        *listed,
        "",
        "Regenerate with:",
        "",
        "```",
        "knapspec bench report "
        + " ".join(data.run_dir.as_posix() for data in runs)
        + f" --docs {docs.as_posix()}{title_option}",
        "```",
        "",
    ]
    notes = _notes(runs)
    if notes:
        parts += ["## What the runs say", "", notes, ""]
    across = across_runs_table(runs)
    if across:
        parts += [
            "## Across runs: speedup vs AR",
            "",
            "Median [min-max] of per-call ratios in each run (every call against the mean of "
            "the two plain-decoding calls around it); the last column pools every call of "
            "every run. Sampled calls that stopped short of the scenario's length (possible "
            "only in runs made before commit 411cf84) are left out: tokens/s over different "
            "lengths do not compare.",
            "",
            across,
            "",
        ]
    versus_generate = engine_vs_generate_table(runs)
    if versus_generate:
        parts += [
            "## Across runs: plain decoding through knapspec's engine vs `model.generate`",
            "",
            "Median [min-max] over pair rounds, prefill included. " + machines_sentence(runs),
            "",
            versus_generate,
            "",
        ]
    for data in runs:
        parts += [f"## Run `{run_name(data)}`", "", demote_headings(render(data, prefix(data))), ""]
    return header + "\n".join(parts)


def _notes(runs: Sequence[RunData]) -> str | None:
    """The hand-written :data:`NOTES` of the folder holding every run (None: none)."""
    parents = {data.run_dir.parent for data in runs}
    path = parents.pop() / NOTES if len(parents) == 1 else None
    return path.read_text(encoding="utf-8").strip() if path and path.exists() else None


def machines_sentence(runs: Sequence[RunData]) -> str:
    """Which CPU (and BLAS, kernel table) each run measured: the engine-vs-generate ratio
    belongs to that machine, not to knapspec in general (another x86 CPU can invert it)."""
    described = []
    for data in runs:
        env = data.info.get("environment", {})
        machine = str(env.get("host_cpu") or env.get("device") or "an unrecorded machine")
        extras = [str(env[key]).split(";")[0] for key in ("blas",) if env.get(key)]
        flags = env.get("cpu_flags")
        if flags:
            extras.insert(0, ", ".join(flags) if isinstance(flags, list) else str(flags))
        kernels = env.get("kernel_table")
        if kernels:
            extras.append(f"kernel table {kernels}")
        detail = f" ({'; '.join(extras)})" if extras else ""
        described.append(f"`{run_name(data)}` on {machine}{detail}")
    return (
        "Each ratio holds for the machine that measured it only: "
        + ", ".join(described)
        + ". Other CPUs differ (see `results/engine/`)."
    )


def write_docs(runs: Sequence[RunData], docs: Path, title: str = "Benchmarks") -> Path:
    """Write :func:`render_docs` of ``runs`` to ``docs``; returns ``docs``."""
    docs.parent.mkdir(parents=True, exist_ok=True)
    text = render_docs(runs, docs, title)
    if docs.exists():  # the Spec-Bench section (knapspec bench spec-bench report --docs) stays
        text = keep_section(docs.read_text(encoding="utf-8"), text)
    docs.write_text(text, encoding="utf-8")
    return docs


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


__all__ = [
    "DOCS_NOTE",
    "NOTES",
    "REPORT",
    "demote_headings",
    "render",
    "render_docs",
    "write_docs",
    "write_report",
]
