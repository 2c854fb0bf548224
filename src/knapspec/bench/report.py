"""Tables, plots and ``docs/benchmarks.md``, derived only from run directories' files.

Every number is computed from ``raw.jsonl`` / ``oracle.jsonl`` / ``vcurve.jsonl``; nothing
is typed by hand. Speedups are medians of per-pair ratios with their min-max range:

* vs AR: each call's ``speedup_vs_ar`` (its tokens/s over the mean of the AR calls just
  before and after it);
* vs ``model.generate``: per (prompt, pair round), the method's tokens/s over
  ``model.generate``'s in the same round (AR's row uses the reference calls of the round).

A page built from several runs (:func:`render_docs`) also pools the per-call ratios of
every run for each (scenario, N, method) the runs share.
"""

from __future__ import annotations

import json
import shlex
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from knapspec.bench.drafter_report import (
    ORACLE_SHARE_THRESHOLD,
    drafter_table,
    lookup_oracle_table,
    machine_caption,
)
from knapspec.bench.methods import GENERATE, REFERENCE
from knapspec.bench.records import FAILED_RAW, ORACLE, RAW, RUN_INFO, SETUP, VCURVE, read_jsonl

REPORT = "report.md"
SPEEDUP_PLOT = "speedup_vs_context.png"
MASKS_PLOT = "knapspec_masks.png"
VK_PLOT = "vk_curves.png"


class ReportError(ValueError):
    """The run directory cannot be reported (missing, failed or empty)."""


@attrs.frozen
class Spread:
    """Median and min-max of a sample."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        data = [v for v in values if v is not None]
        if not data:
            return None
        return cls(statistics.median(data), min(data), max(data))

    def text(self, digits: int = 2) -> str:
        return f"{self.median:.{digits}f} [{self.low:.{digits}f}-{self.high:.{digits}f}]"


@attrs.frozen
class MethodRow:
    """One table row: a method at one scenario and length."""

    scenario: str
    context: int
    context_length: float
    method: str
    calls: int
    tokens_per_second: Spread | None
    speedup_vs_ar: Spread | None
    speedup_vs_generate: Spread | None
    acceptance_rate: float
    mean_accepted_length: float
    new_tokens: float
    plan_share: float
    draft_share: float
    verify_share: float
    fraction_of_oracle: float | None


@attrs.frozen
class RunData:
    """Everything a run directory holds."""

    run_dir: Path
    info: dict[str, Any]
    raw: list[dict[str, Any]]
    setup: list[dict[str, Any]]
    oracle: list[dict[str, Any]]
    vcurve: list[dict[str, Any]]

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """Read a run directory.

        Raises:
            ReportError: no such directory, a failed run, or no raw results.
        """
        if not run_dir.is_dir():
            raise ReportError(f"{run_dir}: no such run directory")
        if (run_dir / FAILED_RAW).exists():
            raise ReportError(
                f"{run_dir}: this run failed its losslessness check ({FAILED_RAW}); a failed run "
                "is a bug, never a result"
            )
        info_path = run_dir / RUN_INFO
        info = json.loads(info_path.read_text(encoding="utf-8")) if info_path.exists() else {}
        raw = list(read_jsonl(run_dir / RAW))
        if not raw:
            raise ReportError(f"{run_dir}: no results in {RAW}")
        return cls(
            run_dir,
            info,
            raw,
            list(read_jsonl(run_dir / SETUP)),
            list(read_jsonl(run_dir / ORACLE)),
            list(read_jsonl(run_dir / VCURVE)),
        )

    def methods(self) -> list[str]:
        listed = [m["name"] for m in self.info.get("methods", [])]
        seen = list(dict.fromkeys(row["method"] for row in self.raw))
        return [m for m in listed if m in seen] + [m for m in seen if m not in listed]

    def oracle_speedup(self, scenario: str, context: int) -> float | None:
        values = [
            row["speedup"]
            for row in self.oracle
            if row["scenario"] == scenario and row["context"] == context
        ]
        return statistics.median(values) if values else None


def _share(rows: Sequence[dict[str, Any]], key: str) -> float:
    total = sum(row["wall_time"] for row in rows)
    return sum(row[key] for row in rows) / total if total > 0 else 0.0


def summarise(data: RunData) -> list[MethodRow]:
    """One :class:`MethodRow` per (scenario, context, method), in run order."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for row in data.raw:
        groups[(row["scenario"], row["context"])].append(row)
    result = []
    for (scenario, context), rows in groups.items():
        generate = {
            (row["prompt_id"], row["pair"]): row["tokens_per_second"]
            for row in rows
            if row["method"] == GENERATE
        }
        oracle = data.oracle_speedup(scenario, context)
        for method in data.methods():
            mine = [row for row in rows if row["method"] == method]
            if not mine:
                continue
            if method == REFERENCE:
                vs_ar: Spread | None = Spread(1.0, 1.0, 1.0)
            else:
                vs_ar = Spread.of(row["speedup_vs_ar"] for row in mine)
            by_round: dict[tuple[str, int], list[float]] = defaultdict(list)
            for row in mine:
                by_round[(row["prompt_id"], row["pair"])].append(row["tokens_per_second"])
            vs_generate = Spread.of(
                statistics.mean(values) / generate[key]
                for key, values in by_round.items()
                if key in generate and generate[key] > 0
            )
            drafted = sum(row["drafted_tokens"] for row in mine)
            rounds = sum(len(row["accept_lengths"]) for row in mine)
            result.append(
                MethodRow(
                    scenario=scenario,
                    context=context,
                    context_length=statistics.mean(row["context_length"] for row in mine),
                    method=method,
                    calls=len(mine),
                    tokens_per_second=Spread.of(row["tokens_per_second"] for row in mine),
                    speedup_vs_ar=vs_ar,
                    speedup_vs_generate=vs_generate if method != GENERATE else None,
                    acceptance_rate=(
                        sum(row["accepted_tokens"] for row in mine) / drafted if drafted else 0.0
                    ),
                    mean_accepted_length=(
                        sum(sum(row["accept_lengths"]) for row in mine) / rounds if rounds else 0.0
                    ),
                    new_tokens=statistics.mean(row["new_tokens"] for row in mine),
                    plan_share=_share(mine, "plan_seconds"),
                    draft_share=_share(mine, "draft_seconds"),
                    verify_share=_share(mine, "verify_seconds"),
                    fraction_of_oracle=(
                        vs_ar.median / oracle
                        if vs_ar is not None and oracle and oracle > ORACLE_SHARE_THRESHOLD
                        else None
                    ),
                )
            )
    return result


