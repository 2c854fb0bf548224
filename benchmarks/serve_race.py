"""The client side of ``serve_load.py``'s race: one server process's passes.

For one server just started (:func:`race_one_server`): a warm-up on a question no pass asks,
then every cold pass (mode x concurrency) on its own slice of the question set
(:func:`knapspec.bench.race.plan_slices`; a guard refuses a question the process has seen),
each with its throughput, latency at p50 / p95 / p99 and the prefix-cache tokens the
server's ``/metrics`` counted during it. Only then, after every cold pass, the passes where
repeats are the point, each labelled as such: ``shared-prefix`` re-asks one cold pass's
greedy questions (its answers must equal the cold ones), and ``shared-prefix-document``
times the first token of a question about a document cold and then warm. Last, untimed, a
few questions of each loaded pass are asked again alone (one at a time, the same sampling
seed): an answer under load must equal the answer alone (``differ_from_alone``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any, Protocol

import openai

from knapspec.bench.race import (
    chunk_gaps,
    counter_delta,
    latency_summary,
    percentile,
    prefix_cache_counts,
)

QUESTIONS = Path(__file__).resolve().parents[1] / "src/knapspec/data/spec_bench/questions-dev.jsonl"


class RaceServer(Protocol):
    """What the race needs of a started server (``serve_load.Server``)."""

    url: str
    model: str

    def counters(self) -> dict[str, float]: ...

    def rss_mib(self) -> float: ...


def first_turns() -> list[str]:
    """The first turns of the Spec-Bench questions shipped with knapspec, in file order."""
    lines = QUESTIONS.read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def slice_digest(questions: Sequence[str]) -> str:
    """A short hash of a slice: equal across systems and repeats by construction."""
    return hashlib.sha256("\x00".join(questions).encode()).hexdigest()[:12]


def sampling_for(mode: str, index: int) -> dict[str, Any]:
    """Greedy, or T = 0.7 / top-p 0.9 with a seed per question (so an answer repeats)."""
    if mode == "sampled":
        return {"temperature": 0.7, "top_p": 0.9, "seed": 1000 + index}
    return {"temperature": 0}


async def ask(
    client: openai.AsyncOpenAI,
    model: str,
    question: str,
    max_tokens: int,
    sampling: Mapping[str, Any],
    count_tokens: Callable[[str], int],
) -> dict[str, Any]:
    """One streamed chat completion: its text, output tokens, TTFT, and per gap between
    content chunks the gap and the gap over the tokens of the chunk that ended it."""
    started = time.perf_counter()
    arrivals: list[float] = []
    parts: list[str] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                parts.append(chunk.choices[0].delta.content)
    except openai.APIError as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:300]}
    tokens = usage.completion_tokens if usage is not None else len(parts)
    gaps, token_gaps = chunk_gaps(arrivals, [count_tokens(p) for p in parts])
    return {
        "ok": True,
        "text": "".join(parts),
        "tokens": tokens,
        "chunks": len(parts),
        "ttft": arrivals[0] - started if arrivals else float("nan"),
        # Per request: first to last chunk over the tokens after the first (vLLM's TPOT).
        "itl": (arrivals[-1] - arrivals[0]) / (tokens - 1)
        if len(arrivals) > 1 and tokens > 1
        else float("nan"),
        "gaps": gaps,
        "token_gaps": token_gaps,
    }


async def timed_pass(
    client: openai.AsyncOpenAI,
    server: RaceServer,
    questions: Sequence[str],
    mode: str,
    concurrency: int,
    args: Any,
    count_tokens: Callable[[str], int],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``questions`` through ``concurrency`` clients; (the pass's record, its answers)."""
    gate = asyncio.Semaphore(concurrency)

    async def bounded(index: int, question: str) -> dict[str, Any]:
        async with gate:
            return await ask(
                client,
                server.model,
                question,
                args.max_tokens,
                sampling_for(mode, index),
                count_tokens,
            )

    rss_before = server.rss_mib()
    before = server.counters()
    started = time.perf_counter()
    results = await asyncio.gather(*(bounded(i, q) for i, q in enumerate(questions)))
    wall = time.perf_counter() - started
    delta = counter_delta(before, server.counters())
    done = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in done)
    record: dict[str, Any] = {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(questions),
        "slice_sha": slice_digest(questions),
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        **latency_summary(
            [r["ttft"] for r in done],
            [g for r in done for g in r["gaps"]],
            [g for r in done for g in r["token_gaps"]],
        ),
        "itl_p50_s": percentile([r["itl"] for r in done], 0.5),
        "itl_p95_s": percentile([r["itl"] for r in done], 0.95),
        "chunks_per_request": statistics.fmean(r["chunks"] for r in done) if done else None,
        "failures": len(results) - len(done),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        **prefix_cache_counts(delta),
        "server_rss_mib": [rss_before, server.rss_mib()],
    }
    if "knapspec_step_seconds_sum" in delta:
        # Where a knapspec server's wall time went: batched rounds, prefills, the rest
        # (HTTP, detokenising, scheduling, waiting for clients).
        step, prefill = delta["knapspec_step_seconds_sum"], delta["knapspec_prefill_seconds_sum"]
        record |= {
            "server_step_s": step,
            "server_steps": int(delta["knapspec_step_seconds_count"]),
            "server_prefill_s": prefill,
            "server_other_s": wall - step - prefill,
        }
    return record, list(results)


