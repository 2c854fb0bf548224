"""Spec-Bench question files: reading them and choosing which questions run.

A question file is JSON lines, ``{"question_id": int, "category": str, "turns": [str, ...]}``
(Spec-Bench's ``data/spec_bench/question.jsonl`` or any file of that shape). The package
ships the development split (240 of the 480 questions) with its Apache-2.0 licence and a
README saying which questions it holds: ``knapspec/data/spec_bench/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import attrs

#: The MT-bench categories (two turns each), then the other five tasks, in Spec-Bench's order.
MT_BENCH = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
CATEGORIES = (*MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag")


class QuestionFileError(ValueError):
    """A question file that cannot be read as Spec-Bench questions."""


def _turns(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(value) for value in values)


@attrs.frozen
class Question:
    """One Spec-Bench question.

    Attributes:
        question_id: its id in the question file (Spec-Bench's ids are integers; strings
            are kept as they are).
        category: e.g. ``"writing"`` or ``"translation"``.
        turns: the user turns, asked in order in one conversation (two for MT-bench).
    """

    question_id: int | str
    category: str
    turns: tuple[str, ...] = attrs.field(converter=_turns)

    @property
    def key(self) -> str:
        """The id as a string, for sets and dicts that mix files written by other tools."""
        return str(self.question_id)


def packaged_questions() -> Path:
    """The development split shipped with knapspec (see its README for the licence)."""
    return Path(str(resources.files("knapspec") / "data" / "spec_bench" / "questions-dev.jsonl"))


def load_questions(path: Path) -> list[Question]:
    """Every question of ``path`` in file order.

    Raises:
        QuestionFileError: a line is not JSON, lacks a field, or repeats an id.
    """
    questions: list[Question] = []
    seen: set[str] = set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise QuestionFileError(f"cannot read the question file {path}: {error}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            question = Question(data["question_id"], data["category"], data["turns"])
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise QuestionFileError(
                f"{path}:{number}: not a Spec-Bench question: {error}"
            ) from None
        if not question.turns:
            raise QuestionFileError(f"{path}:{number}: question {question.key} has no turns")
        if question.key in seen:
            raise QuestionFileError(f"{path}:{number}: question id {question.key} repeats")
        seen.add(question.key)
        questions.append(question)
    if not questions:
        raise QuestionFileError(f"{path} holds no questions")
    return questions


def select_questions(
    questions: Sequence[Question],
    categories: Sequence[str] | None = None,
    per_category: int | None = None,
) -> list[Question]:
    """The first ``per_category`` questions of each of ``categories`` (all when None), in
    file order.

    Raises:
        QuestionFileError: a requested category has no question in the file.
    """
    present = list(dict.fromkeys(q.category for q in questions))
    wanted = list(dict.fromkeys(categories)) if categories else present
    missing = [name for name in wanted if name not in present]
    if missing:
        raise QuestionFileError(
            f"no question of category {', '.join(missing)}; the file has {', '.join(present)}"
        )
    counts: dict[str, int] = {}
    chosen = []
    for question in questions:
        if question.category not in wanted:
            continue
        if per_category is not None and counts.get(question.category, 0) >= per_category:
            continue
        counts[question.category] = counts.get(question.category, 0) + 1
        chosen.append(question)
    return chosen


__all__ = [
    "CATEGORIES",
    "MT_BENCH",
    "Question",
    "QuestionFileError",
    "load_questions",
    "packaged_questions",
    "select_questions",
]
