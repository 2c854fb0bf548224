"""Tests for knapspec.costmodels: profiles, the fitted linear model, the online model.

Everything here is fast and deterministic: synthetic profiles built from known laws, and
tiny random Llama models (hidden 64) for the profiler and the compatibility keys. Speed
itself is measured by ``benchmarks/costmodel_accuracy.py``, never asserted here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from knapspec.costmodels import (
    COST_MODELS,
    FittedLinearCostModel,
    FittedLinearCostModelConfig,
    LatencyObservation,
    LatencyProfile,
    LinearCoefficients,
    OnlineCalibratedCostModel,
    OnlineCalibratedCostModelConfig,
    ProfileError,
    ProfileKey,
    ProfileMismatchError,
    RecursiveLeastSquares,
    VerifyTiming,
    default_cost_model,
    knapsack_weights,
    profile_engine,
)
from knapspec.costmodels import store as store_module
from knapspec.costmodels.profiler import PLANNING_WIDTHS
from knapspec.model.engine import SublayerEngine
from knapspec.testing import examples
from knapspec.types import SublayerMask

# --------------------------------------------------------------------------------- helpers

LAYERS = 4
CONTEXTS = (64, 512, 2048, 4096, 7000)
VERIFY_GRID = [(k, n) for n in (128, 1024, 3000, 6000) for k in range(1, 12)]


def tiny_engine(seed: int = 0, layers: int = 2) -> SublayerEngine:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    return SublayerEngine(model)


def fake_key(**changes: Any) -> ProfileKey:
    fields: dict[str, Any] = {
        "model_name": "synthetic",
        "model_fingerprint": "llama-L4-synthetic",
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": 2,
        "attention_implementation": "knapspec-engine",
        "cache_type": "knapspec-preallocated",
        "torch_version": "0",
        "transformers_version": "0",
        "knapspec_version": "0",
        "host_cpu": "test cpu",
    }
    fields.update(changes)
    return ProfileKey(**fields)


#: t(k tokens) / t(1 token) at 512 tokens with the few-row kernel on the 2-core CPU, k = 1..11
#: (BLAS takes rows in blocks of 4): the staircase a line in k cannot follow.
STEP_A = (1.00, 1.05, 1.10, 1.10, 1.5, 1.75, 2.0, 2.0, 2.3, 2.7, 3.0)
#: Law B's widths cost 1.3-1.6x law A's, unevenly: B has a different staircase, not a scaled A.
FACTORS_B = (1.5, 1.4, 1.3, 1.6, 1.3, 1.35, 1.3, 1.5, 1.45, 1.3, 1.3)


def per_width(
    intercept: float, slope: float, shape: tuple[float, ...], slope_growth: float
) -> tuple[tuple[float, float], ...]:
    """``(A_k, B_k)`` for k = 1..len(shape): ``A_k = intercept·shape[k-1]``, B_k grows in k."""
    return tuple(
        (intercept * s, slope * (1 + slope_growth * (k - 1))) for k, s in enumerate(shape, 1)
    )


LAW_A = LinearCoefficients(
    overhead=3e-3,
    attn_intercept=0.4e-3,
    attn_slope=0.25e-6,
    mlp=0.5e-3,
    verify=per_width(24e-3, 6e-6, STEP_A, 0.15),
)
LAW_B = LinearCoefficients(  # a slower machine with a slower cache: every coefficient moves
    overhead=4.5e-3,
    attn_intercept=0.55e-3,
    attn_slope=0.5e-6,
    mlp=0.7e-3,
    verify=per_width(
        24e-3, 9.5e-6, tuple(a * f for a, f in zip(STEP_A, FACTORS_B, strict=True)), 0.2
    ),
)


def synthetic_profile(
    law: LinearCoefficients = LAW_A,
    *,
    layers: int = LAYERS,
    layer_spread: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
) -> LatencyProfile:
    """A profile measured from ``law`` exactly (or with multiplicative noise)."""
    rng = np.random.default_rng(seed)
    scale = 1 + layer_spread * np.linspace(-1, 1, layers)  # per-layer deviation, mean 1

    def jitter(values: np.ndarray) -> np.ndarray:
        return values * (1 + noise * rng.standard_normal(values.shape))

    n = np.array(CONTEXTS, dtype=float)
    attention = jitter(np.outer(scale, law.attn_intercept + law.attn_slope * n))
    mlp = jitter(np.outer(scale, np.full_like(n, law.mlp)))
    overhead = jitter(np.full_like(n, law.overhead))
    verify = [
        VerifyTiming(k, c, float(jitter(np.array(law.verify_seconds(k, c)))))
        for k, c in VERIFY_GRID
    ]
    return LatencyProfile(
        key=fake_key(),
        contexts=CONTEXTS,
        attention_seconds=attention.tolist(),
        mlp_seconds=mlp.tolist(),
        overhead_seconds=overhead.tolist(),
        verify=verify,
    )


def random_mask(rng: np.random.Generator, layers: int) -> SublayerMask:
    return SublayerMask(tuple(bool(b) for b in rng.random(2 * layers) < rng.uniform(0.2, 1.0)))


def observations_from(
    law: LinearCoefficients, count: int, rng: np.random.Generator, *, noise: float = 0.0
) -> list[LatencyObservation]:
    """Draft and verify steps (alternating) timed by ``law`` at random masks, n and k."""
    result = []
    for index in range(count):
        n = int(rng.integers(32, 8000))
        wobble = 1 + noise * float(rng.standard_normal())
        if index % 2 == 0:
            mask = random_mask(rng, LAYERS)
            seconds = (
                law.overhead
                + mask.num_attention_executed * (law.attn_intercept + law.attn_slope * n)
                + mask.num_mlp_executed * law.mlp
            )
            result.append(LatencyObservation("draft", n, seconds * wobble, 1, mask))
        else:
            k = int(rng.integers(1, 12))
            seconds = law.verify_seconds(k, n)
            result.append(LatencyObservation("verify", n, seconds * wobble, k))
    return result


def relative_errors(fitted: LinearCoefficients, truth: LinearCoefficients) -> np.ndarray:
    return np.abs(fitted.as_array() - truth.as_array()) / np.abs(truth.as_array())


def with_verify(law: LinearCoefficients, grid: list[tuple[int, int]]) -> LatencyProfile:
    """The synthetic profile, its verify timings replaced by ``law`` exactly on ``grid``."""
    return attrs.evolve(
        synthetic_profile(), verify=[VerifyTiming(k, n, law.verify_seconds(k, n)) for k, n in grid]
    )


@st.composite
def verify_laws(draw: st.DrawFn, min_width: int = 2) -> LinearCoefficients:
    """Any per-width law: positive ``A_k`` (steps, plateaus, dips) and ``B_k`` per width."""
    width = draw(st.integers(min_value=min_width, max_value=12))
    intercepts = draw(st.lists(st.floats(1e-3, 0.2), min_size=width, max_size=width))
    slopes = draw(st.lists(st.floats(1e-8, 2e-5), min_size=width, max_size=width))
    return attrs.evolve(LAW_A, verify=tuple(zip(intercepts, slopes, strict=True)))


#: Contexts a profile may time verification at (at least 128 apart, as real ladders are).
LADDER = st.lists(st.integers(0, 64).map(lambda i: 128 * i), min_size=2, max_size=4, unique=True)
PROBES = (0, 100, 1024, 4096, 8000)


# ------------------------------------------------------------------ profile save / load


def test_profile_round_trip(tmp_path: Path) -> None:
    profile = synthetic_profile(noise=0.05)
    path = profile.save(tmp_path / "nested" / "profile.json")
    loaded = LatencyProfile.load(path)
    assert loaded == profile
    assert json.loads(path.read_text())["schema_version"] == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),
        ("   \n", "is empty"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"schema_version": 99}', "schema_version 99 is not supported"),
        ('{"schema_version": 1}', "malformed profile"),
    ],
)
def test_corrupt_profiles_are_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        LatencyProfile.load(path)


def test_missing_profile_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read latency profile"):
        LatencyProfile.load(tmp_path / "absent.json")


@pytest.mark.parametrize("bad", [float("nan"), -1e-3, float("inf"), "fast"])
@pytest.mark.parametrize("where", ["attention", "mlp", "overhead", "verify"])
def test_invalid_timings_are_refused(tmp_path: Path, bad: Any, where: str) -> None:
    data = synthetic_profile().to_dict()
    if where == "attention":
        data["attention_seconds"][1][2] = bad
    elif where == "mlp":
        data["mlp_seconds"][0][0] = bad
    elif where == "overhead":
        data["overhead_seconds"][3] = bad
    else:
        data["verify"][5]["seconds"] = bad
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))  # json writes NaN/Infinity literals, which it reads back
    with pytest.raises(ProfileError, match=r"finite, non-negative|number of seconds"):
        LatencyProfile.load(path)


def test_inconsistent_shapes_are_refused() -> None:
    data = synthetic_profile().to_dict()
    data["mlp_seconds"] = data["mlp_seconds"][:-1]
    with pytest.raises(ProfileError, match="one row per layer"):
        LatencyProfile.from_dict(data)
    data = synthetic_profile().to_dict()
    data["contexts"] = [512, 64, 2048, 4096, 7000]
    with pytest.raises(ProfileError, match="ascending"):
        LatencyProfile.from_dict(data)


def test_profile_of_another_model_is_refused_unless_forced() -> None:
    engine, other = tiny_engine(seed=0), tiny_engine(seed=1)
    profile = attrs.evolve(synthetic_profile(layers=2), key=ProfileKey.for_engine(other))
    with pytest.raises(ProfileMismatchError) as error:
        profile.check_compatible(engine)
    text = str(error.value)
    assert "model_fingerprint" in text and "knapspec profile" in text and "force" in text
    assert "torch_threads" not in text  # only the differing keys are named
    profile.check_compatible(engine, force=True)
    attrs.evolve(profile, key=ProfileKey.for_engine(engine)).check_compatible(engine)


@pytest.mark.parametrize("profile_layers", [1, 3])
def test_profile_of_another_shape_is_refused_even_when_forced(
    tmp_path: Path, profile_layers: int
) -> None:
    """force waives machine and library fields only: fewer layers used to raise IndexError
    while planning, more layers' rows were silently ignored."""
    engine, other = tiny_engine(layers=2), tiny_engine(layers=profile_layers)
    profile = attrs.evolve(
        synthetic_profile(layers=profile_layers), key=ProfileKey.for_engine(other)
    )
    for force in (False, True):
        with pytest.raises(ProfileMismatchError, match=r"another shape.*force cannot"):
            profile.check_compatible(engine, force=force)
    path = str(profile.save(tmp_path / "other-shape.json"))
    linear_cls = COST_MODELS.get("linear")
    with pytest.raises(ProfileMismatchError, match=r"3 layers|1 layers"):
        linear_cls.from_config(linear_cls.config_class(profile=path, force=True), engine)
    with pytest.raises(ProfileMismatchError, match="another shape"):
        FittedLinearCostModel.from_file(path, engine, force=True)
    # Same shape as the engine, but the rows of another layer count: refused too.
    same_key = attrs.evolve(profile, key=ProfileKey.for_engine(engine))
    with pytest.raises(ProfileMismatchError, match="another shape"):
        same_key.check_compatible(engine, force=True)


