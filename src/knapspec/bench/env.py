"""The environment a benchmark ran in, recorded with every result line."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import transformers

import knapspec
from knapspec.model.machine import machine_description


def git_commit() -> str:
    """Current commit (with ``-dirty`` when the tree has changes), or ``unknown``."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(model: Any, threads: int) -> dict[str, Any]:
    """Model, dtype, device, threads, versions and commit for a results line."""
    parameter = next(model.parameters())
    device = parameter.device
    return {
        "model": str(getattr(model.config, "_name_or_path", type(model).__name__)).rsplit("/", 1)[
            -1
        ],
        "dtype": str(parameter.dtype).replace("torch.", ""),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": threads,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "cache": "knapspec-preallocated (engine) / DynamicCache (model.generate)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "knapspec": getattr(knapspec, "__version__", "0"),
        "commit": git_commit(),
        "python": platform.python_version(),
        # The same kernels run 2x faster or slower on another x86 CPU: name it, its vector
        # flags and the BLAS (the kernel table is added where an engine is built).
        **machine_description(),
    }


#: Run by ``vllm_build`` in vLLM's interpreter (its own venv: nothing of it is imported here).
_VLLM_BUILD_PROBE = """
import importlib.metadata as m, json
out = {}
for d in m.distributions():
    name = d.metadata["Name"] or ""
    if name.lower().replace("_", "-").startswith("vllm"):
        wheel = d.read_text("WHEEL") or ""
        tags = [x.split(":", 1)[1].strip() for x in wheel.splitlines() if x.startswith("Tag:")]
        out.update(distribution=name, version=d.version, wheel_tags=tags)
try:
    import torch
    capability = torch.backends.cpu.get_cpu_capability()
    out.update(torch=torch.__version__, torch_cpu_capability=capability)
except Exception as error:
    out.update(torch_error=str(error))
print(json.dumps(out))
"""


def vllm_build(python: str | Path) -> dict[str, Any]:
    """The vLLM distribution in ``python``'s environment: name, version, wheel tags, and
    the CPU capability its torch runs with (the ISA its kernels use)."""
    try:
        done = subprocess.run(
            [str(python), "-c", _VLLM_BUILD_PROBE], capture_output=True, text=True, check=False
        )
    except OSError as error:  # no such interpreter
        return {"error": str(error)}
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": done.stderr[-500:]}


def kernel_record(engine: Any) -> dict[str, Any]:
    """The engine's kernel table for a results line: its fingerprint and where it came from
    (the full table goes to ``setup.jsonl``)."""
    from knapspec.model.tuning.prefill import describe

    prefill = sorted(set(describe(getattr(engine, "_prefill_large", {})).values()))
    return {
        "kernel_table": engine.kernels.fingerprint(),
        "kernel_source": engine.kernels.source,
        # A cold prefill's many-row products (knapspec.model.tuning.prefill).
        "prefill_kernels": prefill or ["f.linear"],
    }
