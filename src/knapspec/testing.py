"""Test doubles and contract checks for knapspec components, for this repo and third parties.

A third-party planner, cost model or value proxy can be checked with the same suites the
built-in ones pass (``docs/extending.md``)::

    from knapspec.testing import check_cost_model, check_proxy, tiny_engine

    def test_my_cost_model_keeps_the_contract():
        engine = tiny_engine()
        check_cost_model(MyCostModel.from_config(MyCostModel.config_class(), engine), engine)

What is here:

* tiny random Llama models built in code (:func:`tiny_llama`, :func:`tiny_engine`), with an
  optional ``layer_damping`` that makes deep layers change the residual little, so that
  layer-skipping drafts are often accepted (a model on which speculation happens);
* cost-model doubles: :class:`AnalyticCostModel` (shaped like the CPU measurements in
  ``models.md``) and :class:`CheapDraftCostModel` (drafting nearly free and verifying any
  width as cheap as one step: every planner that reads costs finds that drafting pays);
* :func:`synthetic_profile`, a latency profile keyed to an engine, for cost models built
  from profiles without timing anything;
* a proxy double, :class:`TopOneProxy`; a planning-context builder, :func:`planning_context`;
* the contract checks :func:`check_cost_model` and :func:`check_proxy` (the suites
  ``tests/test_costmodels_contract.py`` and ``tests/test_proxies_contract.py`` run them over
  every registered component), and :func:`examples`, which scales a property test's example
  count with the active hypothesis profile.

Nothing here is imported by the library itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from knapspec.costmodels.base import CostModel, LatencyObservation
from knapspec.proxies.base import AcceptanceEstimate, ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.types import SublayerMask
from knapspec.window import ReferenceWindow

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from knapspec.costmodels.profile import LatencyProfile
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import PlanningContext

#: The hypothesis profile whose example counts the tests' numbers are written for.
BASE_EXAMPLES = 30


# ---------------------------------------------------------------------------- models
def tiny_llama(
    num_layers: int = 8,
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    seed: int = 0,
    layer_damping: float = 1.0,
    head_scale: float = 1.0,
) -> LlamaForCausalLM:
    """A random Llama (4 query / 2 KV heads, no EOS) built in code, in eval mode.

    Args:
        layer_damping: factor on the output projections (``o_proj``, ``down_proj``) of every
            layer but the first. Below 1, deep layers move the residual little, so drafts
            that skip them agree with the full model often (0.3: most drafts accepted,
            some rejected).
        head_scale: factor on the LM head. Sharper logits (e.g. 8) make greedy near-ties,
            which no two implementations resolve alike, vanishingly rare.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(layer_damping)
            layer.mlp.down_proj.weight.mul_(layer_damping)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    result: LlamaForCausalLM = model
    return result


def tiny_engine(
    num_layers: int = 8, *, seed: int = 0, layer_damping: float = 1.0
) -> SublayerEngine:
    """:func:`tiny_llama` wrapped in a :class:`~knapspec.model.engine.SublayerEngine`."""
    from knapspec.model.engine import SublayerEngine

    return SublayerEngine(tiny_llama(num_layers, seed=seed, layer_damping=layer_damping))


def reference_window(
    engine: SublayerEngine, token_ids: torch.Tensor, window_size: int
) -> tuple[KVCache, ReferenceWindow]:
    """A cache holding ``token_ids (n,)`` (full model) and the window of its last tokens."""
    cache = engine.new_cache(token_ids.numel() + 16)
    with torch.inference_mode():
        out = engine.forward(token_ids, 0, cache, capture_points=True, capture_last=window_size)
    if out.points is None:
        raise RuntimeError("the engine did not capture the window's points")
    window = ReferenceWindow(
        points=out.points,
        token_ids=token_ids[-window_size:],
        target_tokens=out.logits[-window_size:].argmax(dim=-1),
        start=token_ids.numel() - window_size,
    )
    return cache, window


def planning_context(
    engine: SublayerEngine,
    *,
    cost_model: CostModel | None = None,
    proxy: ValueProxy | None = None,
    context_length: int = 40,
    window_size: int = 12,
    with_window: bool = True,
    max_draft_length: int = 10,
    seed: int = 1234,
) -> PlanningContext:
    """A planning context over a cache of ``context_length`` random tokens.

    Defaults: :class:`AnalyticCostModel` and :class:`TopOneProxy`.
    """
    from knapspec.planners.base import PlanningContext

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, engine.vocab_size, (context_length,), generator=generator)
    cache, window = reference_window(engine, tokens, window_size)
    return PlanningContext(
        engine=engine,
        cache=cache,
        context_length=context_length,
        window=window if with_window else None,
        cost_model=cost_model if cost_model is not None else AnalyticCostModel(engine.num_layers),
        proxy=proxy if proxy is not None else TopOneProxy(),
        max_draft_length=max_draft_length,
        sampling=SamplingParams(),
        round_index=0,
        tokens=tokens,
    )