def test_profile_from_another_machine_names_the_differing_keys() -> None:
    engine = tiny_engine()
    key = attrs.evolve(ProfileKey.for_engine(engine), torch_threads=64, host_cpu="Other CPU")
    profile = attrs.evolve(synthetic_profile(layers=2), key=key)
    with pytest.raises(ProfileMismatchError, match=r"torch_threads.*host_cpu"):
        profile.check_compatible(engine)


def test_fingerprint_separates_models_and_ignores_the_name() -> None:
    a, b = tiny_engine(seed=0), tiny_engine(seed=1)
    assert ProfileKey.for_engine(a).model_fingerprint != ProfileKey.for_engine(b).model_fingerprint
    assert ProfileKey.for_engine(a) == ProfileKey.for_engine(tiny_engine(seed=0))
    renamed = attrs.evolve(ProfileKey.for_engine(a), model_name="/elsewhere/same-weights")
    assert renamed.differences(ProfileKey.for_engine(a)) == {}


# ------------------------------------------------------------------------ linear fitting


def test_per_layer_fit_recovers_each_layer_exactly() -> None:
    profile = synthetic_profile(layer_spread=0.3)
    model = FittedLinearCostModel.from_profile(profile)
    scale = 1 + 0.3 * np.linspace(-1, 1, LAYERS)
    for layer in range(LAYERS):
        for n in (100, 3333):
            expected = scale[layer] * (LAW_A.attn_intercept + LAW_A.attn_slope * n)
            assert model.t_attn(n, layer) == pytest.approx(expected, rel=1e-9)
        assert model.t_mlp(layer) == pytest.approx(scale[layer] * LAW_A.mlp, rel=1e-9)
    assert relative_errors(model.coefficients(), LAW_A).max() < 1e-9


