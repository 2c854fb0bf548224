"""Spec-Bench on this machine (``knapspec bench spec-bench``): the field's own suite.

    from knapspec.bench.specbench import SpecBenchOptions, load_questions, run_spec_bench
    questions = select_questions(load_questions(packaged_questions()), per_category=1)
    run_dir = run_spec_bench(model, tokenizer, SpecBenchOptions(questions, methods, out))
    write_report(run_dir)

:mod:`~knapspec.bench.specbench.questions` reads question files,
:mod:`~knapspec.bench.specbench.runner` runs the methods interleaved and resumably,
:mod:`~knapspec.bench.specbench.answers` holds Spec-Bench's answer-file format and our
``equal``, :mod:`~knapspec.bench.specbench.report` the tables and plot by category.
"""

from knapspec.bench.specbench.answers import (
    Answer,
    Equality,
    Turn,
    compare_answers,
    read_answers,
)
from knapspec.bench.specbench.questions import (
    CATEGORIES,
    MT_BENCH,
    Question,
    QuestionFileError,
    load_questions,
    packaged_questions,
    select_questions,
)
from knapspec.bench.specbench.report import SpecBenchReportError, SpecBenchRunData, write_report
from knapspec.bench.specbench.runner import SpecBenchOptions, answer_path, run_spec_bench

__all__ = [
    "CATEGORIES",
    "MT_BENCH",
    "Answer",
    "Equality",
    "Question",
    "QuestionFileError",
    "SpecBenchOptions",
    "SpecBenchReportError",
    "SpecBenchRunData",
    "Turn",
    "answer_path",
    "compare_answers",
    "load_questions",
    "packaged_questions",
    "read_answers",
    "run_spec_bench",
    "select_questions",
    "write_report",
]