# ----------------------------------------------------------------------- cost models
@attrs.frozen
class NoParams:
    """The config of a test double: no hyper-parameters."""


class AnalyticCostModel(CostModel):
    """Closed-form latencies shaped like the CPU measurements in models.md (seconds).

    A verify pass over ``k`` tokens costs one step plus 10 % per extra token: with these
    numbers drafting pays only for well-accepted, deep-skipping drafts.
    """

    config_class = NoParams

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    @classmethod
    def from_config(cls, config: Any, engine: SublayerEngine) -> AnalyticCostModel:
        return cls(engine.num_layers)

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return 4.0e-4 + 2.5e-7 * context_length

    def t_mlp(self, layer: int | None = None) -> float:
        return 4.8e-4

    def overhead(self, context_length: int) -> float:
        return 6.0e-3

    def verify_cost(self, tokens: int, context_length: int) -> float:
        one = self.num_layers * (self.t_attn(context_length) + self.t_mlp())
        return self.overhead(context_length) + one * (1.0 + 0.1 * (tokens - 1))


class CheapDraftCostModel(CostModel):
    """Latencies under which drafting pays: a draft token costs ~0.1 % of a step and a
    verify pass costs one step whatever its width.

    Any draft with α > 0 then beats plain decoding, so a cost-driven planner drafts; tests
    that claim to exercise speculation use it to make sure they do.
    """

    config_class = NoParams

    def __init__(self, num_layers: int, step_seconds: float = 1e-2) -> None:
        self.num_layers = num_layers
        self.step_seconds = step_seconds

    @classmethod
    def from_config(cls, config: Any, engine: SublayerEngine) -> CheapDraftCostModel:
        return cls(engine.num_layers)

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return self.step_seconds * 1e-4 * (1.0 + 1e-4 * context_length)

    def t_mlp(self, layer: int | None = None) -> float:
        return self.step_seconds * 1e-4

    def overhead(self, context_length: int) -> float:
        return self.step_seconds * 1e-4

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return self.step_seconds


def synthetic_profile(engine: SublayerEngine) -> LatencyProfile:
    """A profile of ``engine`` on this machine from a CPU-shaped law, timing nothing.

    Save it and point ``$KNAPSPEC_PROFILE`` (or a config's ``profile``) at the file to build
    profile-based cost models in tests without profiling.
    """
    from knapspec.costmodels.profile import LatencyProfile, ProfileKey, VerifyTiming

    contexts = (64, 512, 2048)
    layers = engine.num_layers
    attention = [[4.0e-4 + 2.5e-7 * n for n in contexts] for _ in range(layers)]
    mlp = [[4.8e-4] * len(contexts) for _ in range(layers)]
    step = [6.0e-3 + layers * (4.0e-4 + 2.5e-7 * n + 4.8e-4) for n in contexts]
    verify = [
        VerifyTiming(k, n, s * (1.0 + 0.1 * (k - 1)))
        for n, s in zip(contexts, step, strict=True)
        for k in range(1, 12)
    ]
    return LatencyProfile(
        key=ProfileKey.for_engine(engine),
        contexts=contexts,
        attention_seconds=attention,
        mlp_seconds=mlp,
        overhead_seconds=[6.0e-3] * len(contexts),
        verify=verify,
    )


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
    * ``step_cost(n) == verify_cost(1, n)``; ``weights(n)`` are two integers >= 1;
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


# --------------------------------------------------------------------------- proxies
class TopOneProxy(ValueProxy):
    """A minimal proxy: mean cosine as the value, teacher-forced top-1 agreement as α."""

    config_class = NoParams

    @classmethod
    def from_config(cls, config: Any, engine: SublayerEngine) -> TopOneProxy:
        return cls()

    def score(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = F.cosine_similarity(candidate, reference.unsqueeze(0), dim=-1).mean(
            dim=-1
        )
        return scores

    def estimate_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> list[AcceptanceEstimate]:
        with torch.inference_mode():
            agree = engine.logits(candidate_final).argmax(-1) == window.target_tokens
        rates = agree.float().mean(dim=1).tolist()
        return [AcceptanceEstimate(a, a, a, window.size) for a in rates]


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


__all__ = [
    "BASE_EXAMPLES",
    "AnalyticCostModel",
    "CheapDraftCostModel",
    "NoParams",
    "TopOneProxy",
    "check_cost_model",
    "check_proxy",
    "examples",
    "planning_context",
    "reference_window",
    "synthetic_profile",
    "tiny_engine",
    "tiny_llama",
]
