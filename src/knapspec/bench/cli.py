"""``knapspec bench``: run the harness, or report on a finished run.

    knapspec bench [run] [--quick] [--scenarios ...] [--methods ...] [--ablations] ...
    knapspec bench report RUN_DIR [RUN_DIR ...] [--docs docs/benchmarks.md]
    knapspec bench spec-bench [...]      (Spec-Bench: :mod:`knapspec.bench.specbench.cli`)

``run`` (the default) writes ``results/bench/<run-name>/`` and then its report;
``--config FILE`` / ``--set KEY=VALUE`` give the base decoder config every method's
overrides are merged into.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from knapspec.bench.methods import ablation_methods, default_methods, select_methods
from knapspec.bench.oracle import FAMILIES, OracleOptions
from knapspec.bench.records import LosslessnessError
from knapspec.bench.report import ReportError, RunData, write_docs, write_report
from knapspec.bench.runner import BenchOptions, command_line, run_benchmark
from knapspec.bench.scenarios import default_scenarios, select_scenarios
from knapspec.commandline import load_decoder_config, positive_int
from knapspec.config import ConfigError, DecoderConfig

PROG = "knapspec bench"
QUICK_ORACLE = OracleOptions(sizes=(1, 2, 4), families=FAMILIES, repeats=2, max_tokens=16)


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} [run]",
        description="Benchmark plain decoding, model.generate, the baselines and KnapSpec on "
        "real text: interleaved AR/method pairs, losslessness checked, raw JSON lines, the "
        "oracle frontier, v(k) curves and a report.",
    )
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct), another known model ('gemma-3-270m') "
        "or a local transformers model directory. Default: %(default)s.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: short prompts and generations, 1 prompt, 1 pair, a small oracle sweep",
    )
    parser.add_argument(
        "--scenarios", nargs="+", metavar="NAME", help="scenarios to run (default: all; see --list)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="NAME",
        help="methods to run (default: all; 'ar' is always included)",
    )
    parser.add_argument(
        "--ablations",
        action="store_true",
        help="also run KnapSpec's ablation arms (selectable with --methods)",
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        type=positive_int,
        metavar="N",
        help="override the prompt lengths of the long-input style scenarios",
    )
    parser.add_argument(
        "--new-tokens", type=positive_int, metavar="T", help="override every scenario's new tokens"
    )
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=positive_int,
        metavar="B",
        help="override the batch sizes of the throughput scenario (default: 1 4 8; 1 4 with "
        "--quick)",
    )
    parser.add_argument(
        "--prompts",
        type=positive_int,
        help="prompts per scenario and length (default: 2; 1 with --quick)",
    )
    parser.add_argument(
        "--pairs", type=positive_int, help="pair rounds per prompt (default: 3; 1 with --quick)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=2,
        help="torch threads for the whole run. Default: %(default)s.",
    )
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=Path("results/bench"),
        help="parent of the run directory. Default: %(default)s.",
    )
    parser.add_argument(
        "--run-name",
        help="run directory name (default: 'full', 'quick' "
        "with --quick, plus a timestamp when taken)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the results of an existing run directory"
    )
    parser.add_argument("--no-oracle", action="store_true", help="skip the oracle frontier")
    parser.add_argument(
        "--oracle-lookup-only",
        action="store_true",
        help="oracle: only the lookup family (seconds per length) and not the layer-skip mask "
        "sweep (about a minute per length on 2 cores)",
    )
    parser.add_argument("--no-vcurve", action="store_true", help="skip the v(k) measurements")
    parser.add_argument(
        "--profile",
        type=Path,
        help="latency profile for the fitted cost-model ablation (created with "
        "knapspec.costmodels.profile_engine and saved there when missing). "
        "Default: <output-dir>/profile-<model>.json",
    )
    parser.add_argument(
        "--docs", type=Path, help="also regenerate this Markdown file (e.g. docs/benchmarks.md)"
    )
    parser.add_argument("--no-report", action="store_true", help="write raw results only")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--list", action="store_true", help="list scenarios and methods, exit")
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="base decoder config (TOML/JSON) for every method",
    )
    group.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a base config field (repeatable)",
    )
    return parser


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} report",
        description="Tables, plots and report.md from a run directory's results.",
    )
    parser.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="run directories; each gets its report.md and plots",
    )
    parser.add_argument(
        "--docs",
        type=Path,
        help="also regenerate this Markdown file (e.g. docs/benchmarks.md) from all the runs, "
        "the first as the main one, with tables comparing them",
    )
    parser.add_argument(
        "--title", default="Benchmarks", help="the --docs page's title. Default: Benchmarks."
    )
    return parser


def _base_config(args: argparse.Namespace) -> DecoderConfig:
    return load_decoder_config(args.config, args.overrides)


def _options(args: argparse.Namespace, argv: Sequence[str] | None) -> BenchOptions:
    scenarios = default_scenarios(quick=args.quick)
    scenarios = select_scenarios(scenarios, args.scenarios)
    if args.contexts:
        scenarios = tuple(
            s if s.kind == "long-generation" else attrs.evolve(s, contexts=tuple(args.contexts))
            for s in scenarios
        )
    if args.new_tokens:
        scenarios = tuple(attrs.evolve(s, new_tokens=args.new_tokens) for s in scenarios)
    if args.batch_sizes:
        scenarios = tuple(
            attrs.evolve(s, batch_sizes=tuple(args.batch_sizes)) if s.throughput else s
            for s in scenarios
        )
    available = default_methods()
    if args.ablations or (args.methods and any(m.startswith("knapspec-") for m in args.methods)):
        available += ablation_methods(args.profile)
    methods = select_methods(available, args.methods)
    base = _base_config(args)
    oracle = None
    if not args.no_oracle:
        oracle = QUICK_ORACLE if args.quick else OracleOptions()
        oracle = attrs.evolve(oracle, max_draft_length=base.max_draft_length)
        if args.oracle_lookup_only:
            oracle = attrs.evolve(oracle, families=(), lookup=True)
    name = args.run_name or ("quick" if args.quick else "full")
    return BenchOptions(
        scenarios=scenarios,
        methods=methods,
        prompts=args.prompts or (1 if args.quick else 2),
        pairs=args.pairs or (1 if args.quick else 3),
        threads=args.threads,
        output_dir=args.output_dir,
        run_name=name,
        base_config=base,
        oracle=oracle,
        vcurve=not args.no_vcurve,
        vcurve_repeats=3 if args.quick else 5,
        warmup_tokens=8 if args.quick else 16,
        progress=not args.no_progress,
        command=command_line(["run", *argv] if argv is not None else None),
        overwrite=args.overwrite,
    )


def _ensure_profile(model: object, path: Path, quick: bool) -> float:
    """Create the fitted cost model's profile once (set-up, never timed); returns seconds."""
    from knapspec.costmodels import LatencyProfile, ProfileError, profile_engine
    from knapspec.model.engine import SublayerEngine

    engine = SublayerEngine(model)  # type: ignore[arg-type]
    if path.exists():
        try:
            LatencyProfile.load(path).check_compatible(engine)
            return 0.0
        except ProfileError as error:
            print(f"{PROG}: re-profiling: {error}", file=sys.stderr)
    start = time.perf_counter()
    profile = profile_engine(engine, quick=quick, progress=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return time.perf_counter() - start


def _run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    if args.list:
        for scenario in default_scenarios(quick=args.quick):
            batches = f", B = {scenario.batch_sizes}" if scenario.throughput else ""
            print(
                f"scenario {scenario.name}: {scenario.description} "
                f"(N = {scenario.contexts}{batches})"
            )
        for method in (*default_methods(), *ablation_methods(Path("PROFILE"))):
            print(f"method {method.name}: {method.description}")
        return 0
    needs_profile = args.ablations or any(m == "knapspec-linear" for m in args.methods or [])
    if needs_profile and args.profile is None:
        args.profile = (
            args.output_dir / "profile-smollm2.json"
            if args.model == "default"
            else (args.output_dir / f"profile-{Path(args.model).name}.json")
        )
    try:
        options = _options(args, argv)
    except ConfigError:
        raise  # the knapspec command reports config errors (exit code 2)
    except ValueError as error:  # an unknown scenario or method name
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2

    import torch

    from knapspec.model.loading.provision import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, progress=not args.no_progress)
    if needs_profile:
        seconds = _ensure_profile(model, args.profile, args.quick)
        if seconds:
            print(f"{PROG}: profiled the model in {seconds:.1f} s -> {args.profile}")
    try:
        run_dir = run_benchmark(model, tokenizer, options)
    except LosslessnessError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except FileExistsError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"{PROG}: results in {run_dir}")
    if not args.no_report:
        report = write_report(run_dir, args.docs)
        print(f"{PROG}: report in {report}")
    return 0


def _report(argv: list[str]) -> int:
    args = report_parser().parse_args(argv)
    try:
        runs = [RunData.load(run_dir) for run_dir in args.run_dirs]
        for data in runs:
            print(f"{PROG}: report in {write_report(data)}")
        if args.docs is not None:
            print(f"{PROG}: regenerated {write_docs(runs, args.docs, args.title)}")
    except ReportError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    """Entry point of ``knapspec bench`` (``argv``: the arguments after ``bench``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "report":
            return _report(args[1:])
        if args and args[0] == "spec-bench":
            from knapspec.bench.specbench.cli import main  # its own options and runner

            return main(args[1:])
        if args and args[0] == "run":
            args = args[1:]
        return _run(args)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, printed)
        return exit_.code if isinstance(exit_.code, int) else 2


__all__ = ["cli_main", "report_parser", "run_parser"]
