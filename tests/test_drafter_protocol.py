"""One drafter protocol: a drafter registered by name drafts wherever the built-ins do.

The toy drafter below (the one docs/extending.md shows) proposes, from the last token, the
chain of tokens that most recently followed each token. Nothing in the decoder knows its
name or class: it is reached through ``DRAFTERS`` and its declared capabilities
(``proposes_before_planning``, and ``drafts_rows_together`` left False, so a batch gives
each row its own copy). The tests check that it drafts in single-sequence decoding (the
fixed-length planner), in the knapsack planner's TPT search, and in batched decoding, and
that the output stays the target's greedy output token for token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from knapspec import SpeculativeDecoder
from knapspec.config import DecoderConfig, build_components
from knapspec.drafters import DRAFTERS, Draft, Drafter, DraftRequest
from knapspec.model.engine import SublayerEngine
from knapspec.planners.batch.policy import FixedLookupBatchPolicy
from knapspec.proxies.base import PROXIES
from knapspec.testing import CheapDraftCostModel, tiny_llama
from knapspec.validators import at_least
from tiny_models import greedy_reference

NAME = "test-bigram"
NEW_TOKENS = 24
PROMPTS = [torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]


@attrs.frozen
class BigramConfig:
    max_tokens: int = attrs.field(default=4, validator=at_least(1))


class BigramDrafter(Drafter):
    """Chains, from the last token, the token that last followed each token."""

    config_class = BigramConfig
    proposes_before_planning = True

    def __init__(self, config: BigramConfig | None = None) -> None:
        self.config = self.checked_config(config)
        self.follower: dict[int, int] = {}
        self.last: int | None = None
        self.calls = 0

    def reset(self, tokens: list[int]) -> None:
        self.follower, self.last = {}, None
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.last is not None:
                self.follower[self.last] = token
            self.last = token

    def propose(self, request: DraftRequest) -> Draft:
        self.calls += 1
        tokens: list[int] = []
        token = self.last
        while len(tokens) < min(request.budget, self.config.max_tokens) and token in self.follower:
            token = self.follower[token]
            tokens.append(token)
        return Draft(tuple(tokens), NAME)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    DRAFTERS.register(NAME)(BigramDrafter)
    yield
    DRAFTERS.unregister(NAME)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(10, vocab_size=97, hidden_size=64, layer_damping=0.3, head_scale=8.0)


@pytest.fixture(scope="module")
def references(model: torch.nn.Module) -> list[torch.Tensor]:
    return [greedy_reference(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def _decoder(model: torch.nn.Module, planner: dict[str, Any]) -> SpeculativeDecoder:
    """A decoder of ``planner`` with the forcing cost model (drafts nearly free)."""
    engine = SublayerEngine(model)
    settings = DecoderConfig.from_dict({"planner": planner, "drafters": {NAME: {"max_tokens": 3}}})
    built, _, _ = build_components(settings, engine)
    proxy = PROXIES.get("montecarlo").from_config(None, engine) if built.uses_window else None
    cost_model = CheapDraftCostModel(engine.num_layers)
    return SpeculativeDecoder(engine, settings, planner=built, cost_model=cost_model, proxy=proxy)


def _assert_drafts_losslessly(decoder: SpeculativeDecoder, references: list[torch.Tensor]) -> None:
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, references, strict=True):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.tokens, expected)
        counts = result.stats.drafters.get(NAME)
        drafted += counts.drafted if counts is not None else 0
        accepted += counts.accepted if counts is not None else 0
    assert drafted > 0 and accepted > 0, "the toy drafter never drafted (or never hit)"


def test_the_decoder_builds_the_drafter_from_its_section(model: torch.nn.Module) -> None:
    decoder = _decoder(model, {"name": "lookup", "drafter": NAME})
    assert set(decoder.drafters) == {NAME}
    assert decoder.drafters[NAME].config == BigramConfig(max_tokens=3)


def test_it_drafts_in_single_decoding(
    model: torch.nn.Module, references: list[torch.Tensor]
) -> None:
    decoder = _decoder(model, {"name": "lookup", "drafter": NAME, "draft_length": 3})
    _assert_drafts_losslessly(decoder, references)


def test_it_drafts_in_the_tpt_search(
    model: torch.nn.Module, references: list[torch.Tensor]
) -> None:
    planner = {"name": "knapsack", "drafters": [NAME], "search_gate": "always"}
    decoder = _decoder(model, planner)
    assert decoder.planner.proposal_drafters() == {NAME}
    _assert_drafts_losslessly(decoder, references)
    # The plans the search made named it, with its priced acceptance.
    option = decoder.planner.last_lookup_  # type: ignore[attr-defined]
    assert option is not None and option.tokens_per_second > 0


@pytest.mark.parametrize("policy", ["fixed", "tpt"])
def test_it_drafts_in_batched_decoding(
    model: torch.nn.Module, references: list[torch.Tensor], policy: str
) -> None:
    decoder = _decoder(model, {"name": "knapsack", "drafters": [NAME]})
    result = decoder.generate_batch(
        [prompt.tolist() for prompt in PROMPTS],
        max_new_tokens=NEW_TOKENS,
        policy=FixedLookupBatchPolicy(3) if policy == "fixed" else None,
    )
    for tokens, expected in zip(result.tokens, references, strict=True):
        assert torch.equal(tokens, expected)
    drafted = sum(s.drafters[NAME].drafted for s in result.stats if NAME in s.drafters)
    assert drafted > 0, "no row drafted with the toy drafter"
    # Each row drafted with its own copy: the decoder's instance never proposed.
    assert decoder.drafters[NAME].calls == 0  # type: ignore[attr-defined]