def test_pooled_fit_recovers_the_layer_mean() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile(layer_spread=0.3), pooled=True)
    assert model.t_attn(2000, 0) == model.t_attn(2000, 3)
    assert relative_errors(model.coefficients(), LAW_A).max() < 1e-9


def test_noisy_fit_recovers_coefficients_within_tolerance() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile(noise=0.02, seed=3))
    errors = relative_errors(model.coefficients(), LAW_A)
    # Each width's line rests on its own 4 noisy points (not on all 44 as a law shared by
    # the widths would): its slope B_k, the smaller term, is the least certain.
    assert errors[:4].max() < 0.03
    assert errors[4::2].max() < 0.05 and errors[5::2].max() < 0.15
    for k, n in ((1, 500), (8, 4000), (11, 6144)):
        # 2% noise, 2 coefficients from 4 points: about 1.7% standard error at the edge.
        assert model.verify_cost(k, n) == pytest.approx(LAW_A.verify_seconds(k, n), rel=0.05)


def test_verification_is_priced_by_width() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile())
    ratio = model.verify_cost(8, 1024) / model.step_cost(1024)
    assert 1.5 < ratio < 2.5  # the synthetic law mirrors the CPU: 8 tokens ≈ 1.6-2x one
    assert model.step_cost(1024) == model.verify_cost(1, 1024)


def test_one_line_per_width_fits_the_measured_staircase_a_bilinear_law_cannot() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile())
    grid = np.array(VERIFY_GRID, dtype=float)
    truth = np.array([LAW_A.verify_seconds(k, n) for k, n in VERIFY_GRID])
    predicted = np.array([model.verify_cost(k, n) for k, n in VERIFY_GRID])
    np.testing.assert_allclose(predicted, truth, rtol=1e-9)
    assert relative_errors(model.coefficients(), LAW_A).max() < 1e-9
    # The old law, t = v0 + v1·k + v2·n + v3·k·n, at its least-squares best on the same
    # exact points: the one plain step (k = 1) about 24% too cheap at short context, the
    # end of the first block (k = 4) about 23% too dear. Either error misleads the planner.
    k, n = grid[:, 0], grid[:, 1]
    design = np.stack([np.ones_like(k), k, n, k * n], axis=1)
    error = design @ np.linalg.lstsq(design, truth, rcond=None)[0] / truth - 1
    assert error[k == 1].max() < -0.09 and error[k == 4].min() > 0.07
    assert np.abs(error).max() > 0.2


@settings(max_examples=examples(60), deadline=None)
@given(law=verify_laws(), contexts=LADDER)
def test_fit_reproduces_any_per_width_law_exactly(
    law: LinearCoefficients, contexts: list[int]
) -> None:
    width = law.max_width
    model = FittedLinearCostModel.from_profile(
        with_verify(law, [(k, n) for k in range(1, width + 1) for n in contexts])
    )
    assert model.verify_widths == tuple(range(1, width + 1))
    for k in range(1, width + 1):
        for n in PROBES:
            assert model.verify_cost(k, n) == pytest.approx(law.verify_seconds(k, n), rel=1e-9)


