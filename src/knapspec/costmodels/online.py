"""Online self-calibration: a fitted prior corrected by recursive least squares.

The decoder reports every measured step (:class:`LatencyObservation`); the model keeps
the prior's shape (per-layer lines, the verify law) and learns an additive correction
that is linear in the same features:

* draft step with mask ``S`` at context ``n``:
  ``Δt = Δo + Δa·n_attn(S) + Δb·n_attn(S)·n + Δc·n_mlp(S)``, i.e. a shift of the
  overhead, of every attention item's intercept and slope, and of every MLP item (with
  sliding-window layers ``n_attn(S)·n`` is ``Σ min(n, W_i)`` over the executed attention
  items, and ``n`` below is the prior's mean effective context: the prior's own features);
* verify step over ``k`` tokens: ``Δt = ΔA_k + ΔB_k·n``, one line per width ``k`` like the
  prior's (the cost is a staircase in ``k``, see :mod:`knapspec.costmodels.linear`). In
  one regression this is the one-hot design ``[e_k, e_k·n]``; since an observation of
  width ``k`` only touches width ``k``'s block, each width has its own 2-feature
  regression. A width never observed is priced by the prior's shape at the level of the
  nearest observed width: the prior's cost times that width's corrected-over-prior ratio.
  Keeping the bare prior there deadlocks when the prior is off by a large factor (a profile
  measured while another process held the cores): once the one-token step is corrected
  down, every unobserved width looks many steps dear, so nothing is drafted and no width is
  ever observed.

When the machine's speed drifts, or the cache differs from the profiled one, the true law
moves and the correction follows it: recursive least squares with exponential forgetting
(factor ``λ``; memory about ``1/(1-λ)`` observations of each kind). Forgetting counts
verify observations of *every* width, as the one-hot regression would: a width's old
timings fade with time, not with how often that width happens to be chosen (see
:meth:`RecursiveLeastSquares.forget`). Observations more than
``outlier_ratio`` times off the current prediction (a page fault, another process taking
the cores) are skipped, unless ``outlier_patience`` arrive in a row, which means the law
itself changed; an accepted observation's error is clipped to ``innovation_clip`` times the
prediction (a Huber-like bound: one noisy step cannot swing the model), except after such
a streak. The covariance trace is capped (at 100x its initial value; per width for verify)
so that forgetting cannot blow up directions the decoder never excites (e.g. ``Δa`` vs
``Δo`` when every draft uses the same mask, or a width it stopped using).

Why not ``SGDRegressor.partial_fit``: it needs feature scaling and a learning-rate
schedule to converge on these ill-conditioned features, and one call costs tens of
microseconds of validation; the RLS update (:mod:`knapspec.costmodels.rls`) is a handful
of 4x4 (draft) or 2x2 (verify) numpy operations (measured in
``benchmarks/costmodel_accuracy.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import attrs
import numpy as np
from numpy.typing import ArrayLike, NDArray

from knapspec.costmodels.base import COST_MODELS, CostModel, LatencyObservation
from knapspec.costmodels.linear import MIN_SECONDS, FittedLinearCostModel, LinearCoefficients
from knapspec.costmodels.local_layers import executed_attention_context
from knapspec.costmodels.rls import FORGETTING_FACTOR, RecursiveLeastSquares
from knapspec.costmodels.store import load_or_measure_profile
from knapspec.types import SublayerMask
from knapspec.validators import interval, non_empty_string, optional

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

#: Internal units keep the RLS well conditioned and its hyper-parameters scale-free: times
#: are fractions of the prior's one-token step at REFERENCE_CONTEXT, contexts are in units
#: of CONTEXT_SCALE tokens and item counts are fractions of the layer count, so that every
#: feature is O(1) where decoding runs.
REFERENCE_CONTEXT = 1024
CONTEXT_SCALE = 4096.0
#: Queued observations are absorbed at the latest when this many have accumulated.
MAX_PENDING = 256


@attrs.frozen
class OnlineCalibratedCostModelConfig:
    """Hyper-parameters of :class:`OnlineCalibratedCostModel`.

    Attributes:
        profile: prior profile path; None = the cached profile for this model and machine
            (a quick self-profile of a few seconds on first use).
        pooled: prior with one attention line / MLP time for all layers.
        force: accept a profile measured for another model or machine.
        forgetting_factor: RLS ``λ``; memory about ``1/(1-λ)`` observations per kind.
        initial_uncertainty: prior standard deviation of each correction coefficient, as a
            fraction of the prior's one-token step time (larger = faster first moves).
        innovation_clip: one observation moves the prediction at its own point by at most
            this fraction of the prediction (bounds the influence of noisy steps).
        outlier_ratio: skip an observation more than this factor off the prediction; no
            prediction falls below the prior's divided by this factor.
        outlier_patience: accept outliers after this many in a row (the law changed).
    """

    profile: str | None = attrs.field(default=None, validator=optional(non_empty_string))
    pooled: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    force: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    forgetting_factor: float = attrs.field(
        default=FORGETTING_FACTOR, validator=interval(0.0, 1.0, low_open=True)
    )
    initial_uncertainty: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    innovation_clip: float = attrs.field(default=0.5, validator=attrs.validators.gt(0))
    outlier_ratio: float = attrs.field(default=10.0, validator=attrs.validators.gt(1))
    outlier_patience: int = attrs.field(default=5, validator=attrs.validators.ge(1))


#: The defaults, written once (in the record) for the keyword arguments too.
_DEFAULTS = OnlineCalibratedCostModelConfig()


@COST_MODELS.register("online")
class OnlineCalibratedCostModel(CostModel):
    """A :class:`FittedLinearCostModel` prior plus an online RLS correction.

    Hyper-parameters are stored by ``__init__`` unvalidated (scikit-learn convention);
    they are checked when the learned state is first built.

    Args:
        prior: the fitted model the corrections start from (a profile or quick profile).
        forgetting_factor, initial_uncertainty, innovation_clip, outlier_ratio,
            outlier_patience: see
            :class:`OnlineCalibratedCostModelConfig`.

    Attributes:
        draft_rls_: the draft correction ``(Δo, Δa, Δb, Δc)`` (internal units: see
            ``REFERENCE_CONTEXT``).
        verify_rls_: ``{k: regression}``, width ``k``'s correction ``(ΔA_k, ΔB_k)`` on the
            features ``[1, n / CONTEXT_SCALE]``; created when width ``k`` is first observed.
        verify_clock_: verify observations absorbed (all widths): the forgetting clock.
        time_unit_: seconds of one internal time unit (the prior's step at 1024 tokens).
        n_observed_: observations absorbed; n_outliers_: observations skipped.
    """

    config_class = OnlineCalibratedCostModelConfig
    time_unit_: float

    def __init__(
        self,
        prior: FittedLinearCostModel,
        *,
        forgetting_factor: float = _DEFAULTS.forgetting_factor,
        initial_uncertainty: float = _DEFAULTS.initial_uncertainty,
        innovation_clip: float = _DEFAULTS.innovation_clip,
        outlier_ratio: float = _DEFAULTS.outlier_ratio,
        outlier_patience: int = _DEFAULTS.outlier_patience,
    ) -> None:
        self.prior = prior
        self.forgetting_factor = forgetting_factor
        self.initial_uncertainty = initial_uncertainty
        self.innovation_clip = innovation_clip
        self.outlier_ratio = outlier_ratio
        self.outlier_patience = outlier_patience
        self._profile: str | None = None
        self._force = False

    @property
    def config(self) -> OnlineCalibratedCostModelConfig:
        """The hyper-parameters as their validated record.

        Raises:
            ValueError: a hyper-parameter is out of range (the message names it).
        """
        return OnlineCalibratedCostModelConfig(
            profile=self._profile,
            pooled=self.prior.pooled,
            force=self._force,
            forgetting_factor=self.forgetting_factor,
            initial_uncertainty=self.initial_uncertainty,
            innovation_clip=self.innovation_clip,
            outlier_ratio=self.outlier_ratio,
            outlier_patience=self.outlier_patience,
        )

    @config.setter
    def config(self, value: OnlineCalibratedCostModelConfig) -> None:
        # from_config passes the record the model was built from: keep what the
        # attributes do not hold (where the prior's profile came from).
        self._profile, self._force = value.profile, value.force

    # ----------------------------------------------------------------- building
    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        profile = load_or_measure_profile(engine, config.profile, force=config.force)
        return cls(
            FittedLinearCostModel.from_profile(profile, pooled=config.pooled),
            forgetting_factor=config.forgetting_factor,
            initial_uncertainty=config.initial_uncertainty,
            innovation_clip=config.innovation_clip,
            outlier_ratio=config.outlier_ratio,
            outlier_patience=config.outlier_patience,
        )

    def _state(self) -> tuple[RecursiveLeastSquares, dict[int, RecursiveLeastSquares]]:
        """The learned state with every queued observation absorbed, built (and the
        hyper-parameters validated) on first use."""
        try:
            state = self._draft_rls, self._verify_rls
        except AttributeError:
            state = self._build_state()
        if self._pending:
            self._flush()
        return state

    def _build_state(self) -> tuple[RecursiveLeastSquares, dict[int, RecursiveLeastSquares]]:
        self.config  # noqa: B018 - building the record validates the hyper-parameters
        variance = float(self.initial_uncertainty) ** 2
        self._initial_variance = variance
        self.time_unit_ = self.prior.step_cost(REFERENCE_CONTEXT)
        draft_rls = RecursiveLeastSquares(self.forgetting_factor, variance)
        draft_rls.initialize(4)
        self._pending: list[LatencyObservation] = []
        self._verify_last_update: dict[int, int] = {}  # width -> verify clock at its update
        self._verify_clock = 0
        self._n_observed = 0
        self._n_outliers = 0
        self._outlier_streak = 0
        self._draft_rls = draft_rls
        self._verify_rls: dict[int, RecursiveLeastSquares] = {}
        return self._draft_rls, self._verify_rls

    # The learned state, read through _state() so that queued observations count.
    @property
    def draft_rls_(self) -> RecursiveLeastSquares:
        return self._state()[0]

    @property
    def verify_rls_(self) -> dict[int, RecursiveLeastSquares]:
        return self._state()[1]

    @property
    def verify_clock_(self) -> int:
        self._state()
        return self._verify_clock

    @property
    def n_observed_(self) -> int:
        self._state()
        return self._n_observed

    @property
    def n_outliers_(self) -> int:
        self._state()
        return self._n_outliers

    # ----------------------------------------------------------------- features
    def _draft_features(self, mask: SublayerMask, context_length: int) -> NDArray[np.float64]:
        layers, windows = self.prior.num_layers, self.prior.windows
        attention = mask.num_attention_executed / layers
        if windows:  # each executed attention item pays for its own effective context
            paid = executed_attention_context(mask.executed, context_length, windows)
            attended = paid / (CONTEXT_SCALE * layers)
        else:
            attended = attention * (context_length / CONTEXT_SCALE)
        return np.array([1.0, attention, attended, mask.num_mlp_executed / layers])

    def _verify_features(self, context_length: int) -> NDArray[np.float64]:
        """``(2,)`` features of one width's block: ``[1, n / CONTEXT_SCALE]`` (``n``: the
        prior's mean effective context, the context itself without windows)."""
        return np.array([1.0, self.prior.mean_attention_context(context_length) / CONTEXT_SCALE])

    def _verify_block(self, tokens: int) -> RecursiveLeastSquares:
        """Width ``tokens``' regression, created (zero correction, ``P0``) on first use."""
        blocks = self._verify_rls
        rls = blocks.get(tokens)
        if rls is None:
            rls = RecursiveLeastSquares(self.forgetting_factor, self._initial_variance)
            rls.initialize(2)
            blocks[tokens] = rls
        return rls

    def _corrected(
        self, base: float, features: NDArray[np.float64], rls: RecursiveLeastSquares
    ) -> float:
        """The prior's ``base`` seconds plus the learned correction, floored (see config)."""
        value = base + float(features @ rls.coef_) * self.time_unit_
        return max(value, base / self.outlier_ratio, MIN_SECONDS)

    # ------------------------------------------------------------- predictions
    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        theta = self._state()[0].coef_
        prior = self.prior
        if layer is None:
            context = prior.mean_attention_context(context_length)
        else:
            context = prior.attention_context(context_length, layer)
        per_item = theta[1] + theta[2] * context / CONTEXT_SCALE
        shift = per_item * self.time_unit_ / self.prior.num_layers
        return max(prior.t_attn(context_length, layer) + float(shift), MIN_SECONDS)

    def t_mlp(self, layer: int | None = None) -> float:
        theta = self._state()[0].coef_
        shift = theta[3] * self.time_unit_ / self.prior.num_layers
        return max(self.prior.t_mlp(layer) + float(shift), MIN_SECONDS)

    def overhead(self, context_length: int) -> float:
        shift = self._state()[0].coef_[0] * self.time_unit_
        return max(self.prior.overhead(context_length) + float(shift), 0.0)

    def draft_cost(self, mask: SublayerMask, context_length: int) -> float:
        draft_rls = self._state()[0]
        base = self.prior.draft_cost(mask, context_length)
        return self._corrected(base, self._draft_features(mask, context_length), draft_rls)

    def verify_cost(self, tokens: int, context_length: int) -> float:
        blocks = self._state()[1]
        base = self.prior.verify_cost(tokens, context_length)
        rls = blocks.get(tokens)
        features = self._verify_features(context_length)
        if rls is not None:
            return self._corrected(base, features, rls)
        if not blocks:  # nothing observed yet: the prior's price
            return max(base, MIN_SECONDS)
        # Never observed: the prior's shape at the nearest observed width's level.
        nearest = min(blocks, key=lambda k: (abs(k - tokens), k))
        reference = self.prior.verify_cost(nearest, context_length)
        level = self._corrected(reference, features, blocks[nearest]) / reference
        return max(base * level, MIN_SECONDS)

    def coefficients(self) -> LinearCoefficients:
        """The prior's layer-averaged coefficients plus the learned corrections (seconds).

        ``verify`` covers widths ``1..max(K, widest observed)``, ``K`` the prior's table;
        an unobserved width reports the prior's line (:meth:`verify_cost` prices it at the
        nearest observed width's level, a ratio no line holds at every context).
        """
        draft_rls, blocks = self._state()
        unit = self.time_unit_
        draft = draft_rls.coef_ * unit
        prior = self.prior.coefficients()
        layers = self.prior.num_layers
        verify = []
        for k in range(1, max(prior.max_width, *blocks, 0) + 1):
            a, b = self.prior.verify_law(k)
            if k in blocks:
                delta_a, delta_b = blocks[k].coef_ * unit
                a, b = a + delta_a, b + delta_b / CONTEXT_SCALE
            verify.append((float(a), float(b)))
        return LinearCoefficients(
            overhead=prior.overhead + draft[0],
            attn_intercept=prior.attn_intercept + draft[1] / layers,
            attn_slope=prior.attn_slope + draft[2] / (CONTEXT_SCALE * layers),
            mlp=prior.mlp + draft[3] / layers,
            verify=verify,
        )

    # ----------------------------------------------------------------- learning
    def observe(self, observation: LatencyObservation) -> None:
        """Queue one measured step (called by the decoder on its hot path).

        Observations are absorbed in order by the next prediction (or once
        ``MAX_PENDING`` are queued), so a decode step pays for a list append: on the
        decoder's hot path, right after a forward, the RLS update's dozen numpy calls cost
        many times what they cost in a quiet loop (measured in ``docs/architecture.md``,
        "Where the design departs from the first sketch"). The result is the same as
        absorbing each one at once.
        """
        if observation.kind == "draft":
            if observation.mask is None:
                raise ValueError("a draft LatencyObservation needs its mask")
        elif observation.kind != "verify":
            raise ValueError(
                f"LatencyObservation.kind must be 'draft' or 'verify', got {observation.kind!r}"
            )
        seconds = observation.seconds
        if not (seconds > 0 and seconds < float("inf")):
            return  # a broken timer reading carries no information
        try:
            pending = self._pending
        except AttributeError:
            self._state()
            pending = self._pending
        pending.append(observation)
        if len(pending) >= MAX_PENDING:
            self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for observation in pending:
            self._absorb(observation)

    def _absorb(self, observation: LatencyObservation) -> None:
        """The RLS update for one (validated) observation."""
        seconds = observation.seconds
        n = observation.context_length
        if observation.kind == "draft":
            assert observation.mask is not None  # checked by observe
            features = self._draft_features(observation.mask, n)
            base = self.prior.draft_cost(observation.mask, n)
            rls = self._draft_rls
        else:
            features = self._verify_features(n)
            base = self.prior.verify_cost(observation.tokens, n)
            rls = self._verify_block(observation.tokens)
        predicted = self._corrected(base, features, rls)
        ratio = seconds / predicted
        unit = self.time_unit_
        max_error: float | None = self.innovation_clip * predicted / unit
        if ratio > self.outlier_ratio or ratio * self.outlier_ratio < 1:
            self._outlier_streak += 1
            if self._outlier_streak < self.outlier_patience:
                self._n_outliers += 1
                return
            max_error = None  # a streak of outliers: the law changed, follow it unclipped
        self._outlier_streak = 0
        if observation.kind == "verify":
            # The shared clock: age this width's block by every verify update since its own
            # last one (since clock 0 for a first update), exactly as one regression over
            # the one-hot features [e_k, e_k·n] would age it; its prior fades the same way.
            self._verify_clock += 1
            last = self._verify_last_update.get(observation.tokens, 0)
            rls.forget(self._verify_clock - 1 - last)
            self._verify_last_update[observation.tokens] = self._verify_clock
        rls.update(features, (seconds - base) / unit, max_error)
        self._n_observed += 1

    def partial_fit(
        self, X: Sequence[LatencyObservation], y: ArrayLike | None = None
    ) -> OnlineCalibratedCostModel:
        """Absorb observations in order; ``y`` (seconds) overrides their ``seconds``."""
        if y is not None:
            seconds = np.asarray(y, dtype=np.float64).reshape(-1)
            if seconds.shape[0] != len(X):
                raise ValueError(f"{len(X)} observations but {seconds.shape[0]} targets")
            X = [attrs.evolve(obs, seconds=float(s)) for obs, s in zip(X, seconds, strict=True)]
        for observation in X:
            self.observe(observation)
        return self

    def predict(self, X: Sequence[LatencyObservation]) -> NDArray[np.float64]:
        """Predicted seconds of each observed step (its ``seconds`` is ignored)."""
        return np.array(
            [
                self.draft_cost(obs.mask, obs.context_length)
                if obs.kind == "draft" and obs.mask is not None
                else self.verify_cost(obs.tokens, obs.context_length)
                for obs in X
            ]
        )

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(prior={self.prior!r}, forgetting_factor={self.forgetting_factor})"


__all__ = [
    "OnlineCalibratedCostModel",
    "OnlineCalibratedCostModelConfig",
    "RecursiveLeastSquares",
]
