"""Losslessness with speculation forced on, for every registered planner (and drafter).

``test_decoder.py::test_every_registered_planner_is_lossless`` builds each planner from its
defaults on a random model, where a cost-driven planner may rightly choose plain decoding
and the test then says nothing about speculation. Here the setting makes drafting pay:

* the model is a tiny Llama whose deep layers are damped (``layer_damping=0.3``), so
  layer-skipping drafts agree with the full model often, though not always;
* the cost model is :class:`~knapspec.testing.CheapDraftCostModel` (draft tokens nearly
  free, any verify width as cheap as one step);
* planner settings that only gate *whether to search* (never what a plan is) are opened
  in :data:`FORCING`.

Each test asserts that tokens were drafted, and that the output equals plain greedy
decoding token for token. Every registered drafter is forced in turn through
:data:`DRAFTER_CONFIGS` (the knapsack search restricted to that drafter); a newly registered
drafter fails :func:`test_every_registered_drafter_is_lossless_and_drafts` until it has an
entry there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from knapspec import SpeculativeDecoder
from knapspec.config import DecoderConfig, build_components, load_builtin_components
from knapspec.drafters import DRAFTERS, LookupDrafter
from knapspec.model.engine import SublayerEngine
from knapspec.planners.base import PLANNERS
from knapspec.proxies.base import PROXIES
from knapspec.testing import CheapDraftCostModel, tiny_llama
from tiny_models import greedy_reference

load_builtin_components()

#: Settings that gate only whether a planner searches, opened so that it does.
FORCING: dict[str, dict[str, Any]] = {
    # The copy gate waits for copied text and the planning budget for long answers;
    # random prompts are neither.
    "knapsack": {"search_gate": "always", "max_planning_fraction": None},
    # SWIFT drafts only once a mask matches the target often enough; on the real model
    # its 45 %-skip masks may not within a short answer (0 is SWIFT's own behaviour).
    "swift": {"min_draft_matchness": 0.0},
    # DEL's measured agreement on real text makes only the first exit pay, by a hair
    # (α ≈ 1/L): an optimistic prior worth many tokens makes it draft whatever it measures.
    "del": {"prior_alpha": 1.0, "prior_tokens": 10_000, "min_shadow_tokens": 1},
}
#: Per drafter, a config under which rounds draft with it and with nothing else.
DRAFTER_CONFIGS: dict[str, dict[str, Any]] = {
    "subnetwork": {
        "planner": {"name": "knapsack", **FORCING["knapsack"], "drafters": ["subnetwork"]},
    },
    "lookup": {
        "planner": {"name": "knapsack", **FORCING["knapsack"], "drafters": ["lookup"]},
        # Not the defaults, to check that the [drafters.lookup] section reaches the drafter.
        "drafters": {"lookup": {"max_ngram": 2, "max_candidates": 4, "max_tokens": 5}},
    },
}
#: Planners that are plain decoding by definition (checked: they draft nothing).
NEVER_DRAFTS = frozenset({"autoregressive"})
NEW_TOKENS = 24
PROMPTS = [torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(10, vocab_size=97, hidden_size=64, layer_damping=0.3, head_scale=8.0)


@pytest.fixture(scope="module")
def references(model: torch.nn.Module) -> list[torch.Tensor]:
    return [greedy_reference(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def assert_lossless_and_drafts(
    decoder: SpeculativeDecoder,
    references: list[torch.Tensor],
    *,
    expect_drafts: bool = True,
    drafter: str | None = None,
) -> None:
    """Every prompt decodes to its greedy reference; drafting happened (or, for a plain
    decoder, did not), counting only ``drafter``'s drafts when it is given."""
    drafted = accepted = 0
    for index, (prompt, expected) in enumerate(zip(PROMPTS, references, strict=True)):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.tokens, expected), f"prompt {index} differs from greedy"
        stats = result.stats
        if drafter is None:
            drafted += stats.drafted_tokens
            accepted += stats.accepted_tokens
        elif drafter in stats.drafters:
            drafted += stats.drafters[drafter].drafted
            accepted += stats.drafters[drafter].accepted
    if expect_drafts:
        assert drafted > 0, "no token was drafted: this run says nothing about speculation"
        assert accepted > 0, "no draft was accepted: the committed-draft path is untested"
    else:
        assert drafted == 0


def _decoder(model: torch.nn.Module, config: dict[str, Any]) -> SpeculativeDecoder:
    """The configured decoder, with the forcing cost model and the default proxy."""
    engine = SublayerEngine(model)
    settings = DecoderConfig.from_dict(config)
    planner, _, _ = build_components(settings, engine)
    proxy = None
    if planner.uses_window:
        proxy_cls = PROXIES.get("montecarlo")
        proxy = proxy_cls.from_config(proxy_cls.config_class(), engine)
    return SpeculativeDecoder(
        engine,
        settings,
        planner=planner,
        cost_model=CheapDraftCostModel(engine.num_layers) if planner.uses_window else None,
        proxy=proxy,
    )


@pytest.mark.parametrize("planner_name", sorted(PLANNERS.names()))
def test_every_registered_planner_is_lossless_and_drafts(
    model: torch.nn.Module, references: list[torch.Tensor], planner_name: str
) -> None:
    config = {"planner": {"name": planner_name, **FORCING.get(planner_name, {})}}
    decoder = _decoder(model, config)
    assert_lossless_and_drafts(decoder, references, expect_drafts=planner_name not in NEVER_DRAFTS)


@pytest.mark.parametrize("drafter_name", DRAFTERS.names())
def test_every_registered_drafter_is_lossless_and_drafts(
    model: torch.nn.Module, references: list[torch.Tensor], drafter_name: str
) -> None:
    if drafter_name not in DRAFTER_CONFIGS:
        pytest.fail(f"add a config that forces drafting with {drafter_name!r} to DRAFTER_CONFIGS")
    config = DRAFTER_CONFIGS[drafter_name]
    decoder = _decoder(model, config)
    for drafter in decoder.drafters.values():  # the [drafters.NAME] params reached them
        assert drafter.config == decoder.config.drafters[drafter.registered_name]
    assert_lossless_and_drafts(decoder, references, drafter=drafter_name)


def test_the_lookup_section_configures_the_lookup_drafter(model: torch.nn.Module) -> None:
    decoder = _decoder(model, DRAFTER_CONFIGS["lookup"])
    (lookup,) = decoder.drafters.values()
    assert isinstance(lookup, LookupDrafter)
    assert (lookup.config.max_ngram, lookup.index.max_ngram, lookup.config.max_tokens) == (2, 2, 5)