@settings(max_examples=examples(60), deadline=None)
@given(law=verify_laws(min_width=3), data=st.data())
def test_an_unmeasured_width_lies_between_its_measured_neighbours(
    law: LinearCoefficients, data: st.DataObject
) -> None:
    width = law.max_width
    inner = data.draw(st.sets(st.integers(2, width - 1), max_size=width - 3), label="inner")
    measured = sorted({1, width, *inner})
    model = FittedLinearCostModel.from_profile(
        with_verify(law, [(k, n) for k in measured for n in (128, 2048, 5120)])
    )
    assert model.verify_widths == tuple(measured)
    for k in sorted(set(range(1, width + 1)) - set(measured)):
        low = max(m for m in measured if m < k)
        high = min(m for m in measured if m > k)
        for n in PROBES:
            below, above = law.verify_seconds(low, n), law.verify_seconds(high, n)
            value = model.verify_cost(k, n)
            assert min(below, above) * (1 - 1e-9) <= value <= max(below, above) * (1 + 1e-9)
            linear = below + (k - low) / (high - low) * (above - below)
            assert value == pytest.approx(linear, rel=1e-9)


def test_wider_than_measured_extrapolates_the_last_step_never_downward() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile())  # widths 1..11
    for n in PROBES:
        last, before = LAW_A.verify_seconds(11, n), LAW_A.verify_seconds(10, n)
        assert model.verify_cost(13, n) == pytest.approx(last + 2 * (last - before), rel=1e-9)
    # Width 11 measured cheaper than width 10 (noise): wider widths stay at width 11's price.
    dip = attrs.evolve(LAW_A, verify=(*LAW_A.verify[:10], (60e-3, 10e-6)))
    model = FittedLinearCostModel.from_profile(
        with_verify(dip, [(k, n) for k in range(1, 12) for n in (128, 4096)])
    )
    for n in PROBES:
        assert model.verify_cost(16, n) == pytest.approx(dip.verify_seconds(11, n), rel=1e-9)
        assert model.verify_cost(16, n) == pytest.approx(dip.verify_seconds(16, n), rel=1e-9)


def test_a_width_timed_at_one_context_keeps_its_time_and_borrows_the_slope() -> None:
    grid = [(k, n) for k in (1, 2, 3, 4, 8) for n in (128, 2048, 5120)] + [(6, 1024)]
    model = FittedLinearCostModel.from_profile(with_verify(LAW_A, grid))
    (_, slope_4), (_, slope_8) = LAW_A.verify[3], LAW_A.verify[7]
    assert model.verify_cost(6, 1024) == pytest.approx(LAW_A.verify_seconds(6, 1024), rel=1e-9)
    assert model.verify_law(6)[1] == pytest.approx((slope_4 + slope_8) / 2, rel=1e-9)
    for n in PROBES:  # width 5 lies halfway between the lines of widths 4 and 6
        halfway = (model.verify_cost(4, n) + model.verify_cost(6, n)) / 2
        assert model.verify_cost(5, n) == pytest.approx(halfway, rel=1e-9)
    # A measured time below the borrowed slope's reach: the slope gives way, A_6 stays >= 0.
    cheap = [VerifyTiming(k, n, LAW_A.verify_seconds(k, n)) for k, n in grid[:-1]]
    model = FittedLinearCostModel.from_profile(
        attrs.evolve(synthetic_profile(), verify=[*cheap, VerifyTiming(6, 5000, 1e-3)])
    )
    assert model.verify_law(6) == pytest.approx((0.0, 1e-3 / 5000))
    assert model.verify_cost(6, 5000) == pytest.approx(1e-3)


def test_a_width_below_the_narrowest_measured_gets_its_line() -> None:
    model = FittedLinearCostModel.from_profile(
        with_verify(LAW_A, [(k, n) for k in (3, 4, 7) for n in (128, 4096)])
    )
    assert model.verify_widths == (3, 4, 7)
    for n in PROBES:
        assert model.verify_cost(1, n) == model.verify_cost(2, n) == model.verify_cost(3, n)


def test_coefficients_need_a_verify_line() -> None:
    with pytest.raises(ValueError, match="width 1"):
        attrs.evolve(LAW_A, verify=())
    with pytest.raises(ValueError, match="tokens >= 1"):
        LAW_A.verify_seconds(0, 100)
    with pytest.raises(ValueError, match=r"\(K, 2\)"):
        FittedLinearCostModel(
            synthetic_profile(),
            attn_intercept=np.ones(LAYERS),
            attn_slope=np.ones(LAYERS),
            mlp=np.ones(LAYERS),
            overhead=1.0,
            verify_coef=np.ones(4),  # the old (v0, v1, v2, v3)
            pooled=False,
        )


def test_draft_cost_sums_the_executed_items() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile(layer_spread=0.2))
    mask = SublayerMask.from_skipped(LAYERS, [0, 3, 6])
    n = 1500
    expected = model.overhead(n) + sum(
        model.t_attn(n, i) * mask.attention(i) + model.t_mlp(i) * mask.mlp(i) for i in range(LAYERS)
    )
    assert model.draft_cost(mask, n) == pytest.approx(expected)
    with pytest.raises(ValueError, match="layers"):
        model.draft_cost(SublayerMask.full(LAYERS + 1), n)


