"""``knapspec bench spec-bench``: run Spec-Bench, or report on a run directory.

``knapspec bench spec-bench [--questions FILE] [--categories ...] [--per-category K]
[--max-new-tokens N] [--methods ...] [--dtype float32|bfloat16] [--output-dir DIR]`` runs;
``knapspec bench spec-bench report RUN_DIR [RUN_DIR ...] [--docs docs/benchmarks.md]``
writes the reports (and the Spec-Bench section of the docs page).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from knapspec.bench.methods import (
    HF_PROMPT_LOOKUP,
    MethodSpec,
    available,
    default_methods,
    select_methods,
)
from knapspec.bench.records import LosslessnessError
from knapspec.bench.specbench.docs import replace_section
from knapspec.bench.specbench.questions import (
    QuestionFileError,
    load_questions,
    packaged_questions,
    select_questions,
)
from knapspec.bench.specbench.report import (
    SpecBenchReportError,
    SpecBenchRunData,
    docs_section,
    write_report,
)
from knapspec.bench.specbench.runner import SpecBenchOptions, run_spec_bench
from knapspec.commandline import load_decoder_config, positive_int

PROG = "knapspec bench spec-bench"
DTYPES = ("float32", "bfloat16")
#: The issue's goal run (#30): one command, on a quiet machine.
GOAL_COMMAND = (
    "knapspec bench spec-bench --per-category 5 --max-new-tokens 256 --dtype float32 "
    "--threads 2 --methods generate ar knapspec hf-prompt-lookup "
    "--output-dir results/bench/spec-bench-fp32"
)
DEFAULT_METHODS = (
    "generate",
    "ar",
    "knapspec",
    HF_PROMPT_LOOKUP,
    "knapspec-lookup-only",
    "knapspec-no-lookup",
)


def spec_bench_methods() -> tuple[MethodSpec, ...]:
    """The harness's methods without the frozen-plan baseline (it needs a scenario's set-up
    prompt), plus a lookup-only KnapSpec arm and transformers' prompt lookup at k = 3."""
    extra = (
        MethodSpec(
            "knapspec-lookup-only",
            {"planner": {"name": "knapsack", "drafters": ["lookup"]}},
            description="KnapSpec searching the lookup drafter only (no layer skipping)",
        ),
        MethodSpec(
            "hf-prompt-lookup-k3",
            kind="generate",
            generate_kwargs={"prompt_lookup_num_tokens": 3},
            description="model.generate(prompt_lookup_num_tokens=3)",
        ),
    )
    methods = [m for m in default_methods() if not m.freeze_plan]
    methods += [m for m in extra if available(m)]
    return tuple(methods)


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run Spec-Bench (greedy, batch 1, the chat template; MT-bench questions "
        "as two turns of one conversation) with every method interleaved question by "
        "question; write one Spec-Bench answer file per method and a report by category. "
        "A rerun with the same --output-dir skips the questions already answered.",
    )
    parser.add_argument(
        "--questions",
        type=Path,
        help="a Spec-Bench question file (JSON lines). Default: the development split "
        "shipped with knapspec (240 questions, Apache-2.0)",
    )
    parser.add_argument("--categories", nargs="+", metavar="NAME", help="default: all")
    parser.add_argument(
        "--per-category", type=positive_int, metavar="K", help="first K questions of each"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=1024,
        metavar="N",
        help="per turn. Default: %(default)s (Spec-Bench's)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        metavar="NAME",
        help=f"default: {' '.join(DEFAULT_METHODS)} ('ar' is always included; see --list)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="default: float32")
    parser.add_argument(
        "--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a directory"
    )
    parser.add_argument("--threads", type=positive_int, default=2, help="default: 2")
    parser.add_argument(
        "--output-dir", type=Path, help="run directory. Default: results/bench/spec-bench-DTYPE"
    )
    parser.add_argument(
        "--warmup-tokens", type=positive_int, default=16, help="per method. Default: 16"
    )
    parser.add_argument(
        "--no-stop-on-mismatch",
        action="store_true",
        help="write an answer of our decoders that differs from plain decoding's and go on "
        "(the report marks it NOT EQUAL) instead of stopping: for bfloat16, where a batched "
        "verify step may round a near tie another way",
    )
    parser.add_argument(
        "--reuse-turns",
        action="store_true",
        help="our decoders answer a question's later turns (MT-bench's second) in one "
        "conversation, keeping the earlier turns' KV cache, instead of prefilling the "
        "whole conversation again (model.generate and prompt lookup still prefill it)",
    )
    parser.add_argument("--no-report", action="store_true", help="write the answers only")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--list", action="store_true", help="list the methods, exit")
    parser.add_argument("--config", type=Path, metavar="FILE", help="base decoder config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} report", description="report.md and the plot of Spec-Bench run dirs"
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "--docs",
        type=Path,
        help="also write these runs into the Spec-Bench section of this Markdown file "
        "(e.g. docs/benchmarks.md; the section between its markers is replaced)",
    )
    return parser


def _run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    menu = spec_bench_methods()
    if args.list:
        for method in menu:
            print(f"{method.name}: {method.description}")
        return 0
    try:
        path = args.questions or packaged_questions()
        every = load_questions(path)
        questions = select_questions(every, args.categories, args.per_category)
        methods = select_methods(menu, args.methods or DEFAULT_METHODS)
    except (QuestionFileError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    options = SpecBenchOptions(
        questions=questions,
        methods=methods,
        output_dir=args.output_dir or Path(f"results/bench/spec-bench-{args.dtype}"),
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        base_config=load_decoder_config(args.config, args.overrides),
        warmup_tokens=args.warmup_tokens,
        progress=not args.no_progress,
        command=shlex.join(["knapspec", "bench", "spec-bench", *argv]),
        question_file=str(path),
        question_order=tuple(q.key for q in every),
        stop_on_mismatch=not args.no_stop_on_mismatch,
        reuse_turns=args.reuse_turns,
    )
    import torch

    from knapspec.model.loading.provision import load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(
        args.model, dtype=getattr(torch, args.dtype), progress=not args.no_progress
    )
    try:
        run_dir = run_spec_bench(model, tokenizer, options)
    except LosslessnessError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # the directory holds another model's / dtype's answers
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(f"{PROG}: answers in {run_dir / 'model_answer'}")
    if not args.no_report:
        print(f"{PROG}: report in {write_report(run_dir)}")
    return 0


def _report(argv: list[str]) -> int:
    args = report_parser().parse_args(argv)
    try:
        runs = [SpecBenchRunData.load(run_dir) for run_dir in args.run_dirs]
        for data in runs:
            print(f"{PROG}: report in {write_report(data.run_dir)}")
    except SpecBenchReportError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    if args.docs is not None:
        text = args.docs.read_text(encoding="utf-8") if args.docs.exists() else ""
        section = docs_section(runs, args.docs, GOAL_COMMAND)
        args.docs.write_text(replace_section(text, section), encoding="utf-8")
        print(f"{PROG}: wrote the Spec-Bench section of {args.docs}")
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``knapspec bench spec-bench`` (``argv``: the arguments after it)."""
    args = list(argv)
    try:
        if args and args[0] == "report":
            return _report(args[1:])
        return _run(args)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, printed)
        return exit_.code if isinstance(exit_.code, int) else 2


__all__ = ["DEFAULT_METHODS", "GOAL_COMMAND", "main", "report_parser", "run_parser"]
