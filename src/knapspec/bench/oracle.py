"""The oracle frontier: the best fixed draft mask and γ in hindsight, planning free.

For one prompt and its actual AR continuation ``g_0 .. g_{T-1}``, measured by the harness
itself:

1. **Mask families**, each grown greedily by cosine: starting from the full model, add one
   unit at a time, each time the unit whose removal keeps the mean cosine between the
   draft's and the full model's final hidden states highest (teacher-forced on the first
   ``calibration_tokens`` continuation tokens). Units are attention items
   (``attention``), MLP items (``mlp``), whole layers — attention and MLP together, the
   SWIFT/CLaSp shape (``layers``) — or any item (``greedy``). The prefixes of each growth
   order at the ``sizes`` ladder (in skipped items) are the candidate masks.
2. **Acceptance**, teacher-forced over the whole continuation: chunks of ``D`` tokens, each
   seeing the full model's cache before it (as a speculation round does) and its own draft
   states within it (``SublayerEngine.run_masks``); a draft token agrees when its argmax
   equals the true next token. ``α`` is the agreement rate; the expected tokens per round
   ``E(γ)`` is the mean over start positions of ``1 + min(run of agreements, γ)``, which
   keeps the burstiness of real acceptance (copying) that an i.i.d. α would lose.
3. **Costs**, measured directly with the engine at the prompt's context length, with
   repeats: one draft step per candidate mask and one full step over ``k = 1 .. D + 1``
   tokens.
4. ``TPT(S, γ) = E_S(γ) / (γ·t_draft(S) + t_verify(γ + 1))`` for every candidate and γ;
   the layer-skip frontier is the best TPT over plain decoding's ``1 / t_verify(1)``.
5. **The lookup family** (:func:`~knapspec.bench.oracle_lookup.lookup_replay`, in its own
   module): the best fixed prompt-lookup length k in
   hindsight. The AR continuation is replayed through the lookup drafter the ``lookup-k``
   methods use, round by round as the decoder would run it with a fixed k (draft up to k
   tokens, accept the prefix equal to the continuation, commit it plus the bonus token),
   and each round is priced with the same measured ``t_verify(d + 1)`` of its d drafted
   tokens, plus the replay's measured lookup time. Not timed end to end: the measured
   ``lookup-k3`` / ``lookup-k10`` rows are the check on this pricing.

The oracle is the best of both families — 1.0 when nothing beats plain decoding (then the
limit *is* plain decoding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from knapspec.bench.oracle_lookup import (
    LookupCandidate,
    LookupProposer,
    lookup_candidates,
    lookup_replay,
)
from knapspec.bench.timing import engine_step_seconds, engine_verify_seconds
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.planners.dp import mean_cosine
from knapspec.types import SublayerMask

FAMILIES = ("attention", "mlp", "layers", "greedy")
#: Also accepted: ``agreement``, any item, grown by teacher-forced top-1 agreement with the
#: continuation instead of cosine (a stronger hindsight search, minutes per prompt; off in
#: the bench, run by ``benchmarks/oracle_agreement_growth.py``).
ALL_FAMILIES = (*FAMILIES, "agreement")


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _str_tuple(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


@attrs.frozen
class OracleOptions:
    """Settings of the frontier sweep.

    Attributes:
        max_draft_length: D; γ ranges over ``0 .. D``.
        sizes: skipped-item counts at which each family's growth order is cut.
        families: which mask families to sweep (a subset of ``FAMILIES``).
        calibration_tokens: continuation tokens the greedy growth scores on (cosine; for
            ``agreement``, top-1 agreement with the next continuation token).
        max_tokens: continuation tokens used for acceptance (None: all).
        repeats: timed repeats per latency measurement (median).
        lookup: also sweep the fixed-length lookup family (k = 1 .. D), where the
            installation has a lookup drafter.
    """

    max_draft_length: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    sizes: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 30), converter=_int_tuple
    )
    families: tuple[str, ...] = attrs.field(
        default=FAMILIES,
        converter=_str_tuple,
        validator=attrs.validators.deep_iterable(attrs.validators.in_(ALL_FAMILIES)),
    )
    calibration_tokens: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    max_tokens: int | None = None
    repeats: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    lookup: bool = True


@attrs.frozen
class OracleCandidate:
    """One measured mask: its acceptance, cost and best γ."""

    family: str
    skipped_items: tuple[int, ...]
    alpha: float
    expected_tokens: tuple[float, ...]  # E(γ) for γ = 0 .. D
    draft_seconds: float
    best_draft_length: int
    speedup: float  # best TPT over this mask's γ, relative to plain decoding

    @property
    def num_skipped(self) -> int:
        return len(self.skipped_items)


@attrs.frozen
class OracleResult:
    """The frontier at one prompt: every candidate and the best (mask, γ), and the
    fixed-length lookup family with its best k."""

    context_length: int
    measured_tokens: int
    verify_seconds: tuple[float, ...]  # full step over k = 1 .. D + 1 tokens
    candidates: tuple[OracleCandidate, ...]
    best: OracleCandidate | None  # None: no (mask, γ ≥ 1) beats plain decoding
    lookup: tuple[LookupCandidate, ...] = ()
    best_lookup: LookupCandidate | None = None  # None: no k beats plain decoding (or none run)

    @property
    def subnetwork_speedup(self) -> float:
        """Best layer-skip (mask, γ) over plain decoding (>= 1)."""
        return max(1.0, self.best.speedup) if self.best is not None else 1.0

    @property
    def lookup_speedup(self) -> float:
        """Best fixed lookup k over plain decoding (>= 1)."""
        return max(1.0, self.best_lookup.speedup) if self.best_lookup is not None else 1.0

    @property
    def speedup(self) -> float:
        """Best achievable speedup over plain decoding of either family (>= 1: γ = 0 is
        always available)."""
        return max(self.subnetwork_speedup, self.lookup_speedup)

    @property
    def verify_ratio(self) -> tuple[float, ...]:
        """v(k) = t_verify(k) / t_verify(1), k = 1 .. D + 1."""
        return tuple(t / self.verify_seconds[0] for t in self.verify_seconds)

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["speedup"] = self.speedup
        data["subnetwork_speedup"] = self.subnetwork_speedup
        data["lookup_speedup"] = self.lookup_speedup
        data["verify_ratio"] = list(self.verify_ratio)
        return data


def _units(family: str, num_layers: int) -> list[tuple[int, ...]]:
    if family == "attention":
        return [(2 * layer,) for layer in range(num_layers)]
    if family == "mlp":
        return [(2 * layer + 1,) for layer in range(num_layers)]
    if family == "layers":
        return [(2 * layer, 2 * layer + 1) for layer in range(num_layers)]
    return [(item,) for item in range(2 * num_layers)]


def _grow(
    num_layers: int,
    units: Sequence[tuple[int, ...]],
    max_items: int,
    scores: Callable[[list[SublayerMask]], list[tuple[float, ...]]],
) -> list[tuple[int, ...]]:
    """Greedy growth: each step adds the fitting unit whose mask scores highest."""
    chosen: tuple[int, ...] = ()
    remaining = list(units)
    order: list[tuple[int, ...]] = []
    while remaining:
        fitting = [unit for unit in remaining if len(chosen) + len(unit) <= max_items]
        if not fitting:
            break
        masks = [SublayerMask.from_skipped(num_layers, chosen + unit) for unit in fitting]
        values = scores(masks)
        best = max(range(len(fitting)), key=lambda i: values[i])
        chosen = tuple(sorted(chosen + fitting[best]))
        remaining.remove(fitting[best])
        order.append(chosen)
    return order


@torch.inference_mode()
def grow_by_cosine(
    engine: SublayerEngine,
    cache: KVCache,
    window_ids: torch.Tensor,
    start: int,
    units: Sequence[tuple[int, ...]],
    max_items: int,
) -> list[tuple[int, ...]]:
    """Greedy growth order of ``units`` (see the module docstring), up to ``max_items``.

    Args:
        window_ids: ``(r,)`` tokens at positions ``start .. start + r - 1``; the cache holds
            the full model's K/V for every position before ``start``.

    Returns:
        The skipped items after each growth step (nested, increasing).
    """
    positions = torch.arange(start, start + window_ids.numel(), device=engine.device)
    embedded = engine.embed_tokens(window_ids.to(engine.device))
    full = SublayerMask.full(engine.num_layers)
    reference = engine.run_masks([full], embedded, positions, cache, start)[0]

    def cosine(masks: list[SublayerMask]) -> list[tuple[float, ...]]:
        finals = engine.run_masks(masks, embedded, positions, cache, start)
        return [(float(c),) for c in mean_cosine(reference, finals)]

    return _grow(engine.num_layers, units, max_items, cosine)


@torch.inference_mode()
def grow_by_agreement(
    engine: SublayerEngine,
    cache: KVCache,
    calibration: torch.Tensor,
    start: int,
    units: Sequence[tuple[int, ...]],
    max_items: int,
    chunk: int,
) -> list[tuple[int, ...]]:
    """Greedy growth order of ``units`` by teacher-forced agreement (ties: by cosine).

    Each step adds the unit whose removal keeps the most draft argmaxes equal to the next
    calibration token (:func:`teacher_forced_agreement` with chunks of ``chunk`` tokens);
    among equals, the one keeping the final hidden states closest (mean cosine).

    Args:
        calibration: ``(c + 1,)`` continuation tokens at positions ``start ..``; the cache
            holds the full model's K/V for every position before ``start + c``.

    Returns:
        The skipped items after each growth step (nested, increasing).
    """
    inputs = calibration[:-1].to(engine.device)
    positions = torch.arange(start, start + inputs.numel(), device=engine.device)
    full = SublayerMask.full(engine.num_layers)
    embedded = engine.embed_tokens(inputs)
    reference = engine.run_masks([full], embedded, positions, cache, start)[0]

    def agreement_then_cosine(masks: list[SublayerMask]) -> list[tuple[float, ...]]:
        rates = teacher_forced_agreement(engine, cache, masks, calibration, start, chunk)
        finals = engine.run_masks(masks, embedded, positions, cache, start)
        cosines = mean_cosine(reference, finals)
        return [
            (float(rate), float(c))
            for rate, c in zip(rates.float().mean(dim=1), cosines, strict=True)
        ]

    return _grow(engine.num_layers, units, max_items, agreement_then_cosine)


@torch.inference_mode()
def teacher_forced_agreement(
    engine: SublayerEngine,
    cache: KVCache,
    masks: Sequence[SublayerMask],
    continuation: torch.Tensor,
    context_length: int,
    chunk: int,
) -> torch.Tensor:
    """``(B, T - 1)`` bool: mask ``b``'s argmax after ``g_t`` equals ``g_{t+1}``.

    The cache must hold the full model's K/V of the prompt and ``continuation[:-1]``.
    """
    inputs = continuation[:-1].to(engine.device)
    targets = continuation[1:].to(engine.device)
    rows = []
    for offset in range(0, inputs.numel(), chunk):
        ids = inputs[offset : offset + chunk]
        start = context_length + offset
        positions = torch.arange(start, start + ids.numel(), device=engine.device)
        finals = engine.run_masks(list(masks), engine.embed_tokens(ids), positions, cache, start)
        predicted = torch.stack([engine.logits(final).argmax(dim=-1) for final in finals])
        rows.append(predicted == targets[offset : offset + chunk].unsqueeze(0))
    return torch.cat(rows, dim=1)


def expected_tokens_from_runs(agreement: np.ndarray[Any, Any], max_draft: int) -> np.ndarray:
    """``(B, D + 1)``: mean over start positions of ``1 + min(agreement run, γ)``.

    Args:
        agreement: ``(B, T)`` bool, token ``t`` of draft ``b`` agrees with the target.
    """
    runs = np.zeros(agreement.shape, dtype=np.int64)
    following = np.zeros(agreement.shape[0], dtype=np.int64)
    for t in range(agreement.shape[1] - 1, -1, -1):
        following = np.where(agreement[:, t], following + 1, 0)
        runs[:, t] = following
    gammas = np.arange(max_draft + 1)
    result: np.ndarray = (1 + np.minimum(runs[:, :, None], gammas[None, None, :])).mean(axis=1)
    return result


def oracle_frontier(
    engine: SublayerEngine,
    prompt: torch.Tensor,
    continuation: torch.Tensor,
    options: OracleOptions,
    lookup: Callable[[], LookupProposer] | None = None,
) -> OracleResult:
    """Sweep mask families × γ on one prompt's AR continuation, and fixed lookup lengths k
    (module docstring).

    Args:
        prompt: ``(n,)`` prompt ids; continuation: ``(T,)`` the AR output after it (T >= 2).
        lookup: builds a fresh lookup drafter for the lookup family (None: not swept).
    """
    if options.max_tokens is not None:
        continuation = continuation[: options.max_tokens]
    if continuation.numel() < 2:
        raise ValueError("the oracle needs an AR continuation of at least 2 tokens")
    n = prompt.numel()
    max_draft = options.max_draft_length
    cache = engine.new_cache(n + continuation.numel() + max_draft + 2)
    engine.forward(torch.cat([prompt, continuation[:-1]]), 0, cache, all_logits=False)

    limit = max(options.sizes)
    calibration = continuation[: options.calibration_tokens]
    masks: list[tuple[str, SublayerMask]] = []
    for family in options.families:
        if family == "agreement":
            order = grow_by_agreement(
                engine,
                cache,
                continuation[: options.calibration_tokens + 1],
                n,
                _units("greedy", engine.num_layers),
                limit,
                max_draft,
            )
        else:
            order = grow_by_cosine(
                engine, cache, calibration, n, _units(family, engine.num_layers), limit
            )
        for skipped in order:
            if len(skipped) in options.sizes:
                masks.append((family, SublayerMask.from_skipped(engine.num_layers, skipped)))

    agreement = (
        teacher_forced_agreement(
            engine, cache, [mask for _, mask in masks], continuation, n, max_draft
        )
        .cpu()
        .numpy()
        if masks
        else np.zeros((0, continuation.numel() - 1), dtype=bool)
    )
    expected = expected_tokens_from_runs(agreement, max_draft)

    cache.crop(n)  # costs at the prompt's context length
    verify = engine_verify_seconds(
        engine, cache, n, range(1, max_draft + 2), repeats=options.repeats
    )
    gammas = np.arange(max_draft + 1)
    plain = 1.0 / verify[0]
    candidates = []
    for index, (family, mask) in enumerate(masks):
        draft = engine_step_seconds(engine, cache, n, 1, mask, repeats=options.repeats)
        tpt = expected[index] / (gammas * draft + np.asarray(verify))
        best_gamma = int(np.argmax(tpt[1:]) + 1)
        candidates.append(
            OracleCandidate(
                family=family,
                skipped_items=mask.skipped,
                alpha=float(agreement[index].mean()),
                expected_tokens=tuple(float(e) for e in expected[index]),
                draft_seconds=draft,
                best_draft_length=best_gamma,
                speedup=float(tpt[best_gamma] / plain),
            )
        )
    best = max(candidates, key=lambda c: c.speedup, default=None)
    looked_up = (
        lookup_candidates(lookup, prompt.tolist(), continuation.tolist(), verify)
        if lookup is not None
        else []
    )
    best_lookup = max(looked_up, key=lambda c: c.speedup, default=None)
    return OracleResult(
        context_length=n,
        measured_tokens=int(continuation.numel()),
        verify_seconds=tuple(verify),
        candidates=tuple(candidates),
        best=best if best is not None and best.speedup > 1.0 else None,
        lookup=tuple(looked_up),
        best_lookup=best_lookup if best_lookup is not None and best_lookup.speedup > 1.0 else None,
    )


__all__ = [
    "ALL_FAMILIES",
    "FAMILIES",
    "LookupCandidate",
    "LookupProposer",
    "OracleCandidate",
    "OracleOptions",
    "OracleResult",
    "expected_tokens_from_runs",
    "grow_by_agreement",
    "grow_by_cosine",
    "lookup_candidates",
    "lookup_replay",
    "oracle_frontier",
    "teacher_forced_agreement",
]