def test_fit_refuses_unidentifiable_profiles() -> None:
    data = synthetic_profile().to_dict()
    data["contexts"] = [512]
    for name in ("attention_seconds", "mlp_seconds"):
        data[name] = [row[:1] for row in data[name]]
    data["overhead_seconds"] = data["overhead_seconds"][:1]
    with pytest.raises(ProfileError, match=">= 2 contexts"):
        FittedLinearCostModel.from_profile(LatencyProfile.from_dict(data))
    single_width = attrs.evolve(
        synthetic_profile(), verify=[v for v in synthetic_profile().verify if v.tokens == 1]
    )
    with pytest.raises(ProfileError, match="token counts"):
        FittedLinearCostModel.from_profile(single_width)
    # Two widths and two contexts, but no width timed at two contexts: no slope anywhere.
    diagonal = with_verify(LAW_A, [(1, 128), (2, 2048), (3, 5120)])
    with pytest.raises(ProfileError, match=r"some width k timed at >= 2 contexts.*k=2 at n in"):
        FittedLinearCostModel.from_profile(diagonal)


def test_fit_is_non_negative_and_floored_on_implausible_profiles() -> None:
    # A noisy machine: attention measured *slower* at short context than at long context.
    law = attrs.evolve(LAW_A, attn_intercept=1.2e-3, attn_slope=-0.15e-6)
    model = FittedLinearCostModel.from_profile(synthetic_profile(law))
    assert (model.attn_slope >= 0).all() and (model.attn_intercept >= 0).all()
    assert (model.verify_coef >= 0).all()
    fastest = min(min(map(min, model.profile.attention_seconds)), LAW_A.mlp)
    for n in (0, 64, 8000):
        assert model.t_attn(n) >= 0.5 * fastest
        assert max(model.weights(n)) <= 2 * max(LAW_A.mlp, 1.2e-3) / fastest + 1


def test_a_line_below_zero_is_floored_at_half_the_fastest_item() -> None:
    law = attrs.evolve(LAW_A, attn_intercept=-1e-5)  # measured times > 0, intercept < 0
    model = FittedLinearCostModel.from_profile(synthetic_profile(law))
    floor = 0.5 * min(map(min, model.profile.attention_seconds))
    assert model.t_attn(0) == pytest.approx(floor)
    assert all(w >= 1 for w in model.weights(0))


# ------------------------------------------------------------------ weight normalisation

times = st.floats(min_value=1e-7, max_value=10.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=examples(300))
@given(t_attn=times, t_mlp=times)
def test_weights_are_positive_integers_ordered_like_the_times(t_attn: float, t_mlp: float) -> None:
    w_attn, w_mlp = knapsack_weights(t_attn, t_mlp)
    assert isinstance(w_attn, int) and isinstance(w_mlp, int)
    assert w_attn >= 1 and w_mlp >= 1
    if t_attn >= t_mlp:
        assert w_attn >= w_mlp
    if t_mlp >= t_attn:
        assert w_mlp >= w_attn
    assert min(w_attn, w_mlp) == 1  # Δ = min(t_attn, t_mlp) maps to weight 1


@settings(max_examples=examples(300))
@given(t_attn=times, t_mlp=times)
def test_weights_match_the_rounding_oracle(t_attn: float, t_mlp: float) -> None:
    # Oracle: the heavier item's weight is the integer nearest to the latency ratio.
    heavy, light = max(t_attn, t_mlp), min(t_attn, t_mlp)
    ratio = heavy / light
    w_attn, w_mlp = knapsack_weights(t_attn, t_mlp)
    assert abs(max(w_attn, w_mlp) - ratio) <= 0.5 + 1e-9


@settings(max_examples=examples(300))
@given(t_attn=times, t_mlp=times, exponent=st.integers(min_value=-20, max_value=20))
def test_weights_are_invariant_to_scaling_both_times(
    t_attn: float, t_mlp: float, exponent: int
) -> None:
    # Powers of two scale floats exactly, so the ratio (and any rounding tie) is unchanged.
    factor = 2.0**exponent
    assert knapsack_weights(t_attn * factor, t_mlp * factor) == knapsack_weights(t_attn, t_mlp)


@pytest.mark.parametrize("bad", [(0.0, 1.0), (1.0, -1.0), (float("nan"), 1.0)])
def test_weights_reject_non_positive_times(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="positive"):
        knapsack_weights(*bad)


def test_attention_outweighs_mlp_at_long_context() -> None:
    model = FittedLinearCostModel.from_profile(synthetic_profile())
    short, long = model.weights(64), model.weights(8000)
    assert short == (1, 1)  # 0.416 ms vs 0.5 ms: ratio 1.2 rounds to 1
    assert long[0] > long[1] == 1  # 2.4 ms vs 0.5 ms: attention weighs about 5


# ---------------------------------------------------------------- recursive least squares


