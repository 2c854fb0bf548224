"""Which dtype to decode in: ``float32``, ``bfloat16``, or ``auto`` (chosen by measurement).

bfloat16 halves the bytes every step reads, and on CPUs with bf16 units (AMX tiles, or
AVX512-BF16 dot products) oneDNN turns that into speed: on AMX tiles a bf16 prefill ran
more than twice as fast as float32, and a 16-token verification cost much less over a
one-token step than in float32 (``../shared/models.md``, ``results/engine/HISTORY.md``).
On a CPU without them bf16 products are
widened to float32 on the fly, which is slower than float32 itself. So ``auto`` means:

* float32 on a CPU whose flags list neither ``amx_bf16`` nor ``avx512_bf16`` (no timing:
  there is nothing to gain);
* otherwise the faster of the two by measurement on the machine at hand: one decode step
  and one 11-token verification through the exact engine, after a 512-token context (or
  as much as the model's context leaves), each the best of three; bfloat16 wins only if it
  is faster in both. The verdict is cached per CPU, model and thread count. A model whose
  context is too short to time, or an engine that cannot run, gives float32 and says why
  (``auto`` only chooses; it never fails a load).

``$KNAPSPEC_CPU_FLAGS`` claims CPU flags in place of the machine's, so that a test (or
``nox -s amx``) can take the bf16 path on any CPU.

Exactness holds in either dtype (the engine's row-invariant kernels, ``docs/theory.md``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from knapspec.model import cachefiles
from knapspec.model.machine import cpu_flags_digest, host_cpu_flags, host_cpu_model
from knapspec.paths import cache_root

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
#: CPU flags that mark bf16 arithmetic units.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")

logger = logging.getLogger(__name__)


@attrs.frozen
class DtypeChoice:
    """The dtype to run and why (printed by the main job)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def bf16_units(flags: str | None = None) -> tuple[str, ...]:
    """The bf16 flags among ``flags`` (default: this CPU's,
    :func:`~knapspec.model.machine.host_cpu_flags`, which ``$KNAPSPEC_CPU_FLAGS`` may
    claim), e.g. ``("avx512_bf16",)``."""
    present = set(host_cpu_flags()) if flags is None else set(flags.replace(",", " ").split())
    return tuple(flag for flag in BF16_FLAGS if flag in present)


