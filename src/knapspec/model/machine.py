"""What a timing depends on besides the model: the host CPU, its instruction set and the BLAS.

Kernel tables (:mod:`knapspec.model.tuning.autotune`) and latency profiles
(:mod:`knapspec.costmodels.profile`) are keyed by these, and every benchmark records them:
the same few-row product computed one way is faster on one x86 CPU and slower on another
(``results/engine/HISTORY.md``, "Figures behind docstrings").
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re

import torch

#: Instruction-set flags worth reading in a report (the full list is hashed into the keys).
_NOTABLE_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
)


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def host_cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo`` on Linux, else :mod:`platform`)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


#: Environment variable that claims CPU flags in place of ``/proc/cpuinfo``'s (space or
#: comma separated), so that anyone can run the suite's dtype and kernel decisions as a
#: CPU with other units would (``pytest --cpu-flags``, ``nox -s amx``; docs/extending.md).
CPU_FLAGS_ENV = "KNAPSPEC_CPU_FLAGS"


@functools.cache
def _reported_cpu_flags() -> tuple[str, ...]:
    flags = _cpuinfo_field("flags") or _cpuinfo_field("features") or ""
    return tuple(sorted(set(flags.split())))


def host_cpu_flags() -> tuple[str, ...]:
    """The CPU's feature flags, sorted: ``$KNAPSPEC_CPU_FLAGS`` where set (a claim, for
    tests), else ``/proc/cpuinfo``'s (empty where it is unavailable)."""
    claimed = os.environ.get(CPU_FLAGS_ENV)
    if claimed is not None:
        return tuple(sorted(set(claimed.replace(",", " ").split())))
    return _reported_cpu_flags()


def claimed_absent(*flags: str) -> bool:
    """Whether ``$KNAPSPEC_CPU_FLAGS`` claims a CPU that lacks one of ``flags``. A claim
    takes units away from this CPU, so that its kernel choices run as that CPU's would; it
    never adds any (a kernel for units the host lacks cannot run here)."""
    claimed = os.environ.get(CPU_FLAGS_ENV)
    if claimed is None:
        return False
    return not set(flags) <= set(claimed.replace(",", " ").split())


#: The flags each compiled unit needs, as ``lscpu`` names them.
AMX_TILE_FLAGS = ("amx_tile", "amx_bf16")
AVX512_BF16_FLAGS = ("avx512_bf16",)

#: The vector and matrix flags of the CPU classes knapspec is measured on, to claim with
#: ``$KNAPSPEC_CPU_FLAGS`` (``nox -s amx``, ``zen4``, ``avx2``; the noxfile keeps a copy).
CPU_CLASSES: dict[str, str] = {
    "xeon-amx": (
        "avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"
    ),
    "zen4": "avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni",
    "zen3-avx2": "avx avx2 fma f16c",
}


def notable_cpu_flags() -> tuple[str, ...]:
    """The vector-instruction flags among :func:`host_cpu_flags` (AVX2, AVX-512, AMX...)."""
    flags = set(host_cpu_flags())
    return tuple(flag for flag in _NOTABLE_FLAGS if flag in flags)


def cpu_flags_digest() -> str:
    """A short hash of every CPU flag (two machines with the same model name may differ)."""
    return hashlib.sha256(" ".join(host_cpu_flags()).encode()).hexdigest()[:12]


@functools.cache
def blas_description() -> str:
    """torch's BLAS and CPU kernels, from ``torch.__config__.show()``, e.g.
    ``"BLAS_INFO=mkl; Intel(R) oneAPI Math Kernel Library Version 2024.2...; CPU capability
    usage: AVX2"``."""
    shown = torch.__config__.show()
    parts = []
    match = re.search(r"BLAS_INFO=([^,\s]+)", shown)
    parts.append(f"BLAS_INFO={match.group(1) if match else 'unknown'}")
    for line in shown.splitlines():
        text = line.strip().lstrip("- ").strip()
        if any(word in text for word in ("Math Kernel Library", "OpenBLAS", "CPU capability")):
            parts.append(text)
    return "; ".join(parts)


def machine_description() -> dict[str, object]:
    """CPU model, notable flags, flags digest and BLAS, for results files."""
    return {
        "host_cpu": host_cpu_model(),
        "cpu_flags": list(notable_cpu_flags()),
        "cpu_flags_digest": cpu_flags_digest(),
        "blas": blas_description(),
    }


__all__ = [
    "AMX_TILE_FLAGS",
    "AVX512_BF16_FLAGS",
    "CPU_CLASSES",
    "CPU_FLAGS_ENV",
    "blas_description",
    "claimed_absent",
    "cpu_flags_digest",
    "host_cpu_flags",
    "host_cpu_model",
    "machine_description",
    "notable_cpu_flags",
]
