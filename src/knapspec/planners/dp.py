"""The batched 0/1 knapsack DP over draft items, for every skipped-weight budget at once.

One DP pass answers, for every budget ``j`` in ``[0, max_budget]``, "which items should a
draft skip so that their weights sum to *exactly* ``j`` and the draft stays closest to the
full model?". It is written once, generically, and used with two kinds of value:

* an **additive** scalar value (:class:`AdditiveValue`): the state is the running total and
  the DP is the textbook exact knapsack — property-tested against brute force;
* the **hidden-state** value (:class:`HiddenStateValue`, :func:`hidden_state_dp`): the state
  is the draft's residual stream on the reference window, ``(r, d)``, and the score is its
  similarity to the full model's stream at the same item point (KnapSpec §5). Keeping only
  the best state per ``(item, budget)`` is then a greedy heuristic, not an exact optimum:
  a state that scores lower now may have led to a better final state.

The DP table ``g[i, j]`` is never stored whole: only the previous level's live states are
kept (``B <= max_budget + 1`` of them), plus one small choice code per ``(item, budget)``
for backtracking. For each item, all live budgets are executed in *one* batched call
(``(B, *state)`` through :meth:`ItemEvaluator.execute`), so a full pass costs one batched
call per item.

A *DP item* may stand for several engine items executed or skipped together (``groups``):
CLaSp-style planners pass one group ``(2l, 2l + 1)`` per decoder layer. To pin a DP item
(never skip it), give it a weight above ``max_budget``.

Size: a little over 450 lines: one algorithm, its two evaluators (additive values for
tests and bounds, hidden states for planning) and their result records, which are read
together.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from knapspec.scores import mean_cosine
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

if TYPE_CHECKING:
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine

#: Choice codes in the backtracking table.
UNREACHABLE, EXECUTED, SKIPPED = -1, 0, 1

#: ``score_fn(reference (r, d), candidates (B, r, d)) -> (B,)``; higher is closer.
ScoreFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ItemEvaluator(abc.ABC):
    """How the DP runs and scores its items; states are tensors ``(B, *state_shape)``.

    Subclasses are the only place that knows what a state means. Both methods are called
    with *all* live budgets at once and must treat the leading axis as independent branches.
    """

    @property
    @abc.abstractmethod
    def num_items(self) -> int:
        """Number of DP items."""

    @abc.abstractmethod
    def execute(self, item: int, states: torch.Tensor) -> torch.Tensor:
        """Run DP item ``item`` on ``states (B, *S)``; returns ``(B, *S)``."""

    @abc.abstractmethod
    def score(self, item: int, states: torch.Tensor) -> torch.Tensor:
        """Value of ``states (B, *S)`` *after* DP item ``item`` (run or skipped): ``(B,)``."""


@attrs.frozen
class DPStats:
    """Work done by one DP pass (for benchmarks and the overhead report).

    Attributes:
        execute_calls: batched :meth:`ItemEvaluator.execute` calls (one per DP item reached).
        states_executed: branches summed over those calls (the batch sizes added up).
        max_live_states: the largest number of live budgets at any level.
        pruned_states: states dropped because their score fell below ``min_score``.
    """

    execute_calls: int
    states_executed: int
    max_live_states: int
    pruned_states: int


@attrs.frozen
class KnapsackDPResult:
    """The DP's answer for every reachable budget, ascending by budget.

    Attributes:
        weights: ``(N,)`` integer weight of each DP item, as given.
        max_budget: the largest skipped weight the DP allowed.
        budgets: reachable skipped weights ``j`` (ascending); each candidate's skipped items
            weigh exactly ``j``.
        executed: per budget, ``N`` flags: True where the DP item runs.
        scores: ``(K,)`` each budget's final score (the DP table entry ``g[N, j]``).
        final_states: ``(K, *S)`` each budget's final state.
        stats: work counters.
    """

    weights: tuple[int, ...]
    max_budget: int
    budgets: tuple[int, ...]
    executed: tuple[tuple[bool, ...], ...]
    scores: torch.Tensor
    final_states: torch.Tensor
    stats: DPStats

    @property
    def num_candidates(self) -> int:
        return len(self.budgets)

    def index_of(self, budget: int) -> int:
        """Position of ``budget`` in :attr:`budgets`; ``KeyError`` if it was not reachable."""
        try:
            return self.budgets.index(budget)
        except ValueError:
            raise KeyError(
                f"budget {budget} is not reachable (reachable: {self.budgets})"
            ) from None

    def skipped(self, index: int) -> tuple[int, ...]:
        """DP items skipped by candidate ``index``."""
        return tuple(i for i, run in enumerate(self.executed[index]) if not run)


def half_budget(weights: Sequence[int], fraction: float = 0.5) -> int:
    """The paper's skip bound: at most ``fraction`` of the total weight (floor)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"budget fraction must be in [0, 1], got {fraction}")
    return int(fraction * sum(weights))


