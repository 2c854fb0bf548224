"""Cost models on sliding-window (local) layers: a tiny Gemma 3 whose local layers attend a
16-token window, so that short contexts cross it.

The oracle is the generating law itself (:class:`WindowedLaw`): every local layer's
attention flat past its window, the verify law linear in the layers' mean effective
context. A fitted model must reproduce it at held-out contexts on both sides of the window,
the online model must converge to it from observations, and the knapsack planner's item
weights must make a local layer's attention lighter than a global one's past the window.
The mutant in each power check is the same timings without the windows (a profile that
prices ``n``): it fails the same checks. Models without windows keep their prices bit for
bit (the old formulas, inline).
"""

from __future__ import annotations

import functools
import json
import math

import attrs
import numpy as np
import pytest

from knapspec.costmodels import (
    FittedLinearCostModel,
    LatencyObservation,
    LatencyProfile,
    OnlineCalibratedCostModel,
    ProfileKey,
    ProfileMismatchError,
    VerifyTiming,
    profile_engine,
)
from knapspec.costmodels.fitting import nonnegative_lstsq
from knapspec.costmodels.linear import MIN_SECONDS, verify_line
from knapspec.costmodels.local_layers import Windows, engine_windows
from knapspec.costmodels.online import CONTEXT_SCALE
from knapspec.model.engine import SublayerEngine
from knapspec.planners.knapsack import KnapsackPlanner, KnapsackPlannerConfig
from knapspec.testing import check_cost_model, planning_context, tiny_model
from knapspec.types import SublayerMask

WINDOW = 16
LAYERS = 6
#: Item ladder and verify grid: two contexts inside the window, three past it.
LADDER = (2, 8, 32, 96, 200)
VERIFY_CONTEXTS = (4, 40, 120, 230)
#: Held out from both: below, at and past the window.
HELD_OUT = (1, 4, 12, 16, 20, 64, 150, 250, 1000)
WIDTHS = range(1, 12)
#: The verify staircase in k (BLAS takes rows in blocks of 4), as in test_costmodels.
STEPS = (1.00, 1.05, 1.10, 1.10, 1.5, 1.75, 2.0, 2.0, 2.3, 2.7, 3.0)


@functools.cache
def gemma_engine() -> SublayerEngine:
    """The tiny Gemma 3 (:func:`tiny_model`, window 8) with 6 layers and a 16-token window:
    layers 2 and 5 global, the others local."""
    model = tiny_model("gemma3", num_layers=LAYERS)
    model.config.sliding_window = WINDOW
    return SublayerEngine(model)


def gemma_windows() -> Windows:
    windows = engine_windows(gemma_engine())
    assert windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None)
    return windows


@attrs.frozen
class WindowedLaw:
    """The generating function: ``t_attn(n, i) = a_i + b·min(n, W_i)`` (one per-key cost:
    every layer has the same shape), ``t_mlp(i) = c_i``, overhead ``o``, and
    ``t_verify(k, n) = A_k + B_k·m(n)`` with ``m(n)`` the layers' mean ``min(n, W_i)``."""

    windows: Windows
    intercepts: tuple[float, ...]
    slope: float
    mlps: tuple[float, ...]
    overhead: float
    verify: tuple[tuple[float, float], ...]

    @classmethod
    def make(cls, windows: Windows, spread: float = 0.1, scale: float = 1.0) -> WindowedLaw:
        layers = len(windows) or LAYERS
        return cls(
            windows=windows,
            intercepts=tuple(scale * 0.2e-3 * (1 + spread * i) for i in range(layers)),
            slope=scale * 4e-6,
            mlps=tuple(scale * 0.5e-3 * (1 + 0.5 * spread * i) for i in range(layers)),
            overhead=scale * 3e-3,
            verify=tuple(
                (scale * 10e-3 * s, scale * 4e-6 * layers * (1 + 0.1 * (k - 1)))
                for k, s in enumerate(STEPS, 1)
            ),
        )

    def effective(self, n: int, layer: int) -> int:
        window = self.windows[layer] if self.windows else None
        return n if window is None else min(n, window)

    def t_attn(self, n: int, layer: int) -> float:
        return self.intercepts[layer] + self.slope * self.effective(n, layer)

    def draft(self, mask: SublayerMask, n: int) -> float:
        layers = range(len(self.mlps))
        return (
            self.overhead
            + sum(self.t_attn(n, i) for i in layers if mask.attention(i))
            + sum(self.mlps[i] for i in layers if mask.mlp(i))
        )

    def t_verify(self, k: int, n: int) -> float:
        layers = len(self.mlps)
        mean = sum(self.effective(n, i) for i in range(layers)) / layers
        a, b = self.verify[k - 1]
        return a + b * mean

    def profile(self) -> LatencyProfile:
        layers = len(self.mlps)
        return LatencyProfile(
            key=ProfileKey.for_engine(gemma_engine()),
            contexts=LADDER,
            attention_seconds=[[self.t_attn(n, i) for n in LADDER] for i in range(layers)],
            mlp_seconds=[[self.mlps[i]] * len(LADDER) for i in range(layers)],
            overhead_seconds=[self.overhead] * len(LADDER),
            verify=[
                VerifyTiming(k, n, self.t_verify(k, n)) for n in VERIFY_CONTEXTS for k in WIDTHS
            ],
            windows=self.windows,
        )


