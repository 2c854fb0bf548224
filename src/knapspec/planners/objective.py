"""The planning objectives: Tokens-per-Time (TPT, KnapSpec §3) and Tokens-per-Layer (DEL).

A speculation round drafts ``γ`` tokens with draft ``S`` and verifies ``γ + 1`` tokens with
the full model. With per-token acceptance ``α`` the committed tokens follow a truncated
geometric law, so

    E(α, γ) = 1 + α + ... + α^γ = (1 - α^(γ+1)) / (1 - α)
    TPT(S, γ) = E(α_S, γ) / (γ · t_draft(S) + t_verify(γ + 1, n) [+ t_plan])

and ``γ = 0`` is a plain autoregressive step: ``TPT = 1 / t_step(n)``. Because verifying
``γ + 1`` tokens is *not* free on a CPU (``t_verify(k)`` grows with ``k``), the γ = 0 column
often wins, and the grid search below finds that by itself.

Everything is vectorised with NumPy over candidates × γ; costs may be in any unit (only
ratios matter), so the arg-max is invariant to scaling all costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from knapspec.costmodels.base import CostModel
    from knapspec.types import SublayerMask

FloatArray = npt.NDArray[np.float64]


def expected_tokens(alpha: npt.ArrayLike, draft_length: npt.ArrayLike) -> FloatArray:
    """Expected tokens committed per round, ``E = Σ_{k=0}^{γ} α^k`` (broadcasting).

    Computed as the finite sum, which equals ``(1 - α^(γ+1)) / (1 - α)`` and is exact at
    ``α = 1`` (``γ + 1``) and ``α = 0`` (1) with no division. ``α`` is clipped to ``[0, 1]``.

    Args:
        alpha: acceptance rates, any shape.
        draft_length: non-negative integer γ, broadcastable against ``alpha``.
    """
    a = np.clip(np.asarray(alpha, dtype=np.float64), 0.0, 1.0)
    gamma = np.asarray(draft_length)
    if np.any(gamma < 0) or not np.issubdtype(gamma.dtype, np.integer):
        raise ValueError(f"draft lengths must be non-negative integers, got {gamma}")
    a, gamma = np.broadcast_arrays(a, gamma)
    max_gamma = int(gamma.max()) if gamma.size else 0
    powers = a[..., None] ** np.arange(max_gamma + 1)  # (..., max_gamma + 1)
    included = np.arange(max_gamma + 1) <= gamma[..., None]
    result: FloatArray = np.where(included, powers, 0.0).sum(axis=-1)
    return result


def tokens_per_time(
    alpha: float,
    draft_length: int,
    draft_cost: float,
    verify_cost: float,
    planning_cost: float = 0.0,
) -> float:
    """TPT of one (draft, γ): ``E(α, γ) / (γ·draft_cost + verify_cost + planning_cost)``.

    ``verify_cost`` is the full model over ``γ + 1`` tokens (for γ = 0: one plain step).
    """
    denominator = draft_length * draft_cost + verify_cost + planning_cost
    if not denominator > 0:
        raise ValueError(f"round cost must be positive, got {denominator}")
    return float(expected_tokens(alpha, draft_length)) / denominator


def breakeven_acceptance(
    draft_length: int,
    draft_cost: float,
    verify_cost: float,
    step_cost: float,
    planning_cost: float = 0.0,
) -> float:
    """The α at which a round of ``γ`` drafts is exactly as fast as plain steps.

    Solves ``E(α, γ) / (γ·draft_cost + verify_cost + planning_cost) = 1 / step_cost`` for α
    (``E`` rises strictly from 1 to ``γ + 1`` on ``[0, 1]``, so bisection finds the unique
    root). Below it the plan loses to plain decoding. Returns 0.0 when the round pays even
    at α = 0 and 1.0 when it cannot pay even at α = 1.
    """
    if draft_length < 1:
        raise ValueError(f"draft_length must be >= 1, got {draft_length}")
    if not step_cost > 0:
        raise ValueError(f"step_cost must be positive, got {step_cost}")
    needed = (draft_length * draft_cost + verify_cost + planning_cost) / step_cost
    if needed <= 1.0:
        return 0.0
    if needed >= draft_length + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = 0.5 * (low + high)
        if float(expected_tokens(middle, draft_length)) < needed:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def tokens_per_layer(
    alpha: npt.ArrayLike,
    draft_length: npt.ArrayLike,
    draft_layers: npt.ArrayLike,
    total_layers: float,
) -> FloatArray:
    """DEL's objective: ``E(α, γ) / (γ·ℓ + L)`` with ``ℓ`` draft layers out of ``L``.

    TPT reduces to it when every layer costs the same and verifying costs one full step.
    """
    if total_layers <= 0:
        raise ValueError(f"total_layers must be positive, got {total_layers}")
    gamma = np.asarray(draft_length)
    result: FloatArray = expected_tokens(alpha, gamma) / (
        gamma * np.asarray(draft_layers, dtype=np.float64) + total_layers
    )
    return result


@attrs.frozen
class RoundCosts:
    """Costs of the options a grid search compares (seconds, or any common unit).

    Attributes:
        draft: ``(K,)`` one draft token with candidate ``k``.
        verify: ``(D + 1,)`` the full model over ``1 .. D + 1`` tokens; ``verify[0]`` is the
            plain autoregressive step (the γ = 0 round).
        planning: time added to every *speculative* round (the amortised re-planning cost);
            a γ = 0 plan lets the re-planning policy plan rarely, so it is not charged there.
    """

    draft: FloatArray
    verify: FloatArray
    planning: float = 0.0

    @classmethod
    def from_cost_model(
        cls,
        cost_model: CostModel,
        masks: Sequence[SublayerMask],
        context_length: int,
        max_draft_length: int,
        planning: float = 0.0,
    ) -> RoundCosts:
        """Draft and verify costs of ``masks`` at ``context_length`` from a cost model.

        ``verify[0]`` is ``cost_model.step_cost`` (one plain step), ``verify[k]`` is
        ``verify_cost(k + 1)``; both include the per-step overhead.
        """
        draft = np.array(
            [cost_model.draft_cost(m, context_length) for m in masks], dtype=np.float64
        )
        verify = np.array(
            [cost_model.step_cost(context_length)]
            + [
                cost_model.verify_cost(k + 1, context_length)
                for k in range(1, max_draft_length + 1)
            ],
            dtype=np.float64,
        )
        return cls(draft=draft, verify=verify, planning=planning)

    @classmethod
    def layer_counting(cls, masks: Sequence[SublayerMask], max_draft_length: int) -> RoundCosts:
        """DEL's uniform costs: a draft costs its executed items, a verify (any length) all
        ``2L`` items. Grid search over these maximises tokens-per-layer."""
        if not masks:
            raise ValueError("layer_counting needs at least one mask")
        total = float(masks[0].num_items)
        draft = np.array([m.num_items - m.num_skipped for m in masks], dtype=np.float64)
        return cls(draft=draft, verify=np.full(max_draft_length + 1, total))


@attrs.frozen
class GridSearchResult:
    """The best (candidate, γ) and the whole objective table.

    Attributes:
        candidate: index of the best candidate (meaningless when ``draft_length == 0``:
            every candidate gives the same plain step; it is then 0).
        draft_length: the best γ.
        objective: the best objective value (tokens per second for TPT).
        expected_tokens: ``E(α, γ)`` of the best option.
        table: ``(K, D + 1)`` objective of every option (``-inf`` where excluded).
    """

    candidate: int
    draft_length: int
    objective: float
    expected_tokens: float
    table: FloatArray

    @property
    def speculates(self) -> bool:
        return self.draft_length > 0


def grid_search(
    alphas: npt.ArrayLike,
    costs: RoundCosts,
    *,
    allow_no_speculation: bool = True,
) -> GridSearchResult:
    """Maximise ``E(α_k, γ) / (γ·draft_k + verify[γ] + planning·[γ > 0])`` over
    candidates ``k`` × ``γ ∈ {0, ..., D}``.

    Args:
        alphas: ``(K,)`` acceptance of each candidate.
        costs: :class:`RoundCosts` with ``K`` draft costs and ``D + 1`` verify costs.
        allow_no_speculation: include γ = 0 (off only for the ablation; with ``D = 0`` it is
            the only option and stays).

    Returns:
        :class:`GridSearchResult`. Ties go to the smaller γ, then the smaller index.
    """
    alpha = np.asarray(alphas, dtype=np.float64).reshape(-1)
    if alpha.size == 0:
        raise ValueError("grid_search needs at least one candidate")
    if alpha.shape != costs.draft.shape:
        raise ValueError(f"{alpha.size} acceptance rates for {costs.draft.size} draft costs")
    if not np.all(np.isfinite(alpha)):
        raise ValueError(f"acceptance rates must be finite, got {alpha}")
    if np.any(costs.draft < 0) or np.any(~(costs.verify > 0)) or costs.planning < 0:
        raise ValueError("costs must be finite with draft >= 0, verify > 0 and planning >= 0")
    max_gamma = costs.verify.size - 1
    gamma = np.arange(max_gamma + 1)
    gain = expected_tokens(alpha[:, None], gamma[None, :])  # (K, D + 1)
    spend = (
        gamma[None, :] * costs.draft[:, None]
        + costs.verify[None, :]
        + np.where(gamma > 0, costs.planning, 0.0)[None, :]
    )
    table: FloatArray = gain / spend
    if not allow_no_speculation and max_gamma > 0:
        table[:, 0] = -np.inf
    # Column-major flattening so that ties prefer the smaller γ, then the smaller index.
    flat = int(np.argmax(table.T))
    best_gamma, best_candidate = divmod(flat, alpha.size)
    if best_gamma == 0:
        best_candidate = 0
    return GridSearchResult(
        candidate=best_candidate,
        draft_length=best_gamma,
        objective=float(table[best_candidate, best_gamma]),
        expected_tokens=float(gain[best_candidate, best_gamma]),
        table=table,
    )


def chained_expected_tokens(conditional: npt.ArrayLike) -> FloatArray:
    """``E[γ]`` for ``γ = 0 .. L``: tokens committed per round when draft token ``j`` is
    accepted with probability ``conditional[j]`` given tokens ``< j`` were,

        E[γ] = 1 + Σ_{k=1}^{γ} Π_{j<k} conditional[j]   (the bonus / correction token is the 1).

    With a constant ``conditional = α`` this is :func:`expected_tokens`.

    Args:
        conditional: ``(L,)`` conditional acceptance per draft position, clipped to [0, 1].
    """
    rates = np.clip(np.asarray(conditional, dtype=np.float64).reshape(-1), 0.0, 1.0)
    reach = np.cumprod(rates)  # (L,): P(first k + 1 drafts all accepted)
    result: FloatArray = 1.0 + np.concatenate(([0.0], np.cumsum(reach)))
    return result


def best_chained_length(
    conditional: npt.ArrayLike, verify: npt.ArrayLike, draft_cost: float = 0.0
) -> tuple[int, FloatArray]:
    """The TPT-optimal cut of a draft whose tokens already exist (a lookup proposal).

    Args:
        conditional: ``(L,)`` conditional acceptance per draft position.
        verify: ``(≥ L + 1,)`` round costs: ``verify[0]`` a plain step, ``verify[k]`` the
            full model over ``k + 1`` tokens.
        draft_cost: cost added to every speculative round (γ >= 1).

    Returns:
        ``(γ, tpt)``: the best γ in ``0..L`` (ties to the smaller) and ``(L + 1,)`` the
        tokens per unit time of every cut.
    """
    gain = chained_expected_tokens(conditional)
    costs = np.asarray(verify, dtype=np.float64)[: gain.size]
    if costs.size < gain.size:
        raise ValueError(f"{gain.size - 1} draft tokens need {gain.size} verify costs")
    if not np.all(costs > 0) or draft_cost < 0:
        raise ValueError("verify costs must be positive and draft_cost >= 0")
    spend = costs + np.where(np.arange(gain.size) > 0, draft_cost, 0.0)
    tpt: FloatArray = gain / spend
    return int(np.argmax(tpt)), tpt


__all__ = [
    "GridSearchResult",
    "RoundCosts",
    "best_chained_length",
    "breakeven_acceptance",
    "chained_expected_tokens",
    "expected_tokens",
    "grid_search",
    "tokens_per_layer",
    "tokens_per_time",
]