def knapsack_dp(
    weights: Sequence[int],
    evaluator: ItemEvaluator,
    initial_state: torch.Tensor,
    *,
    max_budget: int,
    min_score: float | None = None,
) -> KnapsackDPResult:
    """Run the batched DP over items × skipped weight.

    Transition for DP item ``i`` of weight ``w``: for every live budget ``j``,
    ``exec = execute(i, g[j])`` competes for budget ``j`` and ``skip = g[j]`` competes for
    budget ``j + w``; each budget keeps the candidate with the higher ``score(i, ·)`` (ties
    go to executing). States scoring below ``min_score`` (NaN included) are pruned.

    Args:
        weights: ``N`` non-negative integer weights, one per DP item.
        evaluator: runs and scores items; ``evaluator.num_items`` must equal ``N``.
        initial_state: ``(*S)`` the state before the first item (budget 0).
        max_budget: skipped weights above this are never formed (the half-budget bound).
        min_score: the pruning threshold τ, or None for no pruning.

    Returns:
        :class:`KnapsackDPResult`; ``budgets`` is empty only when pruning removed every state.
    """
    weight_tuple = tuple(int(w) for w in weights)
    if any(w < 0 for w in weight_tuple):
        raise ValueError(f"item weights must be non-negative integers, got {weight_tuple}")
    if len(weight_tuple) != evaluator.num_items:
        raise ValueError(
            f"{len(weight_tuple)} weights for {evaluator.num_items} DP items; give one per item"
        )
    if max_budget < 0:
        raise ValueError(f"max_budget must be >= 0, got {max_budget}")
    if not weight_tuple:
        raise ValueError("the knapsack DP needs at least one item")
    num_items = len(weight_tuple)
    device = initial_state.device
    choices = torch.full((num_items, max_budget + 1), UNREACHABLE, dtype=torch.int8)
    budgets = torch.zeros(1, dtype=torch.long, device=device)
    states = initial_state.unsqueeze(0)
    scores = torch.zeros(1, dtype=torch.float64, device=device)  # replaced at item 0
    execute_calls = states_executed = pruned = 0
    max_live = 1
    for item, weight in enumerate(weight_tuple):
        live = budgets.numel()
        executed_states = evaluator.execute(item, states)
        execute_calls += 1
        states_executed += live
        can_skip = budgets + weight <= max_budget
        skipped_states = states[can_skip]
        candidate_budgets = torch.cat([budgets, budgets[can_skip] + weight])
        candidate_states = torch.cat([executed_states, skipped_states])
        candidate_scores = evaluator.score(item, candidate_states).to(torch.float64)
        candidate_scores = torch.nan_to_num(candidate_scores, nan=float("-inf"))
        is_skip = torch.arange(candidate_budgets.numel(), device=device) >= live
        winners = _best_per_budget(candidate_budgets, candidate_scores)
        if min_score is not None:
            keep = candidate_scores[winners] >= min_score
            pruned += int((~keep).sum())
            winners = winners[keep]
        budgets = candidate_budgets[winners]
        states = candidate_states[winners]
        scores = candidate_scores[winners]
        choices[item, budgets.cpu()] = is_skip[winners].to(torch.int8).cpu()
        max_live = max(max_live, budgets.numel())
        if budgets.numel() == 0:
            break
    stats = DPStats(execute_calls, states_executed, max_live, pruned)
    executed = _backtrack(choices, weight_tuple, budgets.cpu())
    return KnapsackDPResult(
        weights=weight_tuple,
        max_budget=max_budget,
        budgets=tuple(int(b) for b in budgets.tolist()),
        executed=executed,
        scores=scores,
        final_states=states,
        stats=stats,
    )