def masks(count: int, seed: int = 0) -> list[SublayerMask]:
    rng = np.random.default_rng(seed)
    return [
        SublayerMask(tuple(bool(b) for b in rng.random(2 * LAYERS) < 0.6)) for _ in range(count)
    ]


def assert_prices(model: object, law: WindowedLaw, rel: float, *, per_layer: bool = True) -> None:
    """Every price of ``model`` within ``rel`` of ``law`` at every held-out context."""
    assert isinstance(model, FittedLinearCostModel | OnlineCalibratedCostModel)
    for n in HELD_OUT:
        if per_layer:
            for layer in range(LAYERS):
                got, want = model.t_attn(n, layer), law.t_attn(n, layer)
                assert got == pytest.approx(want, rel=rel), f"t_attn({n}, {layer})"
        for mask in masks(8):
            got, want = model.draft_cost(mask, n), law.draft(mask, n)
            assert got == pytest.approx(want, rel=rel), f"draft_cost at n={n}"
        for k in WIDTHS:
            got, want = model.verify_cost(k, n), law.t_verify(k, n)
            assert got == pytest.approx(want, rel=rel), f"verify_cost({k}, {n})"


def without_windows(profile: LatencyProfile) -> LatencyProfile:
    """The mutant: the same timings, read as if every layer were global (prices ``n``)."""
    return attrs.evolve(profile, windows=())


# ------------------------------------------------------------------------ the fitted model


@pytest.mark.parametrize("pooled", [False, True])
def test_the_fitted_model_prices_local_layers_exactly_on_both_sides_of_the_window(
    pooled: bool,
) -> None:
    law = WindowedLaw.make(gemma_windows(), spread=0.0 if pooled else 0.1)
    model = FittedLinearCostModel.from_profile(law.profile(), pooled=pooled)
    assert model.windows == law.windows
    assert_prices(model, law, rel=1e-6)
    # Past the window a local layer costs what it costs at the window; a global one grows.
    assert model.t_attn(1000, 0) == pytest.approx(model.t_attn(WINDOW, 0), rel=1e-9)
    assert model.t_attn(1000, 2) > 10 * model.t_attn(WINDOW, 2) / 2


def test_power_a_fit_that_ignores_the_window_misprices_local_layers() -> None:
    law = WindowedLaw.make(gemma_windows())
    mutant = FittedLinearCostModel.from_profile(without_windows(law.profile()))
    with pytest.raises(AssertionError):
        assert_prices(mutant, law, rel=1e-6)
    # By far, past the window: a local layer's line in n keeps growing.
    assert mutant.t_attn(1000, 0) > 1.5 * law.t_attn(1000, 0)


def test_a_local_layer_whose_window_is_below_the_ladder_borrows_the_slope() -> None:
    """A window at or below the shortest ladder context leaves one effective context: the
    layer keeps its time at the window and the global layers' per-key cost."""
    windows = (1, 1, None, 1, 1, None)
    law = WindowedLaw.make(windows, spread=0.0)
    profile = attrs.evolve(law.profile(), contexts=(2, 8, 32, 96, 200))
    model = FittedLinearCostModel.from_profile(profile)
    for n in HELD_OUT:
        assert model.t_attn(n, 0) == pytest.approx(law.t_attn(n, 0), rel=1e-6)
    assert model.attn_slope[0] == pytest.approx(model.attn_slope[2], rel=1e-6)


def test_windowed_cost_models_keep_the_cost_model_contract() -> None:
    engine = gemma_engine()
    profile = WindowedLaw.make(gemma_windows()).profile()
    check_cost_model(FittedLinearCostModel.from_profile(profile), engine, contexts=(4, 16, 200))
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(profile))
    check_cost_model(online, engine, contexts=(4, 16, 200))