def test_rls_without_forgetting_matches_least_squares() -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, 4))
    targets = features @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.01 * rng.normal(size=200)
    rls = RecursiveLeastSquares(forgetting_factor=1.0, initial_covariance=1e6).partial_fit(
        features, targets
    )
    oracle, *_ = np.linalg.lstsq(features, targets, rcond=None)
    np.testing.assert_allclose(rls.coef_, oracle, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(rls.predict(features[:3]), features[:3] @ rls.coef_)
    assert rls.n_updates_ == 200 and rls.get_params()["forgetting_factor"] == 1.0


def test_rls_with_forgetting_stays_stable_over_long_runs() -> None:
    # Unsymmetrised, P's round-off asymmetry grew by 1/λ per update: by update 5000 at
    # λ = 0.98 the coefficients were in the hundreds. Draft steps of one long decode.
    rng = np.random.default_rng(0)
    truth = np.array([0.1, 0.5, 0.2, 0.3])
    rls = RecursiveLeastSquares(forgetting_factor=0.98, initial_covariance=1.0)
    for _ in range(5000):
        attention, mlp, n = rng.uniform(0.3, 1.0), rng.uniform(0.3, 1.0), rng.uniform(0, 2)
        x = np.array([1.0, attention, attention * n, mlp])
        rls.update(x, float(x @ truth + 0.01 * rng.normal()), max_error=0.5)
    np.testing.assert_allclose(rls.coef_, truth, atol=0.03)
    np.testing.assert_array_equal(rls.covariance_, rls.covariance_.T)
    assert np.linalg.eigvalsh(rls.covariance_).min() > 0


def test_rls_validates_lazily_and_clearly() -> None:
    rls = RecursiveLeastSquares(forgetting_factor=1.5)  # stored unvalidated
    with pytest.raises(ValueError, match="forgetting_factor"):
        rls.partial_fit([[1.0, 2.0]], [1.0])
    with pytest.raises(ValueError, match="NaN"):
        RecursiveLeastSquares().partial_fit([[1.0]], [math.nan])


# ------------------------------------------------------------------------ online model

DRIFT_OBSERVATIONS = 600  # 300 draft + 300 verify steps; λ^300 ≈ 0.2% weight left on A
DRIFT_TOLERANCE = 0.02


def test_online_model_tracks_a_drifting_machine_and_the_fitted_one_does_not() -> None:
    """Law A for 300 steps, then law B: after 600 steps of B (300 of each kind), every pooled
    coefficient of the online model is within 2% of B's; the fitted model stays on A.

    Every coefficient: the 4 draft ones and the 22 verify ones ``(A_k, B_k)``, k = 1..11.
    B's staircase is not A's scaled, and each width sees only about 27 of the 300 verify
    steps (k uniform in 1..11), so each width's line must follow on its own."""
    rng = np.random.default_rng(7)
    fitted = FittedLinearCostModel.from_profile(synthetic_profile(LAW_A))
    online = OnlineCalibratedCostModel(fitted, forgetting_factor=0.98)
    for observation in observations_from(LAW_A, 300, rng):
        online.observe(observation)
        fitted.observe(observation)
    assert relative_errors(online.coefficients(), LAW_A).max() < DRIFT_TOLERANCE
    for observation in observations_from(LAW_B, DRIFT_OBSERVATIONS, rng):
        online.observe(observation)
        fitted.observe(observation)
    assert relative_errors(online.coefficients(), LAW_B).max() < DRIFT_TOLERANCE
    assert relative_errors(fitted.coefficients(), LAW_B).min() > 0.2
    assert online.n_outliers_ == 0
    # Predictions follow the coefficients (draft cost at one mask, verify at one width).
    mask = SublayerMask.from_skipped(LAYERS, [1, 2])
    b = LAW_B
    truth = b.overhead + 3 * (b.attn_intercept + b.attn_slope * 4000) + 3 * b.mlp
    assert online.draft_cost(mask, 4000) == pytest.approx(truth, rel=DRIFT_TOLERANCE)
    assert online.t_mlp() == pytest.approx(b.mlp, rel=DRIFT_TOLERANCE)
    for k in range(1, 12):
        for n in (100, 4000, 8000):
            assert online.verify_cost(k, n) == pytest.approx(
                b.verify_seconds(k, n), rel=DRIFT_TOLERANCE
            )


def test_online_verify_observations_update_only_their_width() -> None:
    prior = FittedLinearCostModel.from_profile(synthetic_profile(LAW_A))
    online = OnlineCalibratedCostModel(prior)
    rng = np.random.default_rng(5)
    for _ in range(150):  # the planner settled on γ = 4: only width 5 is ever verified
        n = int(rng.integers(32, 8000))
        online.observe(LatencyObservation("verify", n, LAW_B.verify_seconds(5, n), 5))
    assert set(online.verify_rls_) == {5}
    learned = online.coefficients().verify
    np.testing.assert_allclose(learned[4], LAW_B.verify[4], rtol=DRIFT_TOLERANCE)
    for k in (*range(1, 5), *range(6, 14)):
        for n in PROBES:
            # Unobserved: the prior's shape at width 5's learned level (its coefficients
            # report stays the prior's line).
            level = online.verify_cost(5, n) / prior.verify_cost(5, n)
            assert online.verify_cost(k, n) == pytest.approx(prior.verify_cost(k, n) * level)
        if k <= 11:
            assert learned[k - 1] == pytest.approx(LAW_A.verify[k - 1], rel=1e-9)


def test_a_prior_far_too_slow_does_not_price_unobserved_widths_out_of_reach() -> None:
    """A profile measured 50x too slow (another process held the cores), corrected by
    one-token steps only (the planner has drafted nothing yet): wider verifications keep the
    prior's shape at the corrected level. With the bare prior there, a 4-token verify would
    cost about 50 one-token steps, nothing would ever be drafted, and no width other than
    1 would ever be observed (a deadlock seen on a real bf16 profile)."""
    slow = LinearCoefficients(
        overhead=50 * LAW_A.overhead,
        attn_intercept=50 * LAW_A.attn_intercept,
        attn_slope=50 * LAW_A.attn_slope,
        mlp=50 * LAW_A.mlp,
        verify=tuple((50 * a, 50 * b) for a, b in LAW_A.verify),
    )
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(synthetic_profile(slow)))
    rng = np.random.default_rng(9)
    for _ in range(60):
        n = int(rng.integers(32, 8000))
        online.observe(LatencyObservation("verify", n, LAW_A.verify_seconds(1, n), 1))
    assert set(online.verify_rls_) == {1}
    for n in PROBES:
        step = online.verify_cost(1, n)
        # The level is floored at the prior over outlier_ratio (10): 5x the truth here.
        assert step < LAW_A.verify_seconds(1, n) * 6 < 50 * LAW_A.verify_seconds(1, n) / 8
        for k in range(2, 12):
            truth = LAW_A.verify_seconds(k, n) / LAW_A.verify_seconds(1, n)
            assert online.verify_cost(k, n) / step == pytest.approx(truth, rel=DRIFT_TOLERANCE)


