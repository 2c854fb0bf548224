"""Tables, plots and ``docs/benchmarks.md``, derived only from run directories' files.

Every number is computed from ``raw.jsonl`` / ``oracle.jsonl`` / ``vcurve.jsonl``; nothing
is typed by hand. Speedups are medians of per-pair ratios with their min-max range:

* vs AR: each call's ``speedup_vs_ar`` (its tokens/s over the mean of the AR calls just
  before and after it);
* vs ``model.generate``: per (prompt, pair round), the method's tokens/s over
  ``model.generate``'s in the same round (AR's row uses the reference calls of the round).

A page built from several runs (:func:`render_docs`) also pools the per-call ratios of
every run for each (scenario, N, method) the runs share.

One module per concern: :mod:`~knapspec.bench.report.stats` (run data, summaries),
:mod:`~knapspec.bench.report.tables` (Markdown tables), :mod:`~knapspec.bench.report.plots`
and :mod:`~knapspec.bench.report.pages` (``report.md`` and the docs page),
:mod:`~knapspec.bench.report.throughput` (batched calls of throughput scenarios).
"""

from knapspec.bench.report.pages import (
    DOCS_NOTE,
    REPORT,
    demote_headings,
    render,
    render_docs,
    write_docs,
    write_report,
)
from knapspec.bench.report.plots import MASKS_PLOT, SPEEDUP_PLOT, VK_PLOT
from knapspec.bench.report.stats import (
    MethodRow,
    ReportError,
    RunData,
    Spread,
    comparable_calls,
    run_name,
    summarise,
)
from knapspec.bench.report.tables import (
    across_runs_table,
    engine_vs_generate_table,
    method_table,
    oracle_table,
    setup_table,
    vcurve_table,
)
from knapspec.bench.report.throughput import (
    ThroughputRow,
    summarise_throughput,
    throughput_table,
)

__all__ = [
    "DOCS_NOTE",
    "MASKS_PLOT",
    "REPORT",
    "SPEEDUP_PLOT",
    "VK_PLOT",
    "MethodRow",
    "ReportError",
    "RunData",
    "Spread",
    "ThroughputRow",
    "across_runs_table",
    "comparable_calls",
    "demote_headings",
    "engine_vs_generate_table",
    "method_table",
    "oracle_table",
    "render",
    "render_docs",
    "run_name",
    "setup_table",
    "summarise",
    "summarise_throughput",
    "throughput_table",
    "vcurve_table",
    "write_docs",
    "write_report",
]