def parse_dtype(name: str) -> str:
    """Validate a ``--dtype`` / config value."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {name!r}")
    return name


#: The timed steps run after this many tokens of context, where the model allows it.
PROBE_CONTEXT = 512
#: Tokens in the timed verification pass.
PROBE_VERIFY = 11
#: The shortest context worth timing: below it a step's time says little about decoding.
MIN_PROBE_CONTEXT = 16


def probe_context(max_context: int) -> int | None:
    """The context :func:`choose_dtype` times after for a model of ``max_context`` tokens:
    :data:`PROBE_CONTEXT`, or as much as fits beside the timed tokens; None when under
    :data:`MIN_PROBE_CONTEXT` fits."""
    fits = min(PROBE_CONTEXT, max_context - PROBE_VERIFY - 1)
    return fits if fits >= MIN_PROBE_CONTEXT else None


def _step_seconds(
    engine: Any, context: int = PROBE_CONTEXT, verify: int = PROBE_VERIFY
) -> tuple[float, float]:
    """Best-of-three seconds of one decode step and one ``verify``-token pass after
    ``context`` tokens (``context + verify + 1`` must fit the model)."""
    ids = torch.randint(0, engine.vocab_size, (context + verify + 1,))
    cache = engine.new_cache(context + verify + 1)
    engine.forward(ids[:context], 0, cache, all_logits=False)
    steps, passes = [], []
    for _ in range(3):
        cache.crop(context)
        start = time.perf_counter()
        engine.forward(ids[context : context + 1], context, cache, all_logits=False)
        steps.append(time.perf_counter() - start)
        cache.crop(context)
        start = time.perf_counter()
        engine.forward(ids[context : context + verify], context, cache)
        passes.append(time.perf_counter() - start)
    return min(steps), min(passes)


def choose_dtype(
    name: str,
    model: torch.nn.Module | None = None,
    *,
    flags: str | None = None,
    engine_factory: Callable[[torch.nn.Module], Any] | None = None,
) -> DtypeChoice:
    """Resolve ``name`` (``auto``, ``float32`` or ``bfloat16``) for this machine.

    ``auto`` measures ``model`` (float32, as loaded) against a bfloat16 copy only where the
    CPU has bf16 units (module docstring); ``engine_factory`` builds the engines timed
    (default: :class:`~knapspec.model.engine.SublayerEngine`).
    """
    parse_dtype(name)
    if name != "auto":
        return DtypeChoice(DTYPES[name], "asked for")
    units = bf16_units(flags)
    if not units:
        return DtypeChoice(
            torch.float32,
            "auto: this CPU has no bf16 units (neither amx_bf16 nor avx512_bf16), "
            "where bfloat16 runs slower than float32",
        )
    if model is None:
        return DtypeChoice(torch.float32, "auto: no model to measure")
    config = getattr(model, "config", None)
    key = {
        "cpu": host_cpu_model(),
        "flags": cpu_flags_digest(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": str(getattr(config, "_name_or_path", type(model).__name__)),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "dtype" / f"{digest}.json"
    cached = _cached_choice(path, key)
    if cached is not None:
        return cached
    # Two processes starting on an empty cache: one measures, the other waits and reads
    # its verdict (each timing under the other's load could choose differently, and two
    # servers of one model would then decode in different dtypes).
    with cachefiles.exclusive(path):
        cached = _cached_choice(path, key, quiet=True)
        if cached is not None:
            return cached
        return _measure(model, key, path, units, engine_factory)


def _cached_choice(path: Path, key: dict[str, Any], *, quiet: bool = False) -> DtypeChoice | None:
    """The verdict cached at ``path`` for ``key``, if any."""
    cached = cachefiles.read(path, json.loads, "dtype choice", quiet=quiet)
    if isinstance(cached, dict) and cached.get("key") == key and cached.get("dtype") in DTYPES:
        return DtypeChoice(DTYPES[cached["dtype"]], str(cached.get("reason", "cached")))
    return None


def _measure(
    model: torch.nn.Module,
    key: dict[str, Any],
    path: Path,
    units: tuple[str, ...],
    engine_factory: Callable[[torch.nn.Module], Any] | None,
) -> DtypeChoice:
    """Time both dtypes (module docstring) and cache the verdict at ``path``."""
    if engine_factory is None:
        from knapspec.model.engine import SublayerEngine

        engine_factory = SublayerEngine
    limit = _max_context(model)
    context = probe_context(limit)
    if context is None:
        return _fall_back(
            f"auto: the model's context ({limit} tokens) is too short to time a decode step; "
            "float32 (pass --dtype bfloat16 to try it)"
        )
    try:
        fp32 = _step_seconds(engine_factory(model), context=context)
        bf16 = _step_seconds(
            engine_factory(copy.deepcopy(model).to(torch.bfloat16)), context=context
        )
    except (RuntimeError, ValueError) as error:  # an engine that cannot run this model here
        detail = " ".join(str(error).split())
        return _fall_back(f"auto: could not time the two dtypes ({detail}); float32")
    faster = bf16[0] < fp32[0] and bf16[1] < fp32[1]
    reason = (
        f"auto: measured on this CPU ({', '.join(units)}) after a {context}-token context: "
        f"decode step {fp32[0] * 1e3:.1f} ms float32 vs {bf16[0] * 1e3:.1f} ms bfloat16, "
        f"{PROBE_VERIFY}-token verification {fp32[1] * 1e3:.1f} vs {bf16[1] * 1e3:.1f} ms"
    )
    choice = DtypeChoice(torch.bfloat16 if faster else torch.float32, reason)
    cachefiles.store(
        path, json.dumps({"key": key, "dtype": choice.name, "reason": reason}), "dtype choice"
    )
    return choice


def _max_context(model: torch.nn.Module) -> int:
    """The model's context in tokens (``max_position_embeddings``; a sliding window bounds
    it as the engine does)."""
    config = getattr(model, "config", None)
    limit = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        limit = min(limit, int(window))
    return limit


def _fall_back(reason: str) -> DtypeChoice:
    """float32, with the reason logged (``auto`` never fails a load: it only chooses)."""
    logger.info("%s", reason)
    return DtypeChoice(torch.float32, reason)


__all__ = [
    "BF16_FLAGS",
    "DTYPES",
    "DTYPE_CHOICES",
    "MIN_PROBE_CONTEXT",
    "PROBE_CONTEXT",
    "PROBE_VERIFY",
    "DtypeChoice",
    "bf16_units",
    "choose_dtype",
    "parse_dtype",
    "probe_context",
]
