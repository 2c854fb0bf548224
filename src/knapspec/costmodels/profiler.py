"""Micro-benchmark a model's sublayers through the :class:`SublayerEngine` on this machine.

What is timed, and why that way:

* **Items** — every layer's attention item (one new token against a cache of ``n``
  positions, for each ``n`` of a context ladder) and every MLP item. They are timed inside
  a *sweep* that runs all ``2L`` items in model order, one timer per item, because that is
  how a draft step runs them: timing one item in a tight loop would keep its weights in
  the CPU caches and under-estimate the cost of a step that streams every layer's weights.
  The attention item is the engine's own decode path (cache write + grouped-query SDPA);
  a local layer's attends its sliding window only, and the profile records the windows.
* **Overhead** — :meth:`SublayerEngine.forward` with every item skipped plus the argmax:
  embedding, rotary tables, final norm and the LM head over one token.
* **Verification** — :meth:`SublayerEngine.forward` with all items over ``k = 1..D+1``
  tokens at several contexts, all logits (what the decoder's verify step computes).

One cache is filled once with random keys/values up to the longest context, and a
context is selected by cropping (a pointer move): attention time depends on the number of
cached positions, not their values. Runs go round-robin over the contexts (and over the
verify grid), so a burst of load from another process on a shared machine spreads over
all measurements instead of spoiling every run of one context. Each timing is the median
of ``repeats`` runs after ``warmup`` rounds; on CUDA the device is synchronised around
every timed region.
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from knapspec.costmodels.local_layers import engine_windows
from knapspec.costmodels.profile import LatencyProfile, ProfileKey, VerifyTiming
from knapspec.types import SublayerMask

if TYPE_CHECKING:
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine

DEFAULT_CONTEXTS: tuple[int, ...] = (64, 256, 1024, 2048, 4000, 7000)
"""Item ladder of a full profile (the benchmark holds out 512..6144 away from these)."""

DEFAULT_VERIFY_CONTEXTS: tuple[int, ...] = (128, 1024, 2560, 5120)
"""Contexts of the verification grid of a full profile."""

QUICK_CONTEXTS: tuple[int, ...] = (64, 1024, 3072)
QUICK_VERIFY_CONTEXTS: tuple[int, ...] = (128, 2048)
"""Contexts of a quick profile's verification grid: two, the fewest that give every width
its own line ``A_k + B_k·n``. The quick grid times *every* width ``1..max_tokens`` (no
subset): the verify cost is a staircase in ``k`` (BLAS takes rows in blocks of 4), which
widths such as 1, 2, 6, 11 would interpolate straight across. At the default
``max_tokens = 11`` (D = 10) that is 22 forwards per round instead of 8."""


#: Wall seconds a quick profile aims at (its repeats shrink to fit, down to one timed run
#: after the warm-up): a step of a 1-8B model on a CPU of a few cores takes up to about a
#: second, and the quick grid is some 30 steps a round. A small model's quick profile is
#: well inside it.
QUICK_BUDGET_SECONDS = 30.0

PLANNING_WIDTHS: tuple[int, ...] = (16, 32, 64)
"""Extra verification widths beyond ``max_tokens``: one knapsack DP runs every item over
``live budgets × window tokens`` rows (13 × 2 = 26 by default), so the planner prices a
search as ``t_verify(rows, n)``; timing these widths makes that an interpolation between
measured points instead of an extrapolation of the small-width staircase (which overprices
26 rows about 2x)."""


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def fill_random_cache(
    engine: SublayerEngine, cache: KVCache, length: int, generator: torch.Generator
) -> None:
    """Give every layer ``length`` cached positions of random keys/values (what a timing
    at context ``length`` needs; ``generator`` makes them reproducible)."""
    cache.reset()
    cache.reserve(length + 64)
    shape = (engine.kv_heads, length, engine.head_dim)
    for layer in range(engine.num_layers):
        keys = torch.randn(shape, generator=generator, dtype=torch.float32).to(
            engine.device, engine.dtype
        )
        values = torch.randn(shape, generator=generator, dtype=torch.float32).to(
            engine.device, engine.dtype
        )
        cache.write(layer, 0, keys, values)


def _select_context(cache: KVCache, filled: int, context: int) -> None:
    """Make every layer hold exactly ``context`` positions of a cache filled to ``filled``.

    The buffers beyond the valid length still hold the random fill, so re-extending the
    valid length (a timed step wrote at most a few slots past it) is a pointer move too.
    """
    cache.lengths = [filled] * cache.num_layers
    cache.crop(context)


def _clamped(contexts: Iterable[int], engine: SublayerEngine, room: int) -> tuple[int, ...]:
    """Ascending unique contexts that leave ``room`` new tokens inside the model's context."""
    limit = engine.max_context - room
    kept = sorted({min(int(n), limit) for n in contexts if int(n) >= 1})
    if not kept or kept[0] < 1:
        raise ValueError(f"no usable context lengths (model context {engine.max_context})")
    return tuple(kept)


