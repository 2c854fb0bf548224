"""The throughput table: batched calls (``throughput.jsonl``) per batch size and method.

Per (scenario, N, B, method): the median [min-max] tokens/s over the pair rounds (new
tokens over all rows per second, prefill included), and per round the ratio of the
method's tokens/s to ``model.generate``'s and to our batched plain decoding's (``ar``) in
the same round, median [min-max]. Where the records time the rows' prefills (engine
methods, from this revision on), the table also gives the plain prefill's share of the
call and the decode phase's ratio to ``ar``'s (its seconds after the prefills, the same
tokens): what speculation gains where it acts, which a prefill-bound wall time hides.
``rows = ar`` counts the rows identical to plain
decoding's over all rounds (engine methods must match every row, or the run fails).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from knapspec.bench.markdown import markdown_table
from knapspec.bench.methods import GENERATE, REFERENCE
from knapspec.bench.report.stats import RunData, Spread


@attrs.frozen
class ThroughputRow:
    """One table row: a method at one scenario, length and batch size."""

    scenario: str
    context: int
    batch_size: int
    method: str
    calls: int
    prompt_tokens: float
    new_tokens: float
    tokens_per_second: Spread | None
    vs_generate: Spread | None
    vs_plain: Spread | None
    rows_equal: int
    rows: int
    drafted_tokens: int
    accepted_tokens: int
    prefill_share: Spread | None = None
    decode_vs_plain: Spread | None = None


def _decode_seconds(call: dict[str, Any]) -> float | None:
    prefill = call.get("prefill_seconds")
    return None if prefill is None else call["seconds"] - prefill


def _decode_ratios(mine: Sequence[dict[str, Any]], plain: dict[int, dict[str, Any]]) -> list[float]:
    """Per round, ``ar``'s decode-phase seconds over ``mine``'s (both timed)."""
    ratios = []
    for call in mine:
        reference = plain.get(call["pair"])
        theirs = _decode_seconds(reference) if reference is not None else None
        ours = _decode_seconds(call)
        if theirs is not None and ours is not None and ours > 0:
            ratios.append(theirs / ours)
    return ratios


def _ratios(mine: Sequence[dict[str, Any]], baseline: dict[int, float]) -> Iterable[float]:
    for call in mine:
        reference = baseline.get(call["pair"])
        if reference:
            yield call["tokens_per_second"] / reference


def _per_pair(by_method: dict[str, list[dict[str, Any]]], method: str) -> dict[int, float]:
    """``method``'s tokens/s per pair round."""
    return {call["pair"]: call["tokens_per_second"] for call in by_method.get(method, [])}


def summarise_throughput(data: RunData) -> list[ThroughputRow]:
    """One :class:`ThroughputRow` per (scenario, N, B, method), in run order."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for call in data.throughput:
        groups[(call["scenario"], call["context"], call["batch_size"])].append(call)
    result = []
    for (scenario, context, batch_size), calls in groups.items():
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for call in calls:
            by_method[call["method"]].append(call)

        generate, plain = _per_pair(by_method, GENERATE), _per_pair(by_method, REFERENCE)
        plain_calls = {call["pair"]: call for call in by_method.get(REFERENCE, [])}
        for method in data.methods():
            mine = by_method.get(method)
            if not mine:
                continue
            result.append(
                ThroughputRow(
                    scenario=scenario,
                    context=context,
                    batch_size=batch_size,
                    method=method,
                    calls=len(mine),
                    prompt_tokens=sum(sum(c["prompt_tokens"]) for c in mine) / len(mine),
                    new_tokens=sum(c["new_tokens"] for c in mine) / len(mine),
                    tokens_per_second=Spread.of(c["tokens_per_second"] for c in mine),
                    vs_generate=None if method == GENERATE else Spread.of(_ratios(mine, generate)),
                    vs_plain=None if method == REFERENCE else Spread.of(_ratios(mine, plain)),
                    rows_equal=sum(c["rows_equal"] for c in mine),
                    rows=sum(c["batch_size"] for c in mine),
                    drafted_tokens=sum(c["drafted_tokens"] for c in mine),
                    accepted_tokens=sum(c["accepted_tokens"] for c in mine),
                    prefill_share=Spread.of(
                        c["prefill_seconds"] / c["seconds"]
                        for c in mine
                        if c.get("prefill_seconds") is not None and c["seconds"] > 0
                    )
                    if method == REFERENCE
                    else None,
                    decode_vs_plain=None
                    if method == REFERENCE
                    else Spread.of(_decode_ratios(mine, plain_calls)),
                )
            )
    return result


def throughput_table(data: RunData) -> str:
    """Markdown: tokens/s per method and batch size, with the ratios to ``model.generate``
    and to our batched plain decoding."""
    header = [
        "scenario",
        "N",
        "B",
        "method",
        "new tokens (all rows)",
        "tok/s",
        "vs model.generate",
        "vs plain batch (ar)",
        "decode phase vs ar",
        "prefill share (ar)",
        "rows = ar",
        "drafted / accepted",
    ]

    def spread(value: Spread | None) -> str:
        return value.text() if value is not None else "–"

    rows = []
    for row in summarise_throughput(data):
        cells = [
            row.scenario,
            str(row.context),
            str(row.batch_size),
            row.method,
            f"{row.new_tokens:.0f}",
            spread(row.tokens_per_second),
            spread(row.vs_generate),
            spread(row.vs_plain),
            spread(row.decode_vs_plain),
            _share(row.prefill_share),
            f"{row.rows_equal}/{row.rows}",
            f"{row.drafted_tokens} / {row.accepted_tokens}" if row.method != GENERATE else "–",
        ]
        rows.append(cells)
    return markdown_table(header, rows)


def _share(value: Spread | None) -> str:
    return f"{100 * value.median:.0f} %" if value is not None else "–"


__all__ = ["ThroughputRow", "summarise_throughput", "throughput_table"]