class SeenGuard:
    """The questions one server process has been asked: a timed cold pass must ask none
    of them again (the race's promise, checked where it is kept)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def take(self, questions: Sequence[str]) -> None:
        repeated = [q for q in questions if q in self.seen]
        if repeated or len(set(questions)) < len(questions):
            raise RuntimeError(f"a cold pass would repeat a question: {repeated[:1]!r}")
        self.seen.update(questions)


async def race_one_server(
    server: RaceServer,
    warmup: str,
    passes: Sequence[tuple[str, int, list[str]]],
    args: Any,
    count_tokens: Callable[[str], int],
) -> list[dict[str, Any]]:
    """Every pass of one fresh server process (see the module docstring); the records."""
    records: list[dict[str, Any]] = []
    answers: dict[tuple[str, int], list[dict[str, Any]]] = {}
    guard = SeenGuard()
    # Closed inside the event loop (left to the garbage collector, its connections are
    # closed after asyncio.run's loop and print "Event loop is closed" tracebacks).
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600
    ) as client:
        guard.take([warmup])
        await ask(client, server.model, warmup, 16, {"temperature": 0}, count_tokens)
        for mode, concurrency, questions in passes:
            guard.take(questions)
            record, results = await timed_pass(
                client, server, questions, mode, concurrency, args, count_tokens
            )
            records.append({"pass": "cold", **record})
            answers[(mode, concurrency)] = results
            _print(records[-1])
        # Repeats on purpose from here on: every cold pass is done.
        shared = [p for p in passes if p[0] == "greedy" and p[1] == args.shared_prefix_concurrency]
        for mode, concurrency, questions in shared:
            record, results = await timed_pass(
                client, server, questions, mode, concurrency, args, count_tokens
            )
            cold = answers[(mode, concurrency)]
            record["differ_from_cold"] = sum(
                1 for a, b in zip(results, cold, strict=True) if a.get("text") != b.get("text")
            )
            records.append({"pass": "shared-prefix", **record})
            _print(records[-1])
        if args.prefix_pairs:
            records.append(await document_ttft(client, server, args, count_tokens))
        # Untimed: a few answers of each loaded pass asked again alone.
        for record, (mode, concurrency, questions) in zip(records, passes, strict=False):
            if concurrency == 1 or not args.check:
                continue
            loaded = answers[(mode, concurrency)]
            differ = 0
            for index, question in enumerate(questions[: args.check]):
                alone = await ask(
                    client,
                    server.model,
                    question,
                    args.max_tokens,
                    sampling_for(mode, index),
                    count_tokens,
                )
                differ += loaded[index].get("text") != alone.get("text")
            record["compared_with_alone"] = min(args.check, len(questions))
            record["differ_from_alone"] = differ
    return records


async def document_ttft(
    client: openai.AsyncOpenAI, server: RaceServer, args: Any, count_tokens: Callable[[str], int]
) -> dict[str, Any]:
    """Time to first token of a question about a ~2,200-token document, cold (a document
    the server has not seen: a fresh first line) and warm (the same document, another
    question: its prefix is cached), one request at a time."""
    chapter = files("knapspec").joinpath("data/pride_and_prejudice_chapter3.txt").read_text()
    cold: list[float] = []
    warm: list[float] = []
    before = server.counters()
    for pair in range(args.prefix_pairs):
        document = f"Document {pair} ({time.time_ns()}):\n\n{chapter}\n\n"
        for question, times in (
            ("Who arrives at the ball?", cold),
            ("What does Mr. Darcy say about Elizabeth?", warm),
        ):
            result = await ask(
                client, server.model, document + question, 8, {"temperature": 0}, count_tokens
            )
            times.append(result.get("ttft", float("nan")))
    cold_median, warm_median = statistics.median(cold), statistics.median(warm)
    print(
        f"  shared document: TTFT cold {cold_median:.3f} s, warm {warm_median:.3f} s",
        file=sys.stderr,
    )
    return {
        "pass": "shared-prefix-document",
        "mode": "greedy",
        "concurrency": 1,
        "document_chars": len(chapter),
        "pairs": args.prefix_pairs,
        "ttft_cold_s": cold,
        "ttft_warm_s": warm,
        "warm_over_cold": warm_median / cold_median if cold_median > 0 else None,
        **prefix_cache_counts(counter_delta(before, server.counters())),
    }


def _print(record: Mapping[str, Any]) -> None:
    def ms(key: str) -> str:
        value = record.get(key)
        return "-" if value is None else f"{1000 * value:.0f}"

    print(
        f"  {record['pass']:13s} {record['mode']:8s} C={record['concurrency']:<3d} "
        f"{record['output_tokens_per_s']:7.1f} tok/s  TTFT p95 {ms('ttft_p95_s')} ms  "
        f"gap p50/p95/p99 {ms('gap_p50_s')}/{ms('gap_p95_s')}/{ms('gap_p99_s')} ms  "
        f"prefix hits {record['prefix_cache_hit_tokens']}/{record['prefix_cache_queried_tokens']}"
        f"  failures {record['failures']}",
        file=sys.stderr,
    )