@torch.inference_mode()
def _sweep(
    engine: SublayerEngine,
    cache: KVCache,
    context: int,
    hidden: torch.Tensor,
    sync: Callable[[], None],
) -> tuple[list[float], list[float]]:
    """Run all items once in model order at ``context``; seconds per attention and MLP item.

    Args:
        hidden: ``(1, 1, d_model)`` residual stream entering layer 0.
    """
    positions = torch.tensor([context], device=engine.device)
    # Each item alone through the engine's decode path. A draft step runs its items in the
    # compiled layer loop (model/kernels/layer_loop.py), without the per-item Python timed
    # here, so these prices err on the dear side.
    rotary = engine.rotary(positions, hidden)
    attention: list[float] = []
    mlp: list[float] = []
    for layer in range(engine.num_layers):
        sync()
        start = time.perf_counter()
        hidden = engine.step_item(2 * layer, hidden, context, cache, rotary)
        sync()
        middle = time.perf_counter()
        hidden = engine.step_item(2 * layer + 1, hidden, context, cache, rotary)
        sync()
        attention.append(middle - start)
        mlp.append(time.perf_counter() - middle)
    return attention, mlp


def _runs_within(budget: float | None, share: float, began: float, warmup: int, runs: int) -> int:
    """Rounds of a phase (warm-up included) that fit ``share`` of ``budget`` seconds, given
    that its first round began at ``began`` and has just ended: at least ``warmup`` + 1,
    at most ``runs``."""
    if budget is None:
        return runs
    first = max(time.perf_counter() - began, 1e-9)
    return max(warmup + 1, min(runs, int(share * budget / first)))


