"""The benchmark harness (``knapspec bench``): scenarios, methods, oracle, report.

    from knapspec.bench import BenchOptions, default_methods, default_scenarios
    options = BenchOptions(default_scenarios(quick=True), default_methods())
    write_report(run_benchmark(model, tokenizer, options))

See :mod:`knapspec.bench.runner` for the protocol and ``docs/benchmarks.md`` for results.
"""

from knapspec.bench.cli import cli_main
from knapspec.bench.methods import (
    MethodSpec,
    ablation_methods,
    default_methods,
    method_config,
    select_methods,
)
from knapspec.bench.oracle import OracleOptions, OracleResult, oracle_frontier
from knapspec.bench.records import LosslessnessError, RunRecord
from knapspec.bench.report import ReportError, RunData, summarise, write_docs, write_report
from knapspec.bench.runner import BenchOptions, Harness, run_benchmark
from knapspec.bench.scenarios import BenchPrompt, Scenario, default_scenarios, select_scenarios

__all__ = [
    "BenchOptions",
    "BenchPrompt",
    "Harness",
    "LosslessnessError",
    "MethodSpec",
    "OracleOptions",
    "OracleResult",
    "ReportError",
    "RunData",
    "RunRecord",
    "Scenario",
    "ablation_methods",
    "cli_main",
    "default_methods",
    "default_scenarios",
    "method_config",
    "oracle_frontier",
    "run_benchmark",
    "select_methods",
    "select_scenarios",
    "summarise",
    "write_docs",
    "write_report",
]