# ------------------------------------------------------------------------ tables
def _markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _context_label(row: MethodRow) -> str:
    return (
        f"{row.context} ({row.context_length:.0f})"
        if row.context
        else f"short ({row.context_length:.0f})"
    )


def method_table(rows: Sequence[MethodRow]) -> str:
    """The main table: speed, acceptance and the time split per method."""
    header = [
        "scenario",
        "N (tokens)",
        "method",
        "tok/s",
        "speedup vs AR",
        "vs model.generate",
        "α",
        "mean acc. len",
        "plan / draft / verify",
        "of oracle",
    ]

    def cells(row: MethodRow) -> list[str]:
        def spread(value: Spread | None) -> str:
            return value.text() if value is not None else "–"

        split = f"{row.plan_share:.0%} / {row.draft_share:.0%} / {row.verify_share:.0%}"
        return [
            row.scenario,
            _context_label(row),
            row.method,
            spread(row.tokens_per_second),
            spread(row.speedup_vs_ar),
            spread(row.speedup_vs_generate),
            f"{row.acceptance_rate:.2f}" if row.method not in (REFERENCE, GENERATE) else "–",
            f"{row.mean_accepted_length:.2f}",
            split if row.method != GENERATE else "–",
            f"{row.fraction_of_oracle:.0%}" if row.fraction_of_oracle is not None else "–",
        ]

    return _markdown(header, (cells(row) for row in rows))