def _best_per_budget(budgets: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Index of the highest-scoring candidate for each distinct budget, ascending by budget.

    Ties keep the earliest candidate (executed states come first), by two stable sorts.
    """
    by_score = torch.argsort(scores, descending=True, stable=True)
    order = by_score[torch.argsort(budgets[by_score], stable=True)]
    sorted_budgets = budgets[order]
    first = torch.ones_like(sorted_budgets, dtype=torch.bool)
    first[1:] = sorted_budgets[1:] != sorted_budgets[:-1]
    return order[first]


def _backtrack(
    choices: torch.Tensor, weights: tuple[int, ...], budgets: torch.Tensor
) -> tuple[tuple[bool, ...], ...]:
    """Per final budget, the executed flag of every DP item, walking the choices backwards.

    Vectorised over budgets: one gather per item.
    """
    num_items = len(weights)
    if budgets.numel() == 0:
        return ()
    current = budgets.clone()
    executed = torch.ones(budgets.numel(), num_items, dtype=torch.bool)
    for item in range(num_items - 1, -1, -1):
        code = choices[item, current]
        if bool((code == UNREACHABLE).any()):
            raise RuntimeError("knapsack DP backtracking reached an unreachable cell (a bug)")
        skipped = code == SKIPPED
        executed[:, item] = ~skipped
        current = current - skipped.long() * weights[item]
    return tuple(tuple(bool(x) for x in row) for row in executed.tolist())


# ---------------------------------------------------------------------------- additive value
class AdditiveValue(ItemEvaluator):
    """Additive scalar value: executing item ``i`` adds ``values[i]``; the score is the sum.

    States are ``(B,)`` float64 running totals; start from ``torch.tensor(0.0)``. With this
    evaluator :func:`knapsack_dp` is the exact knapsack with an exact-weight constraint.
    """

    def __init__(self, values: Sequence[float]) -> None:
        self.values = torch.tensor([float(v) for v in values], dtype=torch.float64)

    @property
    def num_items(self) -> int:
        return int(self.values.numel())

    def execute(self, item: int, states: torch.Tensor) -> torch.Tensor:
        return states + self.values[item]

    def score(self, item: int, states: torch.Tensor) -> torch.Tensor:
        return states


def additive_knapsack(
    weights: Sequence[int], values: Sequence[float], max_budget: int
) -> KnapsackDPResult:
    """For every skipped weight ``j <= max_budget``: the largest total value of the *executed*
    items among subsets whose skipped items weigh exactly ``j``.

    Also useful outside tests, e.g. for the largest time a draft can save per budget.
    """
    if len(values) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(values)} values")
    initial = torch.zeros((), dtype=torch.float64)
    return knapsack_dp(weights, AdditiveValue(values), initial, max_budget=max_budget)


# ------------------------------------------------------------------------ hidden-state value
def single_items(num_engine_items: int) -> tuple[tuple[int, ...], ...]:
    """One DP item per engine item (KnapSpec's decoupled attention / MLP)."""
    return tuple((item,) for item in range(num_engine_items))


def layer_groups(num_layers: int) -> tuple[tuple[int, ...], ...]:
    """One DP item per decoder layer, attention and MLP together (CLaSp, tied ablation)."""
    return tuple((2 * layer, 2 * layer + 1) for layer in range(num_layers))


def _check_groups(groups: Sequence[Sequence[int]], num_engine_items: int) -> None:
    flat = [item for group in groups for item in group]
    if any(len(group) == 0 for group in groups) or flat != list(range(num_engine_items)):
        raise ValueError(
            "groups must split the engine items 0..2L-1 into consecutive non-empty runs, in "
            "order (e.g. ((0,), (1,), ...) or ((0, 1), (2, 3), ...)); "
            f"got {tuple(map(tuple, groups))}"
        )


def trim_window(window: ReferenceWindow, max_tokens: int | None) -> ReferenceWindow:
    """Keep only the last ``max_tokens`` window tokens (the DP's cost grows with ``r``).

    The dropped tokens become part of the context: the kept tokens attend to them through
    the full model's cached keys/values, as they do during decoding.
    """
    if max_tokens is None or window.size <= max_tokens:
        return window
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    cut = window.size - max_tokens
    return ReferenceWindow(
        points=window.points[:, cut:],
        token_ids=window.token_ids[cut:],
        target_tokens=window.target_tokens[cut:],
        start=window.start + cut,
    )


class HiddenStateValue(ItemEvaluator):
    """The KnapSpec value: residual streams on the reference window, scored against the
    full model's stream at the same point.

    States are ``(B, r, d)``. ``execute`` runs a group's engine items on all branches with
    :meth:`SublayerEngine.run_item` (each branch attends to the shared, read-only context
    prefix ``[0, window.start)`` and to its own window tokens, block-causally); the cache is
    never written.

    Args:
        engine: the sublayer engine.
        window: the reference window; its tokens are the cache's last positions.
        cache: the verified cache holding at least ``window.start`` positions per layer.
        groups: the engine items of each DP item (consecutive runs covering ``0..2L-1``).
        score_fn: value of candidate states against the reference; default :func:`mean_cosine`.
    """

    def __init__(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        cache: KVCache,
        groups: Sequence[Sequence[int]],
        score_fn: ScoreFn = mean_cosine,
    ) -> None:
        _check_groups(groups, engine.num_items)
        if window.points.shape[0] != engine.num_items + 1:
            raise ValueError(
                f"window has {window.points.shape[0]} points, the model needs "
                f"{engine.num_items + 1} (2L + 1)"
            )
        self.engine = engine
        self.window = window
        self.cache = cache
        self.groups = tuple(tuple(group) for group in groups)
        self.score_fn = score_fn
        self._positions = window.positions

    @property
    def num_items(self) -> int:
        return len(self.groups)

    def execute(self, item: int, states: torch.Tensor) -> torch.Tensor:
        for engine_item in self.groups[item]:
            states = self.engine.run_item(
                engine_item, states, self._positions, self.cache, self.window.start
            )
        return states

    def score(self, item: int, states: torch.Tensor) -> torch.Tensor:
        reference = self.window.points[self.groups[item][-1] + 1]
        return self.score_fn(reference, states)

    def to_mask(self, executed: Sequence[bool]) -> SublayerMask:
        """Expand DP-item flags to a :class:`SublayerMask` over engine items."""
        flags = [run for run, group in zip(executed, self.groups, strict=True) for _ in group]
        return SublayerMask(tuple(flags))


@attrs.frozen
class HiddenStateDPResult:
    """Per reachable budget, the DP's draft on the reference window (ascending by budget).

    Attributes:
        masks: one :class:`SublayerMask` per budget; its skipped DP items weigh exactly the
            budget.
        budgets: the skipped weights.
        scores: ``(K,)`` the DP table entry: ``score_fn`` of the final state vs the full
            model's last point.
        final_states: ``(K, r, d)`` each draft's last residual state on the window
            (teacher-forced), ready for a proxy's acceptance estimate.
        weights: ``(N,)`` DP item weights; groups: the engine items of each DP item.
        window: the (possibly trimmed) window the DP ran on.
        table: the generic result it was built from.
    """

    masks: tuple[SublayerMask, ...]
    budgets: tuple[int, ...]
    scores: torch.Tensor
    final_states: torch.Tensor
    weights: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    window: ReferenceWindow
    table: KnapsackDPResult

    @property
    def num_candidates(self) -> int:
        return len(self.masks)


def hidden_state_dp(
    engine: SublayerEngine,
    window: ReferenceWindow,
    cache: KVCache,
    weights: Sequence[int],
    *,
    max_budget: int,
    groups: Sequence[Sequence[int]] | None = None,
    min_score: float | None = 0.5,
    score_fn: ScoreFn = mean_cosine,
    max_window_tokens: int | None = None,
) -> HiddenStateDPResult:
    """KnapSpec's DP (§5) on the reference window: one candidate draft per reachable budget.

    Args:
        engine, window, cache: see :class:`HiddenStateValue`; the cache is only read.
        weights: one integer weight per DP item (per group).
        max_budget: largest skipped weight (e.g. :func:`half_budget` of the weights).
        groups: engine items per DP item; default one per engine item (decoupled attention
            and MLP). Use :func:`layer_groups` for whole layers.
        min_score: the pruning threshold τ (None: no pruning).
        score_fn: ``(reference (r, d), candidates (B, r, d)) -> (B,)``.
        max_window_tokens: use only the last this-many window tokens (cost grows with it).

    Returns:
        :class:`HiddenStateDPResult`. Cost: one batched ``run_item`` per engine item over
        ``B <= max_budget + 1`` branches of ``r`` tokens.
    """
    groups = single_items(engine.num_items) if groups is None else groups
    used = trim_window(window, max_window_tokens)
    evaluator = HiddenStateValue(engine, used, cache, groups, score_fn)
    table = knapsack_dp(
        weights, evaluator, used.points[0], max_budget=max_budget, min_score=min_score
    )
    return HiddenStateDPResult(
        masks=tuple(evaluator.to_mask(flags) for flags in table.executed),
        budgets=table.budgets,
        scores=table.scores,
        final_states=table.final_states,
        weights=table.weights,
        groups=evaluator.groups,
        window=used,
        table=table,
    )


__all__ = [
    "AdditiveValue",
    "DPStats",
    "HiddenStateDPResult",
    "HiddenStateValue",
    "ItemEvaluator",
    "KnapsackDPResult",
    "ScoreFn",
    "additive_knapsack",
    "half_budget",
    "hidden_state_dp",
    "knapsack_dp",
    "layer_groups",
    "mean_cosine",
    "single_items",
    "trim_window",
]
