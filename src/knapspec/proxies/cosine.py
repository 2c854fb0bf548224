"""The cosine value proxy (the paper's DP value) with Lemma 4.1 certificates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Self

import attrs
import torch

from knapspec.proxies.base import PROXIES, AcceptanceEstimate, ValueProxy
from knapspec.proxies.intervals import wilson_interval
from knapspec.proxies.lemma import (
    Certificate,
    HeadGeometry,
    LemmaSpace,
    ReferenceMargins,
    certify,
    lemma_states,
    reference_margins,
)
from knapspec.proxies.validation import check_score_inputs, check_window_inputs
from knapspec.sampling import SamplingParams
from knapspec.scores import mean_cosine
from knapspec.validators import open_unit_interval

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine
    from knapspec.window import ReferenceWindow

AcceptanceMode = Literal["agreement", "certified", "certified-exact"]


@attrs.frozen
class CosineProxyConfig:
    """Hyper-parameters of :class:`CosineProxy`.

    Attributes:
        acceptance: how a candidate becomes α.
            ``"agreement"`` (default, the authors' choice): per-token top-1 agreement of the
            candidate's logits with the target's greedy tokens on the window, never below
            the certified fraction. Costs one ``(r, V)`` head matmul per candidate.
            ``"certified"``: the certified fraction itself, a provable lower bound on the
            window's greedy agreement that needs no head matmul per candidate (``O(r d)``
            once the window's margins are cached).
            ``"certified-exact"``: the same with the exact classifier radius (tighter).
        space: coordinates of the lemma; ``"folded"`` (RMSNorm gain folded into the head,
            equal norms up to eps, cosine = the DP's residual-stream cosine) or ``"normed"``
            (``final_norm(h)`` against the raw head).
        confidence: level of the reported interval.
    """

    acceptance: AcceptanceMode = attrs.field(
        default="agreement",
        validator=attrs.validators.in_(("agreement", "certified", "certified-exact")),
    )
    space: LemmaSpace = attrs.field(
        default="folded", validator=attrs.validators.in_(("folded", "normed"))
    )
    confidence: float = attrs.field(default=0.95, validator=open_unit_interval)


@PROXIES.register("cosine")
class CosineProxy(ValueProxy):
    """Mean per-token cosine similarity, plus Lemma 4.1 certificates for greedy agreement.

    ``score`` is what the KnapSpec DP maximises at every item point. ``estimate_acceptance``
    follows ``acceptance`` (see :class:`CosineProxyConfig`); under sampling it still reports
    greedy agreement (as the authors' code does) — use the ``"montecarlo"`` proxy for the
    exact sampling acceptance.

    Args:
        acceptance, space, confidence: see :class:`CosineProxyConfig`.
    """

    config_class = CosineProxyConfig

    def __init__(
        self,
        *,
        acceptance: AcceptanceMode = "agreement",
        space: LemmaSpace = "folded",
        confidence: float = 0.95,
    ) -> None:
        self.config = CosineProxyConfig(acceptance=acceptance, space=space, confidence=confidence)
        self._geometry: HeadGeometry | None = None
        self._geometry_owner: SublayerEngine | None = None
        self._margins: tuple[ReferenceWindow, ReferenceMargins] | None = None

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        return cls(acceptance=config.acceptance, space=config.space, confidence=config.confidence)

    @torch.inference_mode()
    def score(self, reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """``(B,)`` mean per-token cosine of ``candidate (B, r, d)`` to ``reference (r, d)``."""
        check_score_inputs(reference, candidate)
        return mean_cosine(reference, candidate)

    # ------------------------------------------------------------ certificates
    def geometry(self, engine: SublayerEngine) -> HeadGeometry:
        """The engine's LM head in the configured space (built once, distances cached)."""
        if self._geometry is None or self._geometry_owner is not engine:
            self._geometry = HeadGeometry.for_lm_head(
                engine.lm_head, engine.final_norm, self.config.space
            )
            self._geometry_owner = engine
            self._margins = None
        return self._geometry

    def _reference(self, engine: SublayerEngine, window: ReferenceWindow) -> ReferenceMargins:
        geometry = self.geometry(engine)
        if self._margins is not None and self._margins[0] is window:
            return self._margins[1]
        states = lemma_states(window.final_hidden, engine.final_norm, self.config.space)
        margins = reference_margins(
            geometry, states, exact_radius=self.config.acceptance == "certified-exact"
        )
        self._margins = (window, margins)
        return margins

    @torch.inference_mode()
    def certificate(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        *,
        check_agreement: bool = True,
        exact_radius: bool = False,
    ) -> list[Certificate]:
        """Lemma 4.1 per candidate.

        Args:
            candidate_final: ``(B, r, d)`` candidates' last residual states on the window.
            check_agreement: also compute each candidate's argmax (one head matmul each).
            exact_radius: also test the exact classifier radius.

        Returns:
            One :class:`Certificate` per branch. A token whose reference argmax ``i*`` differs
            from the window's target token (a float near-tie) is never counted certified.
        """
        check_window_inputs(engine, window, candidate_final)
        margins = self._reference(engine, window)
        if exact_radius and margins.exact_radius is None:
            states = margins.states
            margins = reference_margins(self.geometry(engine), states, exact_radius=True)
            self._margins = (window, margins)
        consistent = margins.target_index == window.target_tokens.to(margins.target_index.device)
        certificates = []
        for branch in candidate_final:
            states = lemma_states(branch, engine.final_norm, self.config.space)
            certificate = certify(
                self.geometry(engine),
                margins,
                states,
                exact_radius=exact_radius,
                check_agreement=check_agreement,
            )
            exact = certificate.certified_exact
            certificates.append(
                attrs.evolve(
                    certificate,
                    certified=certificate.certified & consistent,
                    certified_cosine=certificate.certified_cosine & consistent,
                    certified_exact=None if exact is None else exact & consistent,
                )
            )
        return certificates

    # --------------------------------------------------------------- acceptance
    @torch.inference_mode()
    def estimate_acceptance(
        self,
        engine: SublayerEngine,
        window: ReferenceWindow,
        candidate_final: torch.Tensor,
        sampling: SamplingParams,
    ) -> list[AcceptanceEstimate]:
        """α per candidate (greedy agreement semantics regardless of ``sampling``)."""
        mode = self.config.acceptance
        certificates = self.certificate(
            engine,
            window,
            candidate_final,
            check_agreement=False,
            exact_radius=mode == "certified-exact",
        )
        targets = window.target_tokens.to(engine.device)
        estimates = []
        for branch, certificate in zip(candidate_final, certificates, strict=True):
            if mode == "agreement":
                # Agreement with the verifier's own targets, from the model's own head. A
                # certified token provably agrees, so the union only absorbs float noise and
                # makes the certified fraction a floor of α.
                agrees = engine.logits(branch).argmax(dim=-1) == targets
                agrees = agrees | certificate.certified.to(agrees.device)
                estimates.append(
                    wilson_interval(int(agrees.sum()), certificate.size, self.config.confidence)
                )
                continue
            proven = certificate.certified if mode == "certified" else certificate.certified_exact
            assert proven is not None  # exact_radius was requested for "certified-exact"
            interval = wilson_interval(int(proven.sum()), certificate.size, self.config.confidence)
            # The certified fraction lower-bounds agreement; without logits there is no upper
            # information, so the interval's top is 1.
            estimates.append(attrs.evolve(interval, high=1.0))
        return estimates


__all__ = ["AcceptanceMode", "CosineProxy", "CosineProxyConfig", "mean_cosine"]
