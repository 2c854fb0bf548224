"""The bookkeeping of a fair serving race (``benchmarks/serve_load.py``): which questions each
timed pass asks, in which order the systems run, and how the repeats are summarised.

A server with a prefix cache answers a prompt it has seen faster than a new one, so a race
that asks the same prompts in every pass measures the cache, not the server. Here every
pass of one server process gets its own slice of the question set, disjoint from the others
and from the warm-up question (:func:`plan_slices`); a fresh server process per system and
repeat makes the slices the same for every system. The systems run in an order that
rotates from repeat to repeat (:func:`rotation`), so that a slow spell of a shared machine
weighs on all of them alike, and each figure is reported as the median of the repeats with
its min-max (:func:`spread`).

Latency per pass (:func:`latency_summary`): time to first token, the gap between
streamed chunks (what a reader of the stream waits for) and the gap over the tokens the
later chunk carries (a speculative server sends several tokens at once), each at p50, p95
and p99.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

#: The percentiles every latency is reported at.
QUANTILES = (0.5, 0.95, 0.99)
#: The per-pass fields a race's summary gives as median and min-max over the repeats.
SUMMARY_FIELDS = (
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "gap_p50_s",
    "gap_p95_s",
    "gap_p99_s",
    "token_gap_p50_s",
    "token_gap_p95_s",
    "token_gap_p99_s",
    "prefix_cache_hit_rate",
    "differ_from_alone",
    "failures",
)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of the finite ``values``; None if none."""
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return None
    return finite[min(len(finite) - 1, round(q * (len(finite) - 1)))]


def distinct(questions: Sequence[str]) -> list[str]:
    """``questions`` without repeats (first occurrence kept), in order."""
    return list(dict.fromkeys(questions))


def plan_slices(
    questions: Sequence[str], sizes: Sequence[int], *, reserve: int = 1, seed: int = 0
) -> tuple[list[str], list[list[str]]]:
    """Disjoint slices of ``questions``: ``reserve`` of them (a warm-up), then one slice of
    ``sizes[i]`` questions per timed pass ``i``.

    The questions are shuffled with ``seed`` first (a question file grouped by category
    then gives every slice a mix of categories) and deduplicated, so that no text appears
    in two slices. The same arguments give the same slices: every system and repeat asks
    the same questions in the same pass.

    Returns:
        (reserved, slices) with ``len(slices[i]) == sizes[i]``.

    Raises:
        ValueError: a size is negative, or the set holds fewer distinct questions than
            ``reserve + sum(sizes)`` (a slice would have to repeat one).
    """
    if reserve < 0 or any(size < 0 for size in sizes):
        raise ValueError(f"sizes must be >= 0, got reserve={reserve}, sizes={list(sizes)}")
    pool = distinct(questions)
    random.Random(seed).shuffle(pool)
    needed = reserve + sum(sizes)
    if needed > len(pool):
        raise ValueError(
            f"the passes need {needed} distinct questions (warm-up {reserve} + passes "
            f"{list(sizes)}), the set has {len(pool)}: fewer passes, requests or clients"
        )
    reserved, start = pool[:reserve], reserve
    slices = []
    for size in sizes:
        slices.append(pool[start : start + size])
        start += size
    return reserved, slices


def rotation(systems: Sequence[str], repeat: int) -> list[str]:
    """The order the systems run in at ``repeat`` (0-based): rotated by one each repeat,
    so that each system runs first, second, ... equally often over ``len(systems)``
    repeats."""
    if not systems:
        return []
    shift = repeat % len(systems)
    return [*systems[shift:], *systems[:shift]]


def chunk_gaps(arrivals: Sequence[float], chunk_tokens: Sequence[int]) -> tuple[list[float], ...]:
    """The gaps between consecutive streamed chunks and each gap over the tokens of the
    chunk that ended it.

    Args:
        arrivals: ``(chunks,)`` arrival times of a stream's content chunks, in seconds.
        chunk_tokens: ``(chunks,)`` tokens each chunk carries (a count below 1 counts as 1).

    Returns:
        (gaps, per-token gaps), each ``(chunks - 1,)``.
    """
    if len(arrivals) != len(chunk_tokens):
        raise ValueError(f"{len(arrivals)} arrivals but {len(chunk_tokens)} token counts")
    gaps = [b - a for a, b in pairwise(arrivals)]
    per_token = [gap / max(1, n) for gap, n in zip(gaps, chunk_tokens[1:], strict=True)]
    return gaps, per_token