def oracle_table(data: RunData) -> str:
    header = ["scenario", "N (tokens)", "oracle speedup", "best mask (family, skipped)", "γ", "α"]
    rows = []
    for line in data.oracle:
        best = line.get("best")
        label = f"{line['context']} ({line['context_length']})"
        if best is None:
            plain = "plain decoding" if line.get("candidates", [None]) else "not swept"
            rows.append([line["scenario"], label, f"{line['speedup']:.2f}", plain, "0", "–"])
        else:
            rows.append(
                [
                    line["scenario"],
                    label,
                    f"{line['speedup']:.2f}",
                    f"{best['family']}, {len(best['skipped_items'])} items",
                    str(best["best_draft_length"]),
                    f"{best['alpha']:.2f}",
                ]
            )
    return _markdown(header, rows)


def vcurve_table(data: RunData) -> str:
    if not data.vcurve:
        return ""
    widths = data.vcurve[0]["k"]
    shown = [k for k in widths if k in (2, 3, 4, 6, 8, 11) or k == widths[-1]]
    header = ["context", "backend", "1-token step ms", *[f"v({k})" for k in shown]]
    rows = []
    for line in data.vcurve:
        ratio = dict(zip(line["k"], line["ratio"], strict=True))
        rows.append(
            [
                str(line["context_length"]),
                line["backend"],
                f"{1000 * line['seconds'][0]:.1f}",
                *[f"{ratio[k]:.2f}" for k in shown],
            ]
        )
    return _markdown(header, rows)


def setup_table(data: RunData) -> str:
    rows = [
        [
            line["method"],
            line["kind"],
            line.get("scenario", "–"),
            f"{line['seconds']:.2f}",
            (
                f"skips {line['skipped_items']}, γ = {line['draft_length']}"
                if line["kind"] == "freeze"
                else ""
            ),
        ]
        for line in data.setup
    ]
    return _markdown(["method", "set-up", "scenario", "seconds", "note"], rows)


def run_name(data: RunData) -> str:
    """The run's name (its directory's name when ``run.json`` does not say)."""
    return str(data.info.get("run_name", data.run_dir.name))


def _label(scenario_context: tuple[str, int]) -> tuple[str, str]:
    scenario, context = scenario_context
    return scenario, str(context) if context else "short"


def comparable_calls(data: RunData) -> list[dict[str, Any]]:
    """The run's calls, less sampled calls that stopped short of their scenario's length.

    The harness runs every sampled call to full length (EOS never stops it) because tokens
    per second over different lengths are not comparable: prefill weighs more in a short
    call. Runs made before that rule (commit 411cf84) hold such calls; pooling leaves them
    out.
    """
    longest: dict[tuple[str, int], int] = defaultdict(int)
    for row in data.raw:
        key = (row["scenario"], row["context"])
        longest[key] = max(longest[key], row["new_tokens"])
    return [
        row
        for row in data.raw
        if not (row.get("sampling") or {}).get("do_sample")
        or row["new_tokens"] == longest[(row["scenario"], row["context"])]
    ]


def across_runs_table(runs: Sequence[RunData]) -> str:
    """Speedup vs AR of every method measured in two or more runs, run by run.

    Each run's cell is the median [min-max] of its per-call ratios; the last column pools
    every call of every run (n: how many). Empty when no method and setting recur.
    """
    ratios: dict[tuple[str, int, str], dict[int, list[float]]] = defaultdict(dict)
    for index, data in enumerate(runs):
        for row in comparable_calls(data):
            if row["method"] != REFERENCE and row.get("speedup_vs_ar") is not None:
                key = (row["scenario"], row["context"], row["method"])
                ratios[key].setdefault(index, []).append(row["speedup_vs_ar"])
    # Rows grouped by (scenario, N) in the order the runs met them; methods in run order.
    settings = list(dict.fromkeys((scenario, context) for scenario, context, _ in ratios))
    methods = list(dict.fromkeys(m for data in runs for m in data.methods()))
    order = sorted(ratios, key=lambda k: (settings.index(k[:2]), methods.index(k[2])))
    header = ["scenario", "N", "method", *[f"`{run_name(d)}`" for d in runs], "all calls (n)"]
    rows = []
    for scenario, context, method in order:
        by_run = ratios[(scenario, context, method)]
        if len(by_run) < 2:
            continue
        cells = []
        for index in range(len(runs)):
            spread = Spread.of(by_run.get(index, []))
            cells.append(spread.text() if spread is not None else "–")
        pooled = [value for values in by_run.values() for value in values]
        total = Spread.of(pooled)
        assert total is not None  # by_run holds at least two non-empty lists
        rows.append(
            [*_label((scenario, context)), method, *cells, f"{total.text()} ({len(pooled)})"]
        )
    return _markdown(header, rows) if rows else ""