def test_per_width_blocks_on_a_shared_clock_equal_one_one_hot_regression() -> None:
    """The online verify state is the RLS over ``[e_k, e_k·n]``, split into 2x2 blocks."""
    rng = np.random.default_rng(2)
    widths, forgetting, unbounded = 5, 0.9, 1e300
    joint = RecursiveLeastSquares(forgetting, 1.0, max_covariance_trace=unbounded)
    joint.initialize(2 * widths)
    blocks = {k: RecursiveLeastSquares(forgetting, 1.0, unbounded) for k in range(widths)}
    for block in blocks.values():
        block.initialize(2)
    last = dict.fromkeys(blocks, 0)
    for clock in range(1, 301):
        k, n, y = int(rng.integers(widths)), float(rng.uniform(0, 2)), float(rng.normal())
        x = np.zeros(2 * widths)
        x[2 * k : 2 * k + 2] = (1.0, n)
        joint.update(x, y)
        blocks[k].forget(clock - 1 - last[k])
        blocks[k].update(np.array([1.0, n]), y)
        last[k] = clock
    for k, block in blocks.items():
        block.forget(300 - last[k])
        np.testing.assert_allclose(block.coef_, joint.coef_[2 * k : 2 * k + 2], rtol=1e-9)
        np.testing.assert_allclose(
            block.covariance_, joint.covariance_[2 * k : 2 * k + 2, 2 * k : 2 * k + 2], rtol=1e-9
        )
    with pytest.raises(ValueError, match="steps"):
        blocks[0].forget(-1)


def test_online_model_under_noise_settles_near_the_new_law() -> None:
    rng = np.random.default_rng(11)
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(synthetic_profile()))
    online.partial_fit(observations_from(LAW_B, 600, rng, noise=0.03))
    predicted = online.predict(observations_from(LAW_B, 200, np.random.default_rng(12)))
    truth = np.array([o.seconds for o in observations_from(LAW_B, 200, np.random.default_rng(12))])
    assert np.median(np.abs(predicted - truth) / truth) < 0.03


def test_online_model_ignores_isolated_outliers_but_follows_a_real_jump() -> None:
    rng = np.random.default_rng(3)
    online = OnlineCalibratedCostModel(
        FittedLinearCostModel.from_profile(synthetic_profile()), outlier_patience=4
    )
    probe = LatencyObservation("verify", 2000, 0.0, 4)
    before = online.verify_cost(4, 2000)
    spike = attrs.evolve(probe, seconds=before * 50)
    online.observe(spike)
    online.observe(observations_from(LAW_A, 2, rng)[1])
    online.observe(spike)
    assert online.n_outliers_ == 2 and online.verify_cost(4, 2000) == pytest.approx(before)
    for _ in range(20):  # the machine really became 20x slower: patience runs out
        online.observe(attrs.evolve(probe, seconds=before * 20))
    assert online.verify_cost(4, 2000) > 5 * before


def test_online_model_rejects_malformed_observations() -> None:
    online = OnlineCalibratedCostModel(FittedLinearCostModel.from_profile(synthetic_profile()))
    with pytest.raises(ValueError, match="needs its mask"):
        online.observe(LatencyObservation("draft", 100, 0.01))
    with pytest.raises(ValueError, match="'draft' or 'verify'"):
        online.observe(LatencyObservation("prefill", 100, 0.01))
    before = online.coefficients()
    online.observe(LatencyObservation("verify", 100, float("nan"), 3))
    online.observe(LatencyObservation("verify", 100, -1.0, 3))
    assert online.coefficients() == before


def test_online_hyper_parameters_are_stored_then_validated_on_use() -> None:
    prior = FittedLinearCostModel.from_profile(synthetic_profile())
    online = OnlineCalibratedCostModel(prior, outlier_ratio=0.5)
    assert online.outlier_ratio == 0.5
    with pytest.raises(ValueError, match="outlier_ratio"):
        online.t_mlp()


def test_online_model_starts_at_its_prior() -> None:
    prior = FittedLinearCostModel.from_profile(synthetic_profile(layer_spread=0.2))
    online = OnlineCalibratedCostModel(prior)
    mask = SublayerMask.from_skipped(LAYERS, [0, 5])
    for n in (64, 5000):
        assert online.draft_cost(mask, n) == pytest.approx(prior.draft_cost(mask, n))
        assert online.verify_cost(7, n) == pytest.approx(prior.verify_cost(7, n))
        assert online.weights(n) == prior.weights(n)
        assert online.t_attn(n, 2) == pytest.approx(prior.t_attn(n, 2))