def latency_summary(
    ttfts: Sequence[float], gaps: Sequence[float], per_token_gaps: Sequence[float]
) -> dict[str, float | None]:
    """``ttft_p50_s`` ... ``gap_p99_s`` ... ``token_gap_p99_s`` over a pass's requests
    (TTFTs) and chunks (gaps) at :data:`QUANTILES`."""
    out: dict[str, float | None] = {}
    for name, values in (("ttft", ttfts), ("gap", gaps), ("token_gap", per_token_gaps)):
        for q in QUANTILES:
            out[f"{name}_p{round(100 * q)}_s"] = percentile(values, q)
    return out


def spread(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """Median, min and max of the repeats' ``values`` (None ones left out) and their count."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": statistics.median(finite),
        "min": min(finite),
        "max": max(finite),
        "n": len(finite),
    }


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` per counter (a counter absent before counts from 0)."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def prefix_cache_counts(delta: Mapping[str, float]) -> dict[str, float | None]:
    """Prompt tokens queried and taken from the prefix cache during a pass, from the
    change of a server's ``/metrics`` counters: knapspec's ``knapspec_prompt_tokens_total``
    and ``knapspec_cached_prompt_tokens_total``, or vLLM's ``vllm:prefix_cache_queries_total``
    and ``vllm:prefix_cache_hits_total`` (both in tokens). None where the server reports
    neither (a server without ``/metrics``)."""
    pairs = (
        ("knapspec_prompt_tokens_total", "knapspec_cached_prompt_tokens_total"),
        ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    )
    for queried, hit in pairs:
        if queried in delta and hit in delta:
            rate = delta[hit] / delta[queried] if delta[queried] else None
            return {
                "prefix_cache_queried_tokens": delta[queried],
                "prefix_cache_hit_tokens": delta[hit],
                "prefix_cache_hit_rate": rate,
            }
    return {
        "prefix_cache_queried_tokens": None,
        "prefix_cache_hit_tokens": None,
        "prefix_cache_hit_rate": None,
    }


def summarise_race(
    records: Sequence[Mapping[str, Any]], fields: Sequence[str] = SUMMARY_FIELDS
) -> list[dict[str, Any]]:
    """One row per (pass name, mode, concurrency, system) of the race's per-pass
    ``records``: each of ``fields`` as :func:`spread` over the repeats."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for record in records:
        key = (record["pass"], record["mode"], record["concurrency"], record["system"])
        groups.setdefault(key, []).append(record)
    rows = []
    for (name, mode, concurrency, system), group in groups.items():
        row: dict[str, Any] = {
            "pass": name,
            "mode": mode,
            "concurrency": concurrency,
            "system": system,
            "repeats": len(group),
        }
        for field in fields:
            row[field] = spread([r.get(field) for r in group])
        rows.append(row)
    return rows


#: The ratios a race reports, (numerator, denominator, what the ratio shows): the lead of
#: knapspec's server over vLLM's splits into its engine's and its speculation's.
RATIOS = (
    ("knapspec", "vllm", "knapspec over vLLM"),
    ("knapspec-ar", "vllm", "engine: knapspec's autoregressive server over vLLM"),
    ("knapspec", "knapspec-ar", "speculation: knapspec over its autoregressive server"),
    ("knapspec", "vllm-ngram", "knapspec over vLLM n-gram"),
    ("vllm-ngram", "vllm", "vLLM's n-gram over vLLM"),
)


def paired_ratios(
    records: Sequence[Mapping[str, Any]],
    pairs: Sequence[tuple[str, str, str]] = RATIOS,
    field: str = "output_tokens_per_s",
) -> list[dict[str, Any]]:
    """Per (pass, mode, concurrency) and pair of systems, ``field`` of the first over the
    second within each repeat (both ran in the same round of the rotation), as
    :func:`spread` over the repeats; pairs with a system missing are left out."""
    by_key: dict[tuple[Any, ...], float] = {}
    for r in records:
        if r.get(field) is not None:
            key = (r["pass"], r["mode"], r["concurrency"], r["repeat"], r["system"])
            by_key[key] = r[field]
    cells = dict.fromkeys((k[0], k[1], k[2]) for k in by_key)
    repeats = sorted({k[3] for k in by_key})
    rows = []
    for name, mode, concurrency in cells:
        for top, bottom, meaning in pairs:
            values = [
                by_key[(name, mode, concurrency, r, top)]
                / by_key[(name, mode, concurrency, r, bottom)]
                for r in repeats
                if (name, mode, concurrency, r, top) in by_key
                and by_key.get((name, mode, concurrency, r, bottom))
            ]
            if values:
                rows.append(
                    {
                        "pass": name,
                        "mode": mode,
                        "concurrency": concurrency,
                        "ratio": f"{top} / {bottom}",
                        "meaning": meaning,
                        "field": field,
                        "value": spread(values),
                        "values": values,
                    }
                )
    return rows


def _cell(value: Mapping[str, Any], scale: float = 1.0, digits: int = 1) -> str:
    """``median (min-max)`` of a :func:`spread`, scaled; ``-`` when empty."""
    if value.get("median") is None:
        return "-"
    median, low, high = (scale * value[k] for k in ("median", "min", "max"))
    if value["n"] == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def race_report(lines: Sequence[Mapping[str, Any]], run: str | None = None) -> str:
    """Markdown tables of one run's ``summary`` lines (the last run by default): per pass
    and mode, a row per system and concurrency with throughput and latency as median
    (min-max) over the repeats, the prefix-cache hit rate and answers that differ alone."""
    summaries = [r for r in lines if r.get("kind") == "summary"]
    if run is None and summaries:
        run = summaries[-1]["run"]
    rows = [r for r in summaries if r["run"] == run]
    if not rows:
        return f"no summary lines of run {run!r}"
    head = rows[0]
    out = [
        f"Run {run}: {head.get('host_cpu')} ({', '.join(head.get('cpu_flags', []))}), "
        f"{head.get('threads')} threads, commit {head.get('commit')}, "
        f"repeats {max(r['repeats'] for r in rows)}; median (min-max) over the repeats.",
    ]
    for name in dict.fromkeys(r["pass"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["pass"] == name):
            out += [
                "",
                f"**{name}, {mode}**",
                "",
                "| system | C | output tok/s | TTFT p50 / p95 / p99 s | chunk gap p50 / p95 / "
                "p99 ms | per-token gap p50 / p95 / p99 ms | prefix-cache hit rate | "
                "differ alone |",
                "|---|---|---|---|---|---|---|---|",
            ]
            chosen = [r for r in rows if r["pass"] == name and r["mode"] == mode]
            for r in sorted(chosen, key=lambda r: (r["concurrency"], r["system"])):
                ttft = " / ".join(_cell(r[f"ttft_p{q}_s"], 1, 2) for q in (50, 95, 99))
                gap = " / ".join(_cell(r[f"gap_p{q}_s"], 1000, 0) for q in (50, 95, 99))
                token = " / ".join(_cell(r[f"token_gap_p{q}_s"], 1000, 0) for q in (50, 95, 99))
                out.append(
                    f"| {r['system']} | {r['concurrency']} | {_cell(r['output_tokens_per_s'])} "
                    f"| {ttft} | {gap} | {token} | {_cell(r['prefix_cache_hit_rate'], 1, 2)} "
                    f"| {_cell(r['differ_from_alone'], 1, 0)} |"
                )
    ratios = [r for r in lines if r.get("kind") == "ratio" and r.get("run") == run]
    if ratios:
        out += [
            "",
            "**Ratios of output tokens/s within each repeat** (median (min-max))",
            "",
            "| pass, mode | C | ratio | what it shows | value |",
            "|---|---|---|---|---|",
        ]
        for r in ratios:
            out.append(
                f"| {r['pass']}, {r['mode']} | {r['concurrency']} | {r['ratio']} | "
                f"{r['meaning']} | {_cell(r['value'], 1, 2)} |"
            )
    return "\n".join(out)


__all__ = [
    "QUANTILES",
    "RATIOS",
    "SUMMARY_FIELDS",
    "chunk_gaps",
    "counter_delta",
    "distinct",
    "latency_summary",
    "paired_ratios",
    "percentile",
    "plan_slices",
    "prefix_cache_counts",
    "race_report",
    "rotation",
    "spread",
    "summarise_race",
]
