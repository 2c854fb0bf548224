"""Test doubles: cost models with closed-form latencies, a synthetic profile, a proxy."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F

from knapspec.costmodels.base import CostModel
from knapspec.proxies.base import AcceptanceEstimate, ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.window import ReferenceWindow

if TYPE_CHECKING:
    from knapspec.costmodels.profile import LatencyProfile
    from knapspec.model.engine import SublayerEngine


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


class VerifyCurveCostModel(CostModel):
    """Sublayers cost 0.1 each and a verify pass over ``k`` tokens costs ``curve(k)``: for
    tests of what a planner does with a given verify-width curve v(k).

    Args:
        curve: ``tokens -> seconds`` of one verify pass.
    """

    config_class = NoParams

    def __init__(self, curve: Callable[[int], float]) -> None:
        self.curve = curve

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return 0.1

    def t_mlp(self, layer: int | None = None) -> float:
        return 0.1

    def overhead(self, context_length: int) -> float:
        return 0.0

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return self.curve(tokens)


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
    profile-based cost models in tests without profiling. A sliding-window layer's attention
    is flat past its window, as the engine's is (the profile records the windows).
    """
    from knapspec.costmodels.local_layers import (
        effective_context,
        engine_windows,
        mean_effective_context,
    )
    from knapspec.costmodels.profile import LatencyProfile, ProfileKey, VerifyTiming

    contexts = (64, 512, 2048)
    layers = engine.num_layers
    windows = engine_windows(engine)
    attention = [
        [4.0e-4 + 2.5e-7 * effective_context(n, window) for n in contexts]
        for window in (windows or (None,) * layers)
    ]
    mlp = [[4.8e-4] * len(contexts) for _ in range(layers)]
    step = [
        6.0e-3 + layers * (4.0e-4 + 2.5e-7 * mean_effective_context(n, windows) + 4.8e-4)
        for n in contexts
    ]
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
        windows=windows,
    )


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


__all__ = [
    "AnalyticCostModel",
    "CheapDraftCostModel",
    "NoParams",
    "TopOneProxy",
    "VerifyCurveCostModel",
    "synthetic_profile",
]