# ------------------------------------------------------------------------ the online model


def observations(law: WindowedLaw, count: int, seed: int = 1) -> list[LatencyObservation]:
    """Draft and verify steps (alternating) timed by ``law`` at random masks, n and k."""
    rng = np.random.default_rng(seed)
    result = []
    for index in range(count):
        n = int(rng.integers(1, 1200))
        if index % 2 == 0:
            mask = SublayerMask(tuple(bool(b) for b in rng.random(2 * LAYERS) < 0.6))
            result.append(LatencyObservation("draft", n, law.draft(mask, n), 1, mask))
        else:
            k = int(rng.integers(1, 12))
            result.append(LatencyObservation("verify", n, law.t_verify(k, n), k))
    return result


def converged(prior_profile: LatencyProfile, machine: WindowedLaw) -> OnlineCalibratedCostModel:
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(prior_profile))
    online.partial_fit(observations(machine, 2400))
    return online


def test_the_online_model_converges_to_a_windowed_law_from_observations() -> None:
    """Prior: a profile of a machine 1.6x faster; observations: this one. The correction
    (shared by every item) follows each item's own effective context."""
    windows = gemma_windows()
    prior, machine = WindowedLaw.make(windows, 0.0), WindowedLaw.make(windows, 0.0, scale=1.6)
    online = converged(prior.profile(), machine)
    assert_prices(online, machine, rel=0.01)


def test_power_an_online_model_that_ignores_the_window_does_not_converge() -> None:
    windows = gemma_windows()
    prior, machine = WindowedLaw.make(windows, 0.0), WindowedLaw.make(windows, 0.0, scale=1.6)
    mutant = converged(without_windows(prior.profile()), machine)
    with pytest.raises(AssertionError):
        assert_prices(mutant, machine, rel=0.01)


# --------------------------------------------------------------------- knapsack weights


def dp_weights(cost_model: FittedLinearCostModel, n: int, *, decoupled: bool) -> tuple[int, ...]:
    context = planning_context(gemma_engine(), cost_model=cost_model, context_length=n)
    planner = KnapsackPlanner(KnapsackPlannerConfig(decoupled=decoupled))
    return planner.search(context).dp_weights


def test_past_the_window_the_planner_weighs_local_attention_below_global() -> None:
    law = WindowedLaw.make(gemma_windows(), spread=0.0)
    model = FittedLinearCostModel.from_profile(law.profile())
    local, global_ = (0, 1, 3, 4), (2, 5)
    # Decoupled items, at a long context: attention items 2i, MLPs 2i + 1.
    weights = dp_weights(model, 200, decoupled=True)
    assert {weights[2 * i] for i in local} == {1}
    assert all(weights[2 * g] > 3 * weights[2 * i] for g in global_ for i in local)
    assert len({weights[2 * i + 1] for i in range(LAYERS)}) == 1  # the MLPs weigh alike
    # Whole layers: a local layer is lighter.
    tied = dp_weights(model, 200, decoupled=False)
    assert max(tied[i] for i in local) < min(tied[g] for g in global_)
    # Inside the window every layer attends the same keys: no difference.
    short = model.item_weights(WINDOW - 4, gemma_engine().windows)
    assert len({short[2 * i] for i in range(LAYERS)}) == 1


