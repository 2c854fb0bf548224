"""Run data and its statistics: loading a run directory, per-method summaries and the
calls that may be pooled across runs.

Speedups are medians of per-pair ratios with their min-max range:

* vs AR: each call's ``speedup_vs_ar`` (its tokens/s over the mean of the AR calls just
  before and after it);
* vs ``model.generate``: per (prompt, pair round), the method's tokens/s over
  ``model.generate``'s in the same round (AR's row uses the reference calls of the round).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from knapspec.bench.methods import GENERATE, REFERENCE
from knapspec.bench.records import (
    FAILED_RAW,
    ORACLE,
    RAW,
    RUN_INFO,
    SETUP,
    THROUGHPUT,
    VCURVE,
    read_jsonl,
)

#: Oracle speedups at or below this are "nothing to win": no share of it is reported.
ORACLE_SHARE_THRESHOLD = 1.1


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
    """Everything a run directory holds (``throughput``: the batched calls of throughput
    scenarios)."""

    run_dir: Path
    info: dict[str, Any]
    raw: list[dict[str, Any]]
    setup: list[dict[str, Any]]
    oracle: list[dict[str, Any]]
    vcurve: list[dict[str, Any]]
    throughput: list[dict[str, Any]] = attrs.field(factory=list)

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """Read a run directory.

        Raises:
            ReportError: no such directory, a failed run, or no results (neither single
                calls nor batched ones).
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
        throughput = list(read_jsonl(run_dir / THROUGHPUT))
        if not raw and not throughput:
            raise ReportError(f"{run_dir}: no results in {RAW} or {THROUGHPUT}")
        return cls(
            run_dir,
            info,
            raw,
            list(read_jsonl(run_dir / SETUP)),
            list(read_jsonl(run_dir / ORACLE)),
            list(read_jsonl(run_dir / VCURVE)),
            throughput,
        )

    def methods(self) -> list[str]:
        listed = [m["name"] for m in self.info.get("methods", [])]
        seen = list(dict.fromkeys(row["method"] for row in [*self.raw, *self.throughput]))
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


def run_name(data: RunData) -> str:
    """The run's name (its directory's name when ``run.json`` does not say)."""
    return str(data.info.get("run_name", data.run_dir.name))


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


__all__ = [
    "ORACLE_SHARE_THRESHOLD",
    "MethodRow",
    "ReportError",
    "RunData",
    "Spread",
    "comparable_calls",
    "run_name",
    "summarise",
]
