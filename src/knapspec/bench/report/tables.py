"""Markdown tables of one run (speed, oracle, v(k), set-up) and across runs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import attrs

from knapspec.bench.markdown import markdown_table
from knapspec.bench.methods import GENERATE, REFERENCE
from knapspec.bench.report.stats import (
    MethodRow,
    RunData,
    Spread,
    comparable_calls,
    run_name,
    summarise,
)


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

    return markdown_table(header, (cells(row) for row in rows))


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
    return markdown_table(header, rows)


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
    return markdown_table(header, rows)


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
    return markdown_table(["method", "set-up", "scenario", "seconds", "note"], rows)


def _label(scenario_context: tuple[str, int]) -> tuple[str, str]:
    scenario, context = scenario_context
    return scenario, str(context) if context else "short"


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
    return markdown_table(header, rows) if rows else ""


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
    return markdown_table(header, rows) if rows else ""


__all__ = [
    "across_runs_table",
    "engine_vs_generate_table",
    "method_table",
    "oracle_table",
    "setup_table",
    "vcurve_table",
]