def test_power_weights_by_kind_do_not_tell_local_layers_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mutant planner weighs every attention item alike (``weights(n)``, the layer
    mean: what it did before windows were known), and the check above sees it."""
    law = WindowedLaw.make(gemma_windows(), spread=0.0)
    model = FittedLinearCostModel.from_profile(law.profile())
    monkeypatch.setattr(
        FittedLinearCostModel,
        "item_weights",
        lambda self, n, windows: self.weights(n) * len(windows),
    )
    weights = dp_weights(model, 200, decoupled=True)
    assert not all(weights[2 * g] > 3 * weights[2 * i] for g in (2, 5) for i in (0, 1, 3, 4))


def test_without_windows_item_weights_are_the_per_kind_weights() -> None:
    model = FittedLinearCostModel.from_profile(WindowedLaw.make(gemma_windows()).profile())
    for n in (4, 200, 5000):
        assert model.item_weights(n, [None] * LAYERS) == model.weights(n) * LAYERS


# ---------------------------------------------------------------------------- profiles


def test_the_profiler_records_the_windows_and_a_profile_of_other_windows_is_refused(
    tmp_path: object,
) -> None:
    engine = gemma_engine()
    profile = profile_engine(
        engine,
        contexts=(4, 64),
        verify_contexts=(8, 100),
        verify_tokens=(1, 2),
        repeats=1,
        warmup=0,
        progress=False,
    )
    assert profile.windows == (WINDOW, WINDOW, None, WINDOW, WINDOW, None)
    assert json.loads(profile.to_json())["windows"] == [16, 16, None, 16, 16, None]
    assert LatencyProfile.from_dict(json.loads(profile.to_json())) == profile
    profile.check_compatible(engine)
    for other in (without_windows(profile), attrs.evolve(profile, windows=(8,) * LAYERS)):
        with pytest.raises(ProfileMismatchError, match="sliding windows"):
            other.check_compatible(engine, force=True)


# ------------------------------------------------------ models without windows: unchanged


def llama_profile() -> LatencyProfile:
    """A windowless profile with per-layer spread and noise (so fits are not trivial)."""
    rng = np.random.default_rng(3)
    contexts = (64, 256, 1024, 2048, 4000, 7000)
    noisy = lambda x: float(x * (1 + 0.05 * rng.standard_normal()))  # noqa: E731
    return LatencyProfile(
        key=ProfileKey.for_engine(gemma_engine()),
        contexts=contexts,
        attention_seconds=[
            [noisy((0.3e-3 + 0.1e-3 * i) + 0.2e-6 * n) for n in contexts] for i in range(LAYERS)
        ],
        mlp_seconds=[[noisy(0.5e-3)] * len(contexts) for _ in range(LAYERS)],
        overhead_seconds=[noisy(3e-3) for _ in contexts],
        verify=[
            VerifyTiming(k, n, noisy(10e-3 * STEPS[k - 1] + 5e-6 * n))
            for n in (128, 1024, 2560, 5120)
            for k in WIDTHS
        ],
    )


def test_without_windows_the_fitted_prices_are_the_old_formulas_bit_for_bit() -> None:
    profile = llama_profile()
    data = profile.to_dict()
    assert "windows" not in data  # the file reads as it did before the field
    reloaded = LatencyProfile.from_dict(data)  # ... and such a file still loads
    assert reloaded.windows == ()
    contexts = np.asarray(profile.contexts, dtype=np.float64)
    attention = np.asarray(profile.attention_seconds)
    design = np.stack([np.ones_like(contexts), contexts], axis=1)
    for model in (FittedLinearCostModel.from_profile(p) for p in (profile, reloaded)):
        a, b = nonnegative_lstsq(design, attention.T)
        assert np.array_equal(model.attn_intercept, a) and np.array_equal(model.attn_slope, b)
        floor = model.item_floor
        for n in (1, 100, 513, 4096, 9000):
            for i in range(LAYERS):
                assert model.t_attn(n, i) == max(float(a[i] + b[i] * n), floor)
            assert model.t_attn(n) == max(float(a.mean()) + float(b.mean()) * n, floor)
            for mask in masks(5, seed=n):
                old = max(model.overhead_s, 0.0)
                for i in range(LAYERS):
                    if mask.attention(i):
                        old += max(float(a[i]) + float(b[i]) * n, floor)
                    if mask.mlp(i):
                        old += max(float(model.mlp[i]), floor)
                assert model.draft_cost(mask, n) == old
            for k in range(1, 40):
                va, vb = verify_line(model.verify_intercept, model.verify_slope, k)
                assert model.verify_cost(k, n) == max(va + vb * n, MIN_SECONDS)
            assert model.item_weights(n, [None] * LAYERS) == model.weights(n) * LAYERS


def test_without_windows_the_online_features_are_the_old_ones_bit_for_bit() -> None:
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(llama_profile()))
    law = WindowedLaw.make((), scale=1.3)
    online.partial_fit(observations(law, 200))
    theta, unit = online.draft_rls_.coef_, online.time_unit_
    for n in (1, 100, 513, 4096, 9000):
        for mask in masks(5, seed=n):
            attention = mask.num_attention_executed / LAYERS
            old = [1.0, attention, attention * (n / CONTEXT_SCALE), mask.num_mlp_executed / LAYERS]
            assert np.array_equal(online._draft_features(mask, n), np.array(old))
        assert np.array_equal(online._verify_features(n), np.array([1.0, n / CONTEXT_SCALE]))
        for layer in (None, *range(LAYERS)):
            shift = (theta[1] + theta[2] * n / CONTEXT_SCALE) * unit / LAYERS
            old_price = max(online.prior.t_attn(n, layer) + float(shift), MIN_SECONDS)
            assert online.t_attn(n, layer) == old_price
    assert math.isfinite(online.verify_cost(3, 100))
