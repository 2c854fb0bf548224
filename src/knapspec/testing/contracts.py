"""Contract checks every registered component of a kind passes, and the hypothesis example
scaling the property tests use."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from knapspec.costmodels.base import CostModel, LatencyObservation
from knapspec.proxies.base import AcceptanceEstimate, ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

if TYPE_CHECKING:
    from knapspec.components import Component
    from knapspec.model.engine import SublayerEngine
    from knapspec.registry import Registry

#: The hypothesis profile whose example counts the tests' numbers are written for.
BASE_EXAMPLES = 30


def check_registration(
    registry: Registry[Any], name: str, base: type, engine: SublayerEngine
) -> None:
    """Component ``name`` of ``registry`` keeps the component shape: a subclass of ``base``
    registered under its name, with an attrs frozen ``config_class`` whose defaults build
    it through ``from_config``, keeping the record as ``self.config``."""
    cls: type[Component] = registry.get(name)
    assert issubclass(cls, base), f"{name}: {cls.__qualname__} is not a {base.__name__}"
    assert cls.registered_name == name, f"{name}: registered_name is {cls.registered_name!r}"
    config = cls.config_class()
    assert attrs.has(type(config)), f"{name}.config_class is not an attrs class"
    fields = attrs.fields(type(config))
    if fields:
        frozen = False
        try:
            setattr(config, fields[0].name, getattr(config, fields[0].name))
        except attrs.exceptions.FrozenInstanceError:
            frozen = True
        assert frozen, f"{name}.config_class is not frozen"
    component = cls.from_config(config, engine)
    assert isinstance(component, cls), f"{name}: from_config built a {type(component).__name__}"
    assert component.config == config, f"{name}: from_config did not keep its config"


def check_cost_model(
    cost_model: CostModel,
    engine: SublayerEngine,
    *,
    contexts: Sequence[int] = (16, 128, 1024),
    max_tokens: int = 11,
) -> None:
    """Assert the :class:`~knapspec.costmodels.base.CostModel` contract.

    * every prediction is finite; item, verify and step times are positive, overhead >= 0;
    * attention and verification do not get cheaper as the context grows;
    * ``draft_cost`` never falls when a mask executes one more item, and equals the
      overhead plus the executed items' times;
    * ``step_cost(n) == verify_cost(1, n)``; ``weights(n)`` are two integers >= 1, and
      ``item_weights(n, windows)`` one integer >= 1 per item, with windows or without;
    * ``observe`` accepts draft and verify observations, and predictions stay valid.

    Raises:
        AssertionError: naming the broken clause.
    """
    layers = engine.num_layers
    _check_predictions(cost_model, layers, contexts, max_tokens)
    generator = torch.Generator().manual_seed(0)
    for n in contexts:
        full = SublayerMask.full(layers)
        items = list(range(2 * layers))
        executed = [bool(b) for b in (torch.rand(2 * layers, generator=generator) < 0.5)]
        mask = SublayerMask(tuple(executed))
        expected = cost_model.overhead(n) + sum(
            cost_model.t_attn(n, i // 2) if i % 2 == 0 else cost_model.t_mlp(i // 2)
            for i in items
            if executed[i]
        )
        actual = cost_model.draft_cost(mask, n)
        assert math.isclose(actual, expected, rel_tol=1e-9, abs_tol=1e-15), (
            f"draft_cost at n={n} is {actual}, not overhead + executed items = {expected}"
        )
        for item in items:
            if not executed[item]:
                more = list(executed)
                more[item] = True
                grown = cost_model.draft_cost(SublayerMask(tuple(more)), n)
                assert grown >= actual - 1e-15, f"executing item {item} made the draft cheaper"
        assert cost_model.draft_cost(full, n) >= actual - 1e-15
        step = cost_model.step_cost(n)
        assert math.isclose(step, cost_model.verify_cost(1, n), rel_tol=1e-12), (
            f"step_cost({n}) = {step} differs from verify_cost(1, {n})"
        )
        weights = cost_model.weights(n)
        assert len(weights) == 2 and all(isinstance(w, int) and w >= 1 for w in weights), (
            f"weights({n}) = {weights}: want two integers >= 1"
        )
        local = [None if layer % 2 else max(1, n // 2) for layer in range(layers)]
        for windows in ([None] * layers, local):
            item_weights = cost_model.item_weights(n, windows)
            assert len(item_weights) == 2 * layers and all(
                isinstance(w, int) and w >= 1 for w in item_weights
            ), f"item_weights({n}, {windows}) = {item_weights}: want 2L integers >= 1"
    # The online hook: a plausible stream of measurements must leave valid predictions.
    for n in contexts:
        mask = SublayerMask.full(layers)
        cost_model.observe(LatencyObservation("draft", n, cost_model.draft_cost(mask, n), 1, mask))
        for k in (1, 3):
            cost_model.observe(LatencyObservation("verify", n, cost_model.verify_cost(k, n), k))
    _check_predictions(cost_model, layers, contexts, max_tokens)


def _check_predictions(
    cost_model: CostModel, layers: int, contexts: Sequence[int], max_tokens: int
) -> None:
    def valid(value: float, what: str, *, positive: bool = True) -> None:
        assert isinstance(value, float | int) and math.isfinite(value), f"{what} = {value}"
        assert value > 0 if positive else value >= 0, f"{what} = {value} is not positive"

    previous_attn: float | None = None
    previous_verify: list[float] | None = None
    for n in sorted(contexts):
        valid(cost_model.overhead(n), f"overhead({n})", positive=False)
        valid(cost_model.t_attn(n), f"t_attn({n})")
        for layer in range(layers):
            valid(cost_model.t_attn(n, layer), f"t_attn({n}, layer={layer})")
            valid(cost_model.t_mlp(layer), f"t_mlp(layer={layer})")
        valid(cost_model.t_mlp(), "t_mlp()")
        verify = [cost_model.verify_cost(k, n) for k in range(1, max_tokens + 1)]
        for k, value in enumerate(verify, 1):
            valid(value, f"verify_cost({k}, {n})")
        attn = cost_model.t_attn(n)
        if previous_attn is not None:
            assert attn >= previous_attn * (1 - 1e-9), f"t_attn fell as the context grew to {n}"
        if previous_verify is not None:
            for k, (old, new) in enumerate(zip(previous_verify, verify, strict=True), 1):
                assert new >= old * (1 - 1e-9), f"verify_cost({k}, n) fell as n grew to {n}"
        previous_attn, previous_verify = attn, verify


GREEDY = SamplingParams()
SAMPLED = SamplingParams(do_sample=True, temperature=0.8, top_p=0.95)


def check_proxy(proxy: ValueProxy, engine: SublayerEngine, window: ReferenceWindow) -> None:
    """Assert the :class:`~knapspec.proxies.base.ValueProxy` contract on ``window``.

    Candidates are the window's own states at several item points (the full model's
    residual after ``0, L/2, ...`` of its ``2L`` items) and the final states themselves.

    * ``score(reference (r, d), candidate (B, r, d))`` is ``(B,)``, finite, the same per
      branch whether scored alone or in a batch, and highest for the reference itself;
    * ``estimate_acceptance`` gives one estimate per branch with
      ``0 <= low <= alpha <= high <= 1``, batch-independent, greedy and sampled; the full
      model's own final states get the highest α (the target agrees with itself);
    * neither call modifies its inputs.

    Raises:
        AssertionError: naming the broken clause.
    """
    points = window.points  # (2L + 1, r, d)
    final = points[-1]
    item_points = sorted({0, points.shape[0] // 4, points.shape[0] // 2, points.shape[0] - 2})
    candidates = torch.stack([final, *(points[i] for i in item_points)])  # (B, r, d)
    before = (points.clone(), candidates.clone())

    scores = proxy.score(final, candidates)
    assert isinstance(scores, torch.Tensor) and scores.shape == (candidates.shape[0],), (
        f"score returned shape {tuple(getattr(scores, 'shape', ()))}, want ({candidates.shape[0]},)"
    )
    assert bool(torch.isfinite(scores).all()), f"non-finite scores {scores.tolist()}"
    for branch in range(candidates.shape[0]):
        alone = proxy.score(final, candidates[branch : branch + 1])
        assert torch.allclose(alone[0].double(), scores[branch].double(), atol=1e-5), (
            f"branch {branch} scores {float(alone[0])} alone but {float(scores[branch])} in a batch"
        )
    assert float(scores[0]) >= float(scores.max()) - 1e-5, (
        f"the reference itself scores {float(scores[0])}, below another candidate's "
        f"{float(scores.max())}"
    )

    for sampling in (GREEDY, SAMPLED):
        estimates = proxy.estimate_acceptance(engine, window, candidates, sampling)
        assert len(estimates) == candidates.shape[0], (
            f"{len(estimates)} estimates for {candidates.shape[0]} candidates"
        )
        for branch, estimate in enumerate(estimates):
            assert isinstance(estimate, AcceptanceEstimate)
            assert 0.0 <= estimate.low <= estimate.alpha <= estimate.high <= 1.0, (
                f"branch {branch}: want 0 <= low <= alpha <= high <= 1, got {estimate}"
            )
            single = proxy.estimate_acceptance(
                engine, window, candidates[branch : branch + 1], sampling
            )[0]
            assert math.isclose(single.alpha, estimate.alpha, abs_tol=1e-6), (
                f"branch {branch}: α {single.alpha} alone but {estimate.alpha} in a batch"
            )
        best = max(e.alpha for e in estimates)
        assert estimates[0].alpha >= best - 1e-6, (
            f"the full model's own states get α {estimates[0].alpha} < {best} "
            f"(do_sample={sampling.do_sample})"
        )
    assert torch.equal(points, before[0]) and torch.equal(candidates, before[1]), (
        "the proxy modified its inputs"
    )


# -------------------------------------------------------------------------- hypothesis
def examples(count: int) -> int:
    """``count`` examples scaled by the active hypothesis profile's ``max_examples``.

    Tests write their example counts for a profile of :data:`BASE_EXAMPLES`; under a
    profile with ten times as many (e.g. the ``proofs`` nox session) each runs ten times as
    many. Use as ``@settings(max_examples=examples(200))``; call it at import time, after
    the profile is loaded (``tests/conftest.py`` loads it).
    """
    from hypothesis import settings

    active = settings.default.max_examples if settings.default is not None else BASE_EXAMPLES
    return max(1, round(count * active / BASE_EXAMPLES))


__all__ = ["BASE_EXAMPLES", "check_cost_model", "check_proxy", "check_registration", "examples"]