# ------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("config_class", "changes", "message"),
    [
        (OnlineCalibratedCostModelConfig, {"forgetting_factor": 0.0}, "forgetting_factor"),
        (OnlineCalibratedCostModelConfig, {"forgetting_factor": 1.2}, "forgetting_factor"),
        (OnlineCalibratedCostModelConfig, {"outlier_ratio": 1.0}, "outlier_ratio"),
        (OnlineCalibratedCostModelConfig, {"outlier_patience": 0}, "outlier_patience"),
        (OnlineCalibratedCostModelConfig, {"initial_uncertainty": -1.0}, "initial_uncertainty"),
        (OnlineCalibratedCostModelConfig, {"innovation_clip": 0.0}, "innovation_clip"),
        (FittedLinearCostModelConfig, {"profile": ""}, "profile"),
        (FittedLinearCostModelConfig, {"pooled": "yes"}, "pooled"),
    ],
)
def test_configs_validate(config_class: type, changes: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        config_class(**changes)


def test_registry_builds_both_models_from_a_profile_file(tmp_path: Path) -> None:
    engine = tiny_engine()
    profile = attrs.evolve(synthetic_profile(layers=2), key=ProfileKey.for_engine(engine))
    path = str(profile.save(tmp_path / "p.json"))
    assert {"linear", "online"} <= set(COST_MODELS.names())
    linear_cls = COST_MODELS.get("linear")
    linear = linear_cls.from_config(linear_cls.config_class(profile=path, pooled=True), engine)
    assert isinstance(linear, FittedLinearCostModel) and linear.pooled
    online_cls = COST_MODELS.get("online")
    online = online_cls.from_config(online_cls.config_class(profile=path), engine)
    assert isinstance(online, OnlineCalibratedCostModel)
    foreign = attrs.evolve(profile, key=attrs.evolve(profile.key, device="cuda:0 Other GPU"))
    foreign_path = str(foreign.save(tmp_path / "foreign.json"))
    with pytest.raises(ProfileMismatchError, match="device"):
        linear_cls.from_config(linear_cls.config_class(profile=foreign_path), engine)
    forced = linear_cls.from_config(
        linear_cls.config_class(profile=foreign_path, force=True), engine
    )
    assert isinstance(forced, FittedLinearCostModel)


# ------------------------------------------------------------------------- profiler


def test_profiler_smoke_on_a_tiny_model() -> None:
    engine = tiny_engine(layers=3)
    profile = profile_engine(
        engine,
        contexts=(8, 64, 200),
        verify_contexts=(16, 128),
        max_tokens=4,
        repeats=2,
        warmup=1,
        progress=False,
    )
    assert profile.key == ProfileKey.for_engine(engine)
    profile.check_compatible(engine)
    assert profile.contexts == (8, 64, 200)
    assert len(profile.attention_seconds) == 3 and len(profile.attention_seconds[0]) == 3
    # every width up to D + 1, plus the DP-sized widths the planner prices a search with
    assert {(v.tokens, v.context_length) for v in profile.verify} == {
        (k, n) for k in (*range(1, 5), *PLANNING_WIDTHS) for n in (16, 128)
    }
    timings = [*np.ravel(profile.attention_seconds), *np.ravel(profile.mlp_seconds)]
    assert all(t > 0 for t in timings) and all(v.seconds > 0 for v in profile.verify)
    model = FittedLinearCostModel.from_profile(profile)
    assert model.verify_cost(4, 100) > 0 and min(model.weights(100)) == 1


def test_profiler_clamps_contexts_to_the_model_and_has_a_quick_mode() -> None:
    engine = tiny_engine()
    profile = profile_engine(engine, quick=True, max_tokens=4, progress=False)
    assert profile.quick and profile.repeats <= 3
    # Every width 1..max_tokens at both quick contexts: the staircase in k is measured.
    contexts = sorted({v.context_length for v in profile.verify})
    assert len(contexts) == 2
    assert sorted((v.tokens, v.context_length) for v in profile.verify) == [
        (k, n) for k in (*range(1, 5), *PLANNING_WIDTHS) for n in contexts
    ]
    default = profile_engine(engine, quick=True, progress=False)  # max_tokens = D + 1 = 11
    widths = (*range(1, 12), *PLANNING_WIDTHS)
    assert {v.tokens for v in default.verify} == set(widths)
    assert FittedLinearCostModel.from_profile(default).verify_widths == widths
    assert profile.contexts[-1] <= engine.max_context - 2
    assert max(v.context_length + v.tokens for v in profile.verify) <= engine.max_context
    with pytest.raises(ValueError, match="repeats"):
        profile_engine(engine, repeats=0)


# ------------------------------------------------------------------- default model


def test_default_cost_model_profiles_once_then_loads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("KNAPSPEC_PROFILE", raising=False)
    engine = tiny_engine()
    calls: list[bool] = []

    def fake_profile(engine: SublayerEngine, **kwargs: Any) -> LatencyProfile:
        calls.append(kwargs.get("quick", False))
        return attrs.evolve(synthetic_profile(layers=2), key=ProfileKey.for_engine(engine))

    monkeypatch.setattr(store_module, "profile_engine", fake_profile)
    first = default_cost_model(engine)
    assert isinstance(first, OnlineCalibratedCostModel) and calls == [True]
    cached = store_module.default_profile_path(engine)
    assert cached.is_relative_to(tmp_path / "profiles") and cached.exists()
    default_cost_model(engine)
    assert calls == [True]  # loaded, not re-profiled
    cached.write_text("{corrupt")
    with pytest.warns(RuntimeWarning, match="unreadable .JSONDecodeError"):
        default_cost_model(engine)
    assert calls == [True, True] and LatencyProfile.load(cached)


def test_explicit_profile_variable_is_checked_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "mine.json"
    path.write_text("")
    monkeypatch.setenv("KNAPSPEC_PROFILE", str(path))
    with pytest.raises(ProfileError, match="is empty"):
        default_cost_model(tiny_engine())
    assert path.read_text() == ""
