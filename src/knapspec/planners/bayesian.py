"""SWIFT-style planner: Bayesian-optimisation search over sublayer skip masks, then frozen.

SWIFT (Xia et al., "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration", ICLR 2025) is training-free. It skips a fixed ratio of the ``2L`` attention
and MLP sublayers (0.45 in the paper), chooses *which* by random search interleaved with
Gaussian-process Bayesian optimisation (one BO step every 25 iterations), scores every
candidate by teacher-forced top-1 "matchness" on the recent context, stops at a matchness
of 0.93 or an iteration cap (300 / 1000 in the paper) and then drafts with the frozen mask.

This module restates that search on the library's interfaces:

* a candidate is a :class:`~knapspec.types.SublayerMask` with exactly
  ``round(skip_ratio * 2L)`` skipped items, attention and MLP chosen independently;
* its score is the fraction of the last ``window_tokens`` committed tokens (gathered
  across rounds, :class:`CommittedTokens`) on which the candidate's teacher-forced greedy
  token equals the full model's (:func:`token_matchness`);
* several candidates are scored per ``plan`` call as one batched
  :meth:`~knapspec.model.engine.SublayerEngine.run_masks`, so the search advances during
  decoding at a bounded cost per round;
* the Gaussian process is scikit-learn's
  :class:`~sklearn.gaussian_process.GaussianProcessRegressor` (Matern-5/2 plus a
  white-noise term, because each score comes from a different window),
  and a BO step proposes the member of a pool of random masks at the target ratio with the
  highest expected improvement.

Cost: the whole search runs about ``max_iterations × window_tokens`` teacher-forced draft
tokens plus as many LM-head rows, spread over ``max_iterations / candidates_per_plan``
rounds. SWIFT amortises it over a stream of requests, hence ``keep_search_on_reset``.

Draft length: SWIFT drafts until the draft's confidence falls below 0.8. Here the plan's
``draft_length`` is only a cap; the decoder's ``confidence_threshold`` governs the early
exit (set it to 0.8 to mirror SWIFT).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Self

import attrs
import numpy as np
import torch
from scipy.stats import norm
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

from knapspec.planners.base import PLANNERS, Planner, PlanningContext
from knapspec.planners.dp import trim_window
from knapspec.types import DraftPlan, SublayerMask
from knapspec.validators import open_unit_interval, unit_interval

if TYPE_CHECKING:
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow


@attrs.frozen
class BayesianPlannerConfig:
    """Hyper-parameters of :class:`BayesianPlanner` (SWIFT's published values where it has one).

    Attributes:
        skip_ratio: fraction of the ``2L`` sublayers every candidate skips (SWIFT: 0.45).
        draft_length: γ cap of every drafting round; the decoder's confidence early exit
            ends drafts sooner (SWIFT drafts until confidence < 0.8).
        matchness_target: stop searching once a mask reaches this matchness (SWIFT: 0.93).
        max_iterations: candidate evaluations before the search stops anyway. SWIFT uses
            300 or 1000; the default 128 (32 rounds at 4 candidates per round) lets the
            search finish inside one benchmark generation on CPU.
        candidates_per_plan: candidates scored per ``plan`` call, in one batched run; this
            bounds the search's cost per decoding round.
        bo_interval: one Bayesian-optimisation proposal after every this many random
            candidates (SWIFT: 25).
        acquisition_pool: random masks at the target ratio scored by expected improvement
            in a BO step.
        exploration: the ``ξ`` margin of expected improvement (larger explores more).
        window_tokens: matchness uses the last this-many committed tokens, gathered across
            rounds (SWIFT scores on a window of about 50 tokens).
        min_draft_matchness: draft with the best mask (so far, or frozen) only when its
            matchness reaches this; below it the plan is γ = 0 (plain autoregressive
            steps), so a poor mask cannot slow decoding down. SWIFT itself always drafts
            with its frozen mask: set 0 to reproduce that.
        keep_search_on_reset: SWIFT optimises once over the stream of requests; when True,
            :meth:`BayesianPlanner.reset` (called per ``generate``) keeps the search state
            and the frozen mask, when False it starts the search over.
        seed: seed of the candidate sampler and the GP optimiser.
    """

    skip_ratio: float = attrs.field(default=0.45, validator=open_unit_interval)
    draft_length: int = attrs.field(default=10, validator=attrs.validators.ge(0))
    matchness_target: float = attrs.field(default=0.93, validator=unit_interval)
    max_iterations: int = attrs.field(default=128, validator=attrs.validators.ge(1))
    candidates_per_plan: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    bo_interval: int = attrs.field(default=25, validator=attrs.validators.ge(1))
    acquisition_pool: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    exploration: float = attrs.field(default=0.01, validator=attrs.validators.ge(0.0))
    window_tokens: int = attrs.field(default=48, validator=attrs.validators.ge(1))
    min_draft_matchness: float = attrs.field(default=0.5, validator=unit_interval)
    keep_search_on_reset: bool = True
    seed: int = 0


@attrs.frozen
class SearchRecord:
    """One scored candidate of the search.

    Attributes:
        iteration: 0-based evaluation index.
        mask: the candidate.
        matchness: fraction of window tokens whose teacher-forced greedy token matched.
        proposal: ``"random"`` or ``"bayesian"`` (a GP expected-improvement pick).
    """

    iteration: int
    mask: SublayerMask
    matchness: float
    proposal: str


@torch.inference_mode()
def token_matchness(
    engine: SublayerEngine,
    cache: KVCache,
    token_ids: torch.Tensor,
    target_tokens: torch.Tensor,
    start: int,
    masks: list[SublayerMask],
) -> torch.Tensor:
    """Teacher-forced top-1 agreement of each mask with the full model on committed tokens.

    The tokens at positions ``start .. start + r - 1`` are embedded and every mask runs over
    them in one batched, read-only
    :meth:`~knapspec.model.engine.SublayerEngine.run_masks`; positions before ``start`` come
    from the verified cache. A token matches when the draft's argmax equals its target (the
    full model's greedy next token).

    Args:
        token_ids, target_tokens: ``(r,)`` committed tokens and the full model's greedy
            successor of each.
        start: position of the first token; the cache must hold every position before it.
        masks: ``B`` candidate masks.

    Returns:
        ``(B,)`` float32 matchness in ``[0, 1]``.
    """
    token_ids = token_ids.to(engine.device)
    embedded = engine.embed_tokens(token_ids)  # (r, d): point 0 of the residual stream
    positions = torch.arange(start, start + token_ids.numel(), device=engine.device)
    final = engine.run_masks(masks, embedded, positions, cache, start)  # (B, r, d)
    predicted = engine.logits(final).argmax(dim=-1)  # (B, r)
    return (predicted == target_tokens.to(predicted.device).unsqueeze(0)).float().mean(dim=1)


def window_matchness(
    engine: SublayerEngine,
    cache: KVCache,
    window: ReferenceWindow,
    masks: list[SublayerMask],
    max_tokens: int | None = None,
) -> torch.Tensor:
    """:func:`token_matchness` on the reference window's last ``max_tokens`` tokens.

    Dropped leading window tokens become context: their verified K/V is in the cache.

    Returns:
        ``(B,)`` float32 matchness in ``[0, 1]``.
    """
    used = trim_window(window, max_tokens)
    return token_matchness(engine, cache, used.token_ids, used.target_tokens, used.start, masks)


class CommittedTokens:
    """The last ``capacity`` committed tokens and their full-model greedy successors.

    The decoder's reference window spans only its last few rounds, which is a handful of
    tokens while the plans are γ = 0; SWIFT scores on about 50 tokens. Matchness needs
    only token ids and targets (the draft recomputes everything above the embeddings), so
    the planner accumulates them across rounds from the successive windows.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self.token_ids = torch.empty(0, dtype=torch.long)
        self.target_tokens = torch.empty(0, dtype=torch.long)
        self.start = 0

    @property
    def end(self) -> int:
        """Position after the last token held."""
        return self.start + int(self.token_ids.numel())

    def extend(self, window: ReferenceWindow) -> None:
        """Append the window's tokens past :attr:`end`; start over when they do not join up."""
        ids = window.token_ids.detach().cpu().long()
        targets = window.target_tokens.detach().cpu().long()
        end, window_end = self.end, window.start + window.size
        joins = self.token_ids.numel() > 0 and window.start <= end <= window_end
        if joins:
            # The positions both hold must carry the same tokens (else: another text).
            common = max(self.start, window.start)
            joins = torch.equal(
                self.token_ids[common - self.start :],
                ids[common - window.start : end - window.start],
            )
        if joins:
            self.token_ids = torch.cat([self.token_ids, ids[end - window.start :]])
            self.target_tokens = torch.cat([self.target_tokens, targets[end - window.start :]])
        else:
            # A gap, a rewind or other text: this window's tokens are all we know.
            self.token_ids, self.target_tokens, self.start = ids, targets, window.start
        cut = max(0, self.token_ids.numel() - self.capacity)
        self.token_ids, self.target_tokens = self.token_ids[cut:], self.target_tokens[cut:]
        self.start += cut


@PLANNERS.register("swift")
class BayesianPlanner(Planner):
    """SWIFT-style search for a skip mask at a fixed ratio, frozen once good enough.

    Life cycle: before the first window exists, and while no candidate has reached
    ``min_draft_matchness``, plans are γ = 0. Each ``plan`` call with a window scores
    ``candidates_per_plan`` new candidates (random, or a GP expected-improvement pick after
    every ``bo_interval`` random ones) and proposes the best mask so far. Once the best
    matchness reaches ``matchness_target`` or ``max_iterations`` candidates were scored,
    the best mask is frozen and ``plan`` costs nothing more; a frozen mask below
    ``min_draft_matchness`` means the search failed, and every plan is then γ = 0.

    Learned state (scikit-learn style, trailing underscore): ``history_`` (every
    :class:`SearchRecord`), ``best_`` (the best record or None), ``frozen_``, and
    ``tokens_`` (the :class:`CommittedTokens` matchness is scored on).

    Args:
        num_layers: decoder layers ``L`` of the model.
        config: the validated hyper-parameters.
    """

    config_class = BayesianPlannerConfig

    def __init__(self, num_layers: int, config: BayesianPlannerConfig | None = None) -> None:
        self.config = config if config is not None else BayesianPlannerConfig()
        self.num_layers = num_layers
        self.num_items = 2 * num_layers
        self.num_skipped = round(self.config.skip_ratio * self.num_items)
        if not 1 <= self.num_skipped < self.num_items:
            raise ValueError(
                f"skip_ratio={self.config.skip_ratio} skips {self.num_skipped} of "
                f"{self.num_items} sublayers; it must skip at least one and keep at least one"
            )
        self.tokens_ = CommittedTokens(self.config.window_tokens)
        self._start_search()

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        return cls(engine.num_layers, config)

    # ----------------------------------------------------------------- state
    def _start_search(self) -> None:
        self.history_: list[SearchRecord] = []
        self.best_: SearchRecord | None = None
        self.frozen_ = False
        self._random_since_bayesian = 0
        self._rng = np.random.default_rng(self.config.seed)

    def reset(self) -> None:
        """Start the search over unless ``keep_search_on_reset`` (SWIFT keeps it).

        The committed-token buffer always starts over: it belongs to one generation.
        """
        self.tokens_.clear()
        if not self.config.keep_search_on_reset:
            self._start_search()

    @property
    def iterations(self) -> int:
        """Candidates scored so far."""
        return len(self.history_)

    # ------------------------------------------------------------------ plan
    def plan(self, context: PlanningContext) -> DraftPlan:
        if context.engine.num_items != self.num_items:
            raise ValueError(
                f"planner built for {self.num_items} sublayers, the model has "
                f"{context.engine.num_items}"
            )
        if not self.frozen_ and context.window is not None:
            self.tokens_.extend(context.window)
            self._search_step(context.engine, context.cache)
        return self._current_plan(context.max_draft_length)

    def _current_plan(self, max_draft_length: int) -> DraftPlan:
        best = self.best_
        if best is None or best.matchness < self.config.min_draft_matchness:
            return DraftPlan.autoregressive(self.num_layers, source=self.registered_name)
        return DraftPlan(
            best.mask,
            min(self.config.draft_length, max_draft_length),
            predicted_acceptance=best.matchness,
            source=self.registered_name,
        )

    def _search_step(self, engine: SublayerEngine, cache: KVCache) -> None:
        """Score one batch of candidates on the committed tokens; freeze when done."""
        budget = min(self.config.candidates_per_plan, self.config.max_iterations - self.iterations)
        seen = {record.mask.executed for record in self.history_}
        batch: list[tuple[SublayerMask, str]] = []
        for _ in range(budget):
            if self._random_since_bayesian >= self.config.bo_interval and len(self.history_) >= 2:
                mask = self._bayesian_proposal(seen)
                proposal = "bayesian"
                self._random_since_bayesian = 0
            else:
                mask = self._random_mask(seen)
                proposal = "random"
                self._random_since_bayesian += 1
            seen.add(mask.executed)
            batch.append((mask, proposal))
        tokens = self.tokens_
        scores = token_matchness(
            engine,
            cache,
            tokens.token_ids,
            tokens.target_tokens,
            tokens.start,
            [mask for mask, _ in batch],
        ).tolist()
        for (mask, proposal), score in zip(batch, scores, strict=True):
            record = SearchRecord(self.iterations, mask, float(score), proposal)
            self.history_.append(record)
            # Strict ">" keeps the earliest of equal scores: deterministic and stable.
            if self.best_ is None or record.matchness > self.best_.matchness:
                self.best_ = record
        assert self.best_ is not None
        if (
            self.best_.matchness >= self.config.matchness_target
            or self.iterations >= self.config.max_iterations
        ):
            self.frozen_ = True

    # ----------------------------------------------------------- candidates
    def _sample_masks(self, count: int) -> np.ndarray:
        """``(count, 2L)`` executed-indicator rows, each skipping exactly ``num_skipped``."""
        keys = self._rng.random((count, self.num_items))
        skipped = np.argsort(keys, axis=1)[:, : self.num_skipped]
        executed = np.ones((count, self.num_items), dtype=bool)
        np.put_along_axis(executed, skipped, False, axis=1)
        return executed

    def _random_mask(self, seen: set[tuple[bool, ...]]) -> SublayerMask:
        """A uniformly random mask at the target ratio, new when a few draws allow it."""
        rows = self._sample_masks(8)
        for row in rows:
            mask = SublayerMask(tuple(bool(v) for v in row))
            if mask.executed not in seen:
                return mask
        # Tiny search spaces can be exhausted; re-scoring on a new window is still useful.
        return SublayerMask(tuple(bool(v) for v in rows[0]))

    def _bayesian_proposal(self, seen: set[tuple[bool, ...]]) -> SublayerMask:
        """The pool mask with the highest expected improvement under a GP fit to history."""
        features = np.array([r.mask.executed for r in self.history_], dtype=np.float64)
        scores = np.array([r.matchness for r in self.history_], dtype=np.float64)
        kernel = ConstantKernel(1.0) * Matern(length_scale=2.0, nu=2.5) + WhiteKernel(1e-2)
        process = GaussianProcessRegressor(
            kernel=kernel, normalize_y=True, random_state=self.config.seed
        )
        with warnings.catch_warnings():
            # Few, noisy points often put a hyper-parameter at its bound; that is expected.
            warnings.simplefilter("ignore", ConvergenceWarning)
            process.fit(features, scores)
        pool = self._sample_masks(self.config.acquisition_pool)
        fresh = np.array([tuple(bool(v) for v in row) not in seen for row in pool])
        if fresh.any():
            pool = pool[fresh]
        mean, std = process.predict(pool.astype(np.float64), return_std=True)
        improvement = expected_improvement(mean, std, float(scores.max()), self.config.exploration)
        return SublayerMask(tuple(bool(v) for v in pool[int(np.argmax(improvement))]))


def expected_improvement(
    mean: np.ndarray, std: np.ndarray, best: float, exploration: float = 0.0
) -> np.ndarray:
    """Expected improvement over ``best`` of Gaussian predictions (maximisation).

    ``EI = (μ - best - ξ)·Φ(z) + σ·φ(z)`` with ``z = (μ - best - ξ) / σ``; where ``σ = 0``
    it is the plain improvement ``max(μ - best - ξ, 0)``.

    Args:
        mean, std: ``(n,)`` predictive mean and standard deviation.

    Returns:
        ``(n,)`` expected improvement (non-negative).
    """
    gain = mean - best - exploration
    safe_std = np.where(std > 0, std, 1.0)
    z = gain / safe_std
    value = gain * norm.cdf(z) + safe_std * norm.pdf(z)
    return np.where(std > 0, np.maximum(value, 0.0), np.maximum(gain, 0.0))


__all__ = [
    "BayesianPlanner",
    "BayesianPlannerConfig",
    "CommittedTokens",
    "SearchRecord",
    "expected_improvement",
    "token_matchness",
    "window_matchness",
]