def _time_call(call: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    call()
    sync()
    return time.perf_counter() - start


def profile_engine(
    engine: SublayerEngine,
    *,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    verify_contexts: Sequence[int] = DEFAULT_VERIFY_CONTEXTS,
    max_tokens: int = 11,
    verify_tokens: Sequence[int] | None = None,
    repeats: int = 7,
    warmup: int = 2,
    quick: bool = False,
    progress: bool = True,
    seed: int = 0,
    budget_seconds: float | None = None,
) -> LatencyProfile:
    """Measure item, overhead and verification latencies of ``engine``'s model here.

    Args:
        engine: the engine whose model to profile (its device and dtype are used).
        contexts: ladder of cached positions for the item sweeps.
        verify_contexts: contexts of the verification grid.
        max_tokens: largest verification width, ``D + 1`` for draft length ``D``.
        verify_tokens: verification widths to time (default ``1..max_tokens`` plus
            :data:`PLANNING_WIDTHS`).
        repeats: timed runs per measurement (median taken); warmup: untimed runs before.
        quick: a few-seconds profile (small ladders, 3 repeats); overrides the context
            ladders, not the widths (every width ``1..max_tokens`` unless ``verify_tokens``).
        progress: show a tqdm bar.
        seed: seed of the random cache fill and token ids.
        budget_seconds: wall seconds to aim at (None: no limit; a quick profile's default
            :data:`QUICK_BUDGET_SECONDS`): after the first round of the item sweeps and of
            the verification grid, the rounds that would overrun a quarter / three
            quarters of it are dropped (at least ``warmup`` + 1 rounds run, and the
            profile records the fewest timed rounds as its ``repeats``).

    Returns:
        A :class:`LatencyProfile` keyed to this model, machine and thread count.
    """
    if repeats < 1 or warmup < 0 or max_tokens < 1:
        raise ValueError(
            f"need repeats >= 1, warmup >= 0 and max_tokens >= 1; got repeats={repeats}, "
            f"warmup={warmup}, max_tokens={max_tokens}"
        )
    if quick:
        contexts, verify_contexts = QUICK_CONTEXTS, QUICK_VERIFY_CONTEXTS
        repeats, warmup = min(repeats, 3), min(warmup, 1)
        budget_seconds = QUICK_BUDGET_SECONDS if budget_seconds is None else budget_seconds
    default_widths = [*range(1, max_tokens + 1), *PLANNING_WIDTHS]
    tokens = sorted({int(k) for k in (verify_tokens or default_widths)})
    if not tokens or tokens[0] < 1:
        raise ValueError(f"verify_tokens must be positive, got {verify_tokens!r}")
    item_contexts = _clamped(contexts, engine, room=2)
    grid_contexts = _clamped(verify_contexts, engine, room=tokens[-1] + 1)
    began = time.perf_counter()
    key = ProfileKey.for_engine(engine)
    sync = _synchronizer(engine.device)
    generator = torch.Generator().manual_seed(seed)
    cache = engine.new_cache(max(item_contexts[-1], grid_contexts[-1]) + tokens[-1] + 1)
    runs = warmup + repeats
    total = len(item_contexts) * runs * 2 + len(grid_contexts) * len(tokens) * runs
    bar = tqdm(total=total, desc="profiling", unit="run", disable=not progress, leave=False)
    empty_mask = SublayerMask((False,) * engine.num_items)
    token = torch.randint(engine.vocab_size, (1,), generator=generator)

    try:
        with torch.inference_mode():
            hidden = engine.embed_tokens(token.to(engine.device)).unsqueeze(0)
            # One cache filled to the longest context; crop(n) (a pointer move) selects a
            # context. Runs go round-robin over the contexts so that a burst of load from
            # another process hits every context a little, never one context's every run.
            filled = max(item_contexts[-1], grid_contexts[-1])
            fill_random_cache(engine, cache, filled, generator)
            attn_runs: dict[int, list[list[float]]] = {n: [] for n in item_contexts}
            mlp_runs: dict[int, list[list[float]]] = {n: [] for n in item_contexts}
            overhead_runs: dict[int, list[float]] = {n: [] for n in item_contexts}
            item_runs = runs
            phase = time.perf_counter()
            for run in range(runs):
                if run == 1:
                    item_runs = _runs_within(budget_seconds, 0.25, phase, warmup, runs)
                if run >= item_runs:
                    break
                for context in item_contexts:
                    _select_context(cache, filled, context)
                    times_attn, times_mlp = _sweep(engine, cache, context, hidden, sync)

                    def step_without_items(at: int = context) -> object:
                        out = engine.forward(token, at, cache, empty_mask, all_logits=False)
                        return out.logits.argmax(-1)

                    elapsed = _time_call(step_without_items, sync)
                    if run >= warmup:
                        attn_runs[context].append(times_attn)
                        mlp_runs[context].append(times_mlp)
                        overhead_runs[context].append(elapsed)
                    bar.update(2)

            verify_runs: dict[tuple[int, int], list[float]] = {
                (n, k): [] for n in grid_contexts for k in tokens
            }
            ids = torch.randint(engine.vocab_size, (tokens[-1],), generator=generator)
            grid_runs = runs
            phase = time.perf_counter()
            for run in range(runs):
                if run == 1:
                    grid_runs = _runs_within(budget_seconds, 0.75, phase, warmup, runs)
                if run >= grid_runs:
                    break
                for context, width in verify_runs:
                    _select_context(cache, filled, context)

                    def verify_step(at: int = context, width: int = width) -> object:
                        out = engine.forward(ids[:width], at, cache, None, all_logits=True)
                        return out.logits.argmax(-1)

                    elapsed = _time_call(verify_step, sync)
                    if run >= warmup:
                        verify_runs[(context, width)].append(elapsed)
                    bar.update()
    finally:
        bar.close()

    def medians(samples: list[list[float]]) -> list[float]:
        return [statistics.median(column) for column in zip(*samples, strict=True)]

    attention = [medians(attn_runs[n]) for n in item_contexts]  # (C, L)
    mlp = [medians(mlp_runs[n]) for n in item_contexts]  # (C, L)
    overhead = [statistics.median(overhead_runs[n]) for n in item_contexts]
    verify = [
        VerifyTiming(width, context, statistics.median(samples))
        for (context, width), samples in verify_runs.items()
    ]
    return LatencyProfile(
        key=key,
        contexts=item_contexts,
        attention_seconds=[list(row) for row in zip(*attention, strict=True)],
        mlp_seconds=[list(row) for row in zip(*mlp, strict=True)],
        overhead_seconds=overhead,
        verify=verify,
        repeats=min(item_runs, grid_runs) - warmup,
        warmup=warmup,
        quick=quick,
        created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        wall_seconds=time.perf_counter() - began,
        windows=engine_windows(engine),
    )


__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_VERIFY_CONTEXTS",
    "PLANNING_WIDTHS",
    "QUICK_BUDGET_SECONDS",
    "QUICK_CONTEXTS",
    "QUICK_VERIFY_CONTEXTS",
    "fill_random_cache",
    "profile_engine",
]
