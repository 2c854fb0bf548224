"""Monte-Carlo acceptance: estimate α directly by running the candidate on the window."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Self

import attrs
import torch

from knapspec.proxies.base import PROXIES, AcceptanceEstimate, ValueProxy
from knapspec.proxies.intervals import mean_interval, wilson_interval
from knapspec.proxies.validation import check_score_inputs, check_window_inputs
from knapspec.sampling import POSITION_KEYED, SamplingParams, processed_probs
from knapspec.scores import mean_cosine
from knapspec.validators import check_finite, open_unit_interval

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow

ScoreMode = Literal["cosine", "neg-kl"]


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-token acceptance probability of speculative rejection sampling, ``Σ_v min(p, q)``.

    A draft token ``x ~ q`` is accepted with probability ``min(1, p(x)/q(x))``, so
    ``P(accept) = Σ_x q(x) min(1, p(x)/q(x)) = Σ_x min(q(x), p(x)) = 1 - TV(p, q)``.

    Args:
        p: ``(..., V)`` target probabilities; q: ``(..., V)`` draft probabilities.

    Returns:
        ``(...)`` in [0, 1].
    """
    if p.shape != q.shape:
        raise ValueError(
            f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    check_finite(p, "p")
    check_finite(q, "q")
    return torch.minimum(p, q).sum(dim=-1).clamp(0.0, 1.0)


#: Tokens (the largest ``p + q``) :func:`coupling_acceptance` sums exactly.
COUPLING_CANDIDATES = 32


def coupling_acceptance(
    p: torch.Tensor, q: torch.Tensor, candidates: int = COUPLING_CANDIDATES
) -> torch.Tensor:
    """Per-token acceptance of a draft drawn with the target's Gumbel noise (position-keyed
    sampling): ``P(argmax(log q + G) = argmax(log p + G))``, from below.

    With ``G = -log E`` for ``E`` i.i.d. exponential, both argmaxes equal ``i`` iff
    ``E_j > E_i max(p_j / p_i, q_j / q_i)`` for every ``j``, so the exact value is
    ``Σ_i 1 / Σ_j max(p_j / p_i, q_j / q_i)``. It is summed over the ``candidates``
    tokens of largest ``p + q``; the others enter the inner sums through their total
    masses ``P, Q`` as ``P / p_i + Q / q_i`` (>= their true share), so the result never
    exceeds the exact value. It is raised to ``a / (2 - a)``, ``a = Σ min(p, q)``, where
    that is larger (a lower bound for every ``p, q``: Daliri, Musco & Suresh 2024,
    "Coupling without communication and drafter-invariant speculative decoding"), and it
    never exceeds ``a`` (no coupling does better).

    Args:
        p: ``(..., V)`` target probabilities; q: ``(..., V)`` draft probabilities.

    Returns:
        ``(...)`` in [0, 1].
    """
    a = acceptance_probability(p, q)
    k = min(candidates, p.shape[-1])
    index = torch.topk(p + q, k, dim=-1).indices
    p_c, q_c = p.gather(-1, index).double(), q.gather(-1, index).double()  # (..., k)
    p_rest = (1.0 - p_c.sum(-1, keepdim=True)).clamp_min(0.0)
    q_rest = (1.0 - q_c.sum(-1, keepdim=True)).clamp_min(0.0)
    both = (p_c > 0) & (q_c > 0)
    p_i = torch.where(both, p_c, 1.0).unsqueeze(-1)  # (..., k, 1): the term's own token
    q_i = torch.where(both, q_c, 1.0).unsqueeze(-1)
    ratios = torch.maximum(p_c.unsqueeze(-2) / p_i, q_c.unsqueeze(-2) / q_i)  # (..., k, k)
    inner = ratios.sum(-1) + (p_rest / p_i.squeeze(-1)) + (q_rest / q_i.squeeze(-1))
    exact_part = torch.where(both, 1.0 / inner, 0.0).sum(-1).to(a.dtype)
    return torch.minimum(torch.maximum(exact_part, a / (2.0 - a)), a)


@attrs.frozen
class MonteCarloProxyConfig:
    """Hyper-parameters of :class:`MonteCarloAcceptanceProxy`.

    Attributes:
        score: the per-branch value a planner maximises.
            ``"cosine"`` (default): mean per-token cosine, as in the cosine proxy. A DP calls
            ``score`` at every one of the ``2L`` item points, where a value through the LM
            head would be both expensive (an ``(r, V)`` matmul per branch per item) and
            meaningless (intermediate states are not final states).
            ``"neg-kl"``: ``-mean KL(p_target || q_candidate)`` of the next-token
            distributions through the final norm and head at temperature 1; meaningful for
            final states only (for scoring finished candidates).
        confidence: level of the reported interval.
    """

    score: ScoreMode = attrs.field(
        default="cosine", validator=attrs.validators.in_(("cosine", "neg-kl"))
    )
    confidence: float = attrs.field(default=0.95, validator=open_unit_interval)


#: The defaults, written once (in the record) for the keyword arguments too.
_DEFAULTS = MonteCarloProxyConfig()


@PROXIES.register("montecarlo")
class MonteCarloAcceptanceProxy(ValueProxy):
    """α measured on the window: greedy agreement, or the exact sampling acceptance.

    Greedy: α = share of window tokens whose candidate argmax equals the target's, with a
    Wilson interval. Sampling: α = mean over window tokens of the verification scheme's
    acceptance of ``p``, ``q``, the target's and candidate's :func:`processed_probs` at the
    decoder's temperature / top-k / top-p, with a normal interval: ``Σ_v min(p(v), q(v))``
    for rejection sampling, :func:`coupling_acceptance` for position-keyed sampling.

    Args:
        score, confidence: see :class:`MonteCarloProxyConfig`.
        engine: needed by ``score="neg-kl"`` (the final norm and head).
    """

    config_class = MonteCarloProxyConfig

    def __init__(
        self,
        *,
        score: ScoreMode = _DEFAULTS.score,
        confidence: float = _DEFAULTS.confidence,
        engine: SublayerEngine | None = None,
    ) -> None:
        self.config = MonteCarloProxyConfig(score=score, confidence=confidence)
        if score == "neg-kl" and engine is None:
            raise ValueError("score='neg-kl' needs the engine (its final norm and LM head)")
        self.engine = engine
        self._target_logits: tuple[ReferenceWindow, torch.Tensor] | None = None

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        return cls(score=config.score, confidence=config.confidence, engine=engine)

    @property
    def score_range(self) -> tuple[float, float]:
        """``[-1, 1]`` for ``score="cosine"``; ``(-inf, 0]`` for ``"neg-kl"`` (a negated
        divergence)."""
        return (-1.0, 1.0) if self.config.score == "cosine" else (-math.inf, 0.0)

    @torch.inference_mode()
    def score(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """``(B,)`` value of ``candidate (B, r, d)`` against ``reference (r, d)``."""
        check_score_inputs(reference, candidate)
        if self.config.score == "cosine":
            return mean_cosine(reference, candidate)
        assert self.engine is not None  # checked in __init__
        target = torch.log_softmax(self.engine.logits(reference), dim=-1)  # (r, V)
        values = []
        for branch in candidate:  # one (r, V) block at a time bounds memory
            draft = torch.log_softmax(self.engine.logits(branch), dim=-1)
            kl = (target.exp() * (target - draft)).sum(dim=-1)  # (r,)
            values.append(-kl.mean())
        return torch.stack(values)

    def _target(self, engine: SublayerEngine, window: ReferenceWindow) -> torch.Tensor:
        """``(r, V)`` the full model's logits on the window (cached per window)."""
        if self._target_logits is None or self._target_logits[0] is not window:
            self._target_logits = (window, engine.logits(window.final_hidden))
        return self._target_logits[1]

    @torch.inference_mode()
    def per_token_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> torch.Tensor:
        """``(B, r)`` per-token acceptance: 0/1 agreement (greedy), ``Σ min(p, q)``
        (rejection sampling) or :func:`coupling_acceptance` (position-keyed sampling)."""
        check_window_inputs(engine, window, candidate_final)
        rows = []
        if not sampling.do_sample:
            targets = window.target_tokens.to(engine.device)
            for branch in candidate_final:
                rows.append((engine.logits(branch).argmax(dim=-1) == targets).float())
            return torch.stack(rows)
        p = processed_probs(self._target(engine, window), sampling)
        keyed = sampling.verification == POSITION_KEYED
        for branch in candidate_final:
            q = processed_probs(engine.logits(branch), sampling)
            rows.append(coupling_acceptance(p, q) if keyed else acceptance_probability(p, q))
        return torch.stack(rows)

    @torch.inference_mode()
    def estimate_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> list[AcceptanceEstimate]:
        """α per candidate with a confidence interval from the window's token count."""
        per_token = self.per_token_acceptance(engine, window, candidate_final, sampling)
        confidence = self.config.confidence
        if not sampling.do_sample:
            size = per_token.shape[1]
            return [wilson_interval(int(row.sum()), size, confidence) for row in per_token]
        return [mean_interval(row, confidence) for row in per_token]


__all__ = [
    "MonteCarloAcceptanceProxy",
    "MonteCarloProxyConfig",
    "ScoreMode",
    "acceptance_probability",
    "coupling_acceptance",
]
