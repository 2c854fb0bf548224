"""Result records of a benchmark run and the files they live in.

A run directory ``results/bench/<run-name>/`` holds:

* ``run.json`` — options, the exact command, the environment (commit, versions, threads,
  model, dtype, cache type) and whether the run completed;
* ``raw.jsonl`` — one line per timed ``generate`` call (:class:`RunRecord`), with the
  Spec-Bench fields ``new_tokens``, ``wall_time``, ``accept_lengths``, ``decoding_steps``;
* ``setup.jsonl`` — one-time set-up per method (decoder build, profiling, plan freezing),
  never part of a timed call;
* ``oracle.jsonl`` — the frontier per scenario and context (:mod:`knapspec.bench.oracle`);
* ``vcurve.jsonl`` — v(k) through the engine and through the HF forward;
* ``throughput.jsonl`` — one line per timed batched call of a throughput scenario
  (:class:`~knapspec.bench.throughput.ThroughputRecord`).

A run that fails its losslessness check leaves ``raw.jsonl`` renamed to
``raw.failed.jsonl``, so no report is ever drawn from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

RAW = "raw.jsonl"
FAILED_RAW = "raw.failed.jsonl"
RUN_INFO = "run.json"
SETUP = "setup.jsonl"
ORACLE = "oracle.jsonl"
VCURVE = "vcurve.jsonl"
THROUGHPUT = "throughput.jsonl"


class LosslessnessError(RuntimeError):
    """A greedy method's output differs from plain decoding: a bug, never a result."""


@attrs.frozen
class RunRecord:
    """One timed ``generate`` call.

    Attributes:
        scenario, method, prompt_id: what ran. ``role`` is ``"reference"`` for the AR
            calls every method is paired with, ``"method"`` otherwise.
        pair: the pair round (0 .. pairs-1); ``position``: order of the call in the round.
        context: nominal prompt length N; context_length: actual prompt tokens.
        new_tokens, wall_time, accept_lengths, decoding_steps: Spec-Bench's fields
            (``wall_time`` is the whole call in seconds, prefill and planning included).
        tokens_per_second: ``new_tokens / wall_time``.
        acceptance_rate: accepted draft tokens / drafted tokens.
        mean_accepted_length: tokens per verify round, bonus token included.
        prefill_seconds, plan_seconds, draft_seconds, verify_seconds: the time split.
        plans: the plans used (``GenerationStats.plans``) as dicts.
        reference_tokens_per_second: mean tokens/s of the AR calls just before and after
            this call (the pair's reference); speedup_vs_ar: the ratio of the two.
        lossless: greedy output equal to AR's (None for sampled scenarios).
        lookup_seconds: time spent proposing prompt-lookup drafts (planning overhead).
        drafters: per drafter (``"subnetwork"``, ``"lookup"``, ``"none"`` for plain
            steps) its ``rounds``, ``drafted`` and ``accepted`` tokens.
        sampling: the sampling parameters; seed: the call's sampling seed.
    """

    scenario: str
    method: str
    role: str
    prompt_id: str
    pair: int
    position: int
    context: int
    context_length: int
    new_tokens: int
    wall_time: float
    accept_lengths: list[int]
    decoding_steps: int
    tokens_per_second: float
    acceptance_rate: float
    mean_accepted_length: float
    drafted_tokens: int
    accepted_tokens: int
    prefill_seconds: float
    plan_seconds: float
    draft_seconds: float
    verify_seconds: float
    plans: list[dict[str, Any]]
    sampling: dict[str, Any]
    seed: int | None
    reference_tokens_per_second: float | None = None
    speedup_vs_ar: float | None = None
    lossless: bool | None = None
    lookup_seconds: float = 0.0
    drafters: dict[str, dict[str, int]] = attrs.field(factory=dict)

    def to_json(self, extra: dict[str, Any]) -> str:
        """One JSON line; ``extra`` (run name, environment) is merged in."""
        data = attrs.asdict(self)
        data.update(question_id=self.prompt_id, model_id=self.method)  # Spec-Bench keys
        data.update(extra)
        return json.dumps(data)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSON-lines file (none when it does not exist)."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: invalid JSON line: {error}") from None


def append_jsonl(path: Path, line: str) -> None:
    """Append one line and flush, so an interrupted run keeps what it measured."""
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line.rstrip("\n") + "\n")


__all__ = [
    "FAILED_RAW",
    "ORACLE",
    "RAW",
    "RUN_INFO",
    "SETUP",
    "THROUGHPUT",
    "VCURVE",
    "LosslessnessError",
    "RunRecord",
    "append_jsonl",
    "read_jsonl",
]