def engine_vs_generate_table(runs: Sequence[RunData]) -> str:
    """Plain decoding through knapspec's engine against ``model.generate``, run by run
    (over :func:`comparable_calls`); empty when no run measured ``model.generate``."""
    cells: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    for index, data in enumerate(runs):
        for row in summarise(attrs.evolve(data, raw=comparable_calls(data))):
            if row.method == REFERENCE and row.speedup_vs_generate is not None:
                cells[(row.scenario, row.context)][index] = row.speedup_vs_generate.text()
    header = ["scenario", "N", *[f"`{run_name(d)}`" for d in runs]]
    rows = [
        [*_label(key), *[by_run.get(index, "–") for index in range(len(runs))]]
        for key, by_run in cells.items()
    ]
    return _markdown(header, rows) if rows else ""


# ------------------------------------------------------------------------ plots
def plot_speedup(data: RunData, rows: Sequence[MethodRow], path: Path) -> None:
    """Speedup vs AR against context, one panel per scenario, the oracle as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(row.scenario for row in rows))
    figure, axes = plt.subplots(
        1, len(scenarios), figsize=(4.5 * len(scenarios), 3.8), squeeze=False
    )
    for axis, scenario in zip(axes[0], scenarios, strict=True):
        mine = [row for row in rows if row.scenario == scenario]
        for method in dict.fromkeys(row.method for row in mine):
            points = sorted(
                (row.context_length, row.speedup_vs_ar)
                for row in mine
                if row.method == method and row.speedup_vs_ar is not None
            )
            xs = [x for x, _ in points]
            medians = [s.median for _, s in points if s is not None]
            low = [s.median - s.low for _, s in points if s is not None]
            high = [s.high - s.median for _, s in points if s is not None]
            axis.errorbar(xs, medians, yerr=[low, high], marker="o", capsize=3, label=method)
        oracle = sorted(
            (line["context_length"], line["speedup"])
            for line in data.oracle
            if line["scenario"] == scenario
        )
        if oracle:
            axis.plot(*zip(*oracle, strict=True), "k--", marker="x", label="oracle")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(scenario)
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel("speedup vs AR (engine)")
    axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_masks(data: RunData, path: Path, method: str = "knapspec") -> bool:
    """The skipped attention / MLP items and γ KnapSpec chose, against context length."""
    plans = [plan for row in data.raw if row["method"] == method for plan in row.get("plans", [])]
    if not plans:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.8))
    xs = [plan["context_length"] for plan in plans]
    axis.scatter(xs, [p["skipped_attention"] for p in plans], label="skipped attention", s=12)
    axis.scatter(xs, [p["skipped_mlp"] for p in plans], label="skipped MLP", s=12, marker="s")
    axis.scatter(xs, [p["draft_length"] for p in plans], label="γ", s=12, marker="^")
    axis.set_xlabel("context length at planning time")
    axis.set_ylabel("count")
    axis.set_title(f"plans chosen by {method}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def plot_vcurves(data: RunData, path: Path) -> bool:
    """v(k) at each measured context, engine (solid) and HF DynamicCache (dashed)."""
    if not data.vcurve:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.8))
    colours: dict[int, Any] = {}
    for line in sorted(data.vcurve, key=lambda item: item["context_length"]):
        length = line["context_length"]
        style = {"engine": "-", "engine-f.linear": ":"}.get(line["backend"], "--")
        kwargs: dict[str, Any] = {"color": colours[length]} if length in colours else {}
        (handle,) = axis.plot(
            line["k"],
            line["ratio"],
            style,
            marker="o",
            markersize=3,
            label=f"n={length} {line['backend']}",
            **kwargs,
        )
        colours[length] = handle.get_color()
    axis.set_xlabel("k (tokens verified in one step)")
    axis.set_ylabel("v(k) = t(k) / t(1)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# ------------------------------------------------------------------------ documents
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
        "## Speed, acceptance and time split",
        "",
        method_table(rows),
        "",
        machine_caption(data),
        "",
        f"![speedup vs context]({image_prefix}{SPEEDUP_PLOT})",
        "",
    ]
    if data.oracle:
        parts += [
            "## Oracle frontier",
            "",
            "Best fixed (mask, γ) in hindsight, planning free, from teacher-forced acceptance on "
            "the first prompt's AR continuation and costs measured with the engine "
            "(`knapspec.bench.oracle`). 1.00 means nothing beats plain decoding.",
            "",
            oracle_table(data),
            "",
            machine_caption(data),
            "",
        ]
        if any(line.get("lookup") for line in data.oracle):
            parts += [
                "## Oracle: layer skip vs prompt lookup",
                "",
                "The lookup family: the first prompt's AR continuation replayed through the "
                "lookup drafter with a fixed k (k = 1 .. D), each round priced with the measured "
                "t_verify(drafted + 1) plus the replay's measured lookup time "
                "(`knapspec.bench.oracle.lookup_replay`). `knapspec of oracle` is its median "
                f"speedup over the best of both families, where that exceeds "
                f"{ORACLE_SHARE_THRESHOLD}x.",
                "",
                lookup_oracle_table(data),
                "",
                machine_caption(data),
                "",
            ]
    if any(row.get("drafters") for row in data.raw):
        parts += [
            "## Who drafted: per-drafter counts and overhead",
            "",
            "Rounds, drafted and accepted tokens per drafter (`none`: plain steps, γ = 0), "
            "summed over every call; overhead is planning time, proposing lookup drafts "
            "included, over wall time.",
            "",
            drafter_table(data),
            "",
            machine_caption(data),
            "",
        ]
    if (data.run_dir / MASKS_PLOT).exists():
        parts += ["## Masks KnapSpec chose", "", f"![masks]({image_prefix}{MASKS_PLOT})", ""]
    if data.vcurve:
        parts += [
            "## Verification cost v(k)",
            "",
            "v(k) = time of one step over k new tokens / time of a 1-token step, at the "
            "prompt's context; `engine` is knapspec's preallocated cache, grouped-query "
            "attention and few-row linear kernel (after), `engine-f.linear` the same engine "
            "with the model's own `nn.Linear` layers (before), `hf-dynamic-cache` the model's "
            "own forward with a `DynamicCache`. The 1-token step column compares absolute "
            "speed.",
            "",
            vcurve_table(data),
            "",
            machine_caption(data),
            "",
            f"![v(k)]({image_prefix}{VK_PLOT})",
            "",
        ]
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
    plot_speedup(data, rows, run_dir / SPEEDUP_PLOT)
    plot_masks(data, run_dir / MASKS_PLOT)
    plot_vcurves(data, run_dir / VK_PLOT)
    report = run_dir / REPORT
    report.write_text("# Benchmark report\n\n" + render(data) + "\n", encoding="utf-8")
    if docs is not None:
        write_docs([data], docs)
    return report


DOCS_NOTE = "<!-- Generated by `knapspec bench report` from committed results; do not edit. -->"


def _demoted(markdown: str) -> str:
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

    One run renders as its report. Several open with tables that put the runs side by
    side (speedup vs AR of each method measured in two or more runs, with all calls
    pooled; plain decoding against ``model.generate``), where they have something to
    compare, then each run's report in order.
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
            "Median [min-max] over pair rounds, prefill included.",
            "",
            versus_generate,
            "",
        ]
    for data in runs:
        parts += [f"## Run `{run_name(data)}`", "", _demoted(render(data, prefix(data))), ""]
    return header + "\n".join(parts)


def write_docs(runs: Sequence[RunData], docs: Path, title: str = "Benchmarks") -> Path:
    """Write :func:`render_docs` of ``runs`` to ``docs``; returns ``docs``."""
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(render_docs(runs, docs, title), encoding="utf-8")
    return docs


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


__all__ = [
    "MethodRow",
    "ReportError",
    "RunData",
    "Spread",
    "across_runs_table",
    "comparable_calls",
    "engine_vs_generate_table",
    "method_table",
    "oracle_table",
    "render",
    "render_docs",
    "run_name",
    "summarise",
    "write_docs",
    "write_report",
]
