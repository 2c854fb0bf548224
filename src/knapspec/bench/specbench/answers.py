"""Answer files in Spec-Bench's format, and our losslessness check (``equal``) over them.

One file per method, one JSON line per question, as Spec-Bench's ``evaluation/eval.py``
writes them::

    {"question_id": 81, "category": "writing", "answer_id": "...", "model_id": "...",
     "choices": [{"index": 0, "turns": ["...", "..."], "decoding_steps": [.., ..],
                  "new_tokens": [.., ..], "wall_time": [.., ..], "accept_lengths": [...]}],
     "tstamp": 1764614400.0, "knapspec": {...}}

``accept_lengths`` is one flat list over the question's turns (``eval.py`` extends it turn
after turn; ``speed.py`` extends its own list with it and takes the mean). ``turns`` holds
the decoded answers; Spec-Bench's ``equal.py`` compares ``str(turns)`` line by line, so the
files are rewritten in question order when a run completes (:func:`reorg_answer_file`,
as ``eval.py``'s ``reorg_answer_file`` sorts and de-duplicates). Our own fields (the token
ids, the prefill time, the prompt length per turn) live under the extra key ``knapspec``,
which Spec-Bench's scripts never read.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

#: Our extra key in every answer line.
EXTRA = "knapspec"


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(value) for value in values)


def _optional_ints(values: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if values is None else _ints(values)


@attrs.frozen
class Turn:
    """One turn of one answer: what one timed ``generate`` call produced.

    Attributes:
        text: the decoded answer (special tokens dropped, stripped), as Spec-Bench stores it.
        new_tokens: tokens generated (EOS included when the call stopped on it).
        wall_time: seconds of the whole call (prefill, planning, drafting, verifying).
        decoding_steps: model calls after prefill (verify rounds of a speculative decoder).
        accept_lengths: tokens committed by each of those calls (bonus token included).
        prefill_time: seconds of the prefill (for ``model.generate``: its first forward).
        prompt_tokens: the turn's prompt length (chat template and earlier turns included).
        output_ids: the generated token ids (None in files that other tools wrote).
    """

    text: str
    new_tokens: int
    wall_time: float
    decoding_steps: int
    accept_lengths: tuple[int, ...] = attrs.field(converter=_ints)
    prefill_time: float | None = None
    prompt_tokens: int | None = None
    output_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_ints)

    @property
    def decode_time(self) -> float | None:
        """Wall time after the prefill (None when the prefill was not measured)."""
        return None if self.prefill_time is None else self.wall_time - self.prefill_time


def _turn_tuple(values: Iterable[Turn]) -> tuple[Turn, ...]:
    return tuple(values)


@attrs.frozen
class Answer:
    """One line of an answer file: a method's answer to one question (all its turns)."""

    question_id: int | str
    category: str
    model_id: str
    method: str
    turns: tuple[Turn, ...] = attrs.field(converter=_turn_tuple)
    answer_id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    tstamp: float = attrs.field(factory=time.time)

    @property
    def key(self) -> str:
        return str(self.question_id)

    def to_dict(self) -> dict[str, Any]:
        """The Spec-Bench line as a dict (``choices[0]`` holds the per-turn lists)."""
        turns = self.turns
        choice = {
            "index": 0,
            "turns": [turn.text for turn in turns],
            "decoding_steps": [turn.decoding_steps for turn in turns],
            "new_tokens": [turn.new_tokens for turn in turns],
            "wall_time": [turn.wall_time for turn in turns],
            "accept_lengths": [n for turn in turns for n in turn.accept_lengths],
        }
        extra = {
            "method": self.method,
            "accept_lengths_per_turn": [list(turn.accept_lengths) for turn in turns],
            "prefill_time": [turn.prefill_time for turn in turns],
            "prompt_tokens": [turn.prompt_tokens for turn in turns],
            "output_ids": [
                None if turn.output_ids is None else list(turn.output_ids) for turn in turns
            ],
        }
        return {
            "question_id": self.question_id,
            "category": self.category,
            "answer_id": self.answer_id,
            "model_id": self.model_id,
            "choices": [choice],
            "tstamp": self.tstamp,
            EXTRA: extra,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Answer:
        """Read a line we wrote, or one Spec-Bench wrote (then without our extra fields:
        accept lengths are not split by turn, so they all go to the first)."""
        choice = data["choices"][0]
        count = len(choice["turns"])
        extra = data.get(EXTRA) or {}
        per_turn = extra.get("accept_lengths_per_turn") or (
            [choice["accept_lengths"]] + [[] for _ in range(count - 1)]
        )
        nothing: list[Any] = [None] * count
        turns = [
            Turn(
                text=choice["turns"][i],
                new_tokens=int(choice["new_tokens"][i]),
                wall_time=float(choice["wall_time"][i]),
                decoding_steps=int(choice["decoding_steps"][i]),
                accept_lengths=per_turn[i],
                prefill_time=(extra.get("prefill_time") or nothing)[i],
                prompt_tokens=(extra.get("prompt_tokens") or nothing)[i],
                output_ids=(extra.get("output_ids") or nothing)[i],
            )
            for i in range(count)
        ]
        return cls(
            question_id=data["question_id"],
            category=data["category"],
            model_id=data["model_id"],
            method=extra.get("method", data["model_id"]),
            turns=turns,
            answer_id=data["answer_id"],
            tstamp=float(data["tstamp"]),
        )


def drop_partial_line(path: Path) -> bool:
    """Cut an unfinished last line (a run killed mid-write) so that appends stay one JSON
    object per line; returns whether something was cut."""
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    path.write_bytes(data[: data.rfind(b"\n") + 1])
    return True


def read_answers(path: Path) -> list[Answer]:
    """Every answer in ``path`` (none when it does not exist), in file order.

    Raises:
        ValueError: a complete line that is not an answer.
    """
    if not path.exists():
        return []
    answers = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                answers.append(Answer.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
                if not line.endswith("\n"):  # cut by an interrupt: resume re-runs it
                    break
                raise ValueError(f"{path}:{number}: not an answer line: {error}") from None
    return answers


def append_answer(path: Path, answer: Answer) -> None:
    """Append one line and flush it to disk: Ctrl-C keeps every finished answer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(answer.to_json() + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def reorg_answer_file(path: Path, order: Sequence[str] = ()) -> None:
    """Rewrite ``path`` with one line per question (the last written wins), questions in
    ``order`` first (their position there), the rest by id, as Spec-Bench's
    ``reorg_answer_file`` leaves its files; the rewrite is atomic."""
    answers = {answer.key: answer for answer in read_answers(path)}
    rank = {key: index for index, key in enumerate(order)}

    def sort_key(key: str) -> tuple[int, int, str]:
        numeric = int(key) if key.lstrip("-").isdigit() else 0
        return (rank.get(key, len(rank)), numeric, key)

    temporary = path.with_suffix(path.suffix + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for key in sorted(answers, key=sort_key):
            handle.write(answers[key].to_json() + "\n")
    os.replace(temporary, path)


@attrs.frozen
class Difference:
    """Where two answers to one question first differ."""

    question_id: str
    turn: int
    position: int
    detail: str


@attrs.frozen
class Equality:
    """Our ``equal``: answers of one method against a reference's, question by question.

    Attributes:
        compared: questions both files answered; equal: those with identical turns.
        differences: the first difference of every other question.
    """

    method: str
    reference: str
    compared: int
    equal: int
    differences: tuple[Difference, ...]

    @property
    def all_equal(self) -> bool:
        return self.compared > 0 and self.equal == self.compared


def _first_difference(key: str, mine: Answer, theirs: Answer) -> Difference | None:
    if len(mine.turns) != len(theirs.turns):
        return Difference(key, 0, 0, f"{len(mine.turns)} turns vs {len(theirs.turns)}")
    for index, (a, b) in enumerate(zip(mine.turns, theirs.turns, strict=True)):
        # Token ids when both files have them (two texts can decode alike), else the text.
        left: Sequence[Any] = a.text
        right: Sequence[Any] = b.text
        if a.output_ids is not None and b.output_ids is not None:
            left, right = a.output_ids, b.output_ids
        if list(left) != list(right):
            length = min(len(left), len(right))
            position = next((i for i in range(length) if left[i] != right[i]), length)
            unit = "token" if isinstance(left, tuple) else "character"
            detail = (
                f"{unit} {position}: {list(left[position : position + 3])} vs "
                f"{list(right[position : position + 3])} (lengths {len(left)} and {len(right)})"
            )
            return Difference(key, index, position, detail)
    return None


def compare_answers(
    answers: Sequence[Answer], reference: Sequence[Answer], method: str, reference_name: str
) -> Equality:
    """Compare ``answers`` with ``reference`` on the questions both hold."""
    theirs = {answer.key: answer for answer in reference}
    compared = equal = 0
    differences = []
    for answer in answers:
        other = theirs.get(answer.key)
        if other is None:
            continue
        compared += 1
        difference = _first_difference(answer.key, answer, other)
        if difference is None:
            equal += 1
        else:
            differences.append(difference)
    return Equality(method, reference_name, compared, equal, tuple(differences))


__all__ = [
    "EXTRA",
    "Answer",
    "Difference",
    "Equality",
    "Turn",
    "append_answer",
    "compare_answers",
    "drop_partial_line",
    "read_answers",
    "reorg_answer_file",
]
