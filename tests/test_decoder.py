"""SpeculativeDecoder: lossless greedy decoding, cache invariants, bad input, streaming."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.tiny_models import FAMILIES, greedy_reference, tiny_model
from transformers.generation.streamers import BaseStreamer

from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.errors import NonFiniteLogitsError
from knapspec.model import ContextLengthError, SublayerEngine
from knapspec.planners import (
    PLANNERS,
    AutoregressivePlanner,
    Planner,
    PlanningContext,
    StaticPlanner,
)
from knapspec.testing import examples
from knapspec.types import DraftPlan, StepOutcome, SublayerMask

NEW_TOKENS = 24


def _prompt(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@given(
    skip=st.lists(st.booleans(), min_size=6, max_size=6),
    draft_length=st.integers(0, 6),
    seed=st.integers(0, 10_000),
    prompt_length=st.integers(1, 20),
    threshold=st.sampled_from([0.0, 0.3, 0.7]),
)
def test_greedy_output_equals_model_generate(
    family: str,
    skip: list[bool],
    draft_length: int,
    seed: int,
    prompt_length: int,
    threshold: float,
) -> None:
    model = tiny_model(family)
    prompt = _prompt(seed, prompt_length)
    mask = SublayerMask(tuple(not s for s in skip))
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(mask, draft_length), confidence_threshold=threshold
    )
    result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.tokens, greedy_reference(model, prompt, NEW_TOKENS))
    assert result.sequences.shape == (1, prompt_length + NEW_TOKENS)
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS
    assert sum(stats.accept_lengths) == NEW_TOKENS - 1  # the first token comes from prefill
    assert stats.accepted_tokens <= stats.drafted_tokens


@pytest.mark.parametrize("mask_kind", ["full", "empty", "attention-only", "mlp-only"])
def test_extreme_masks_are_lossless(mask_kind: str) -> None:
    model = tiny_model("llama", num_layers=4)
    executed = {
        "full": (True,) * 8,
        "empty": (False,) * 8,
        "attention-only": (True, False) * 4,
        "mlp-only": (False, True) * 4,
    }[mask_kind]
    prompt = _prompt(7, 12)
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(SublayerMask(executed), 5), confidence_threshold=0
    )
    result = decoder.generate(prompt, max_new_tokens=30)
    assert torch.equal(result.tokens, greedy_reference(model, prompt, 30))
    if mask_kind == "full":
        assert result.stats.acceptance_rate == 1.0


class _CacheAuditor(Planner, BaseStreamer):
    """Plans with a fixed mask and, after every round, checks the decoder's KV cache against
    a fresh full forward of the committed sequence (it streams the tokens to know it)."""

    uses_window = False

    def __init__(self, engine: SublayerEngine, mask: SublayerMask, draft_length: int) -> None:
        self.engine, self.mask, self.draft_length = engine, mask, draft_length
        self.sequence: list[int] = []
        self.context: PlanningContext | None = None
        self.audits = 0

    def put(self, value: torch.Tensor) -> None:
        self.sequence.extend(value.flatten().tolist())

    def end(self) -> None:
        pass

    def plan(self, context: PlanningContext) -> DraftPlan:
        self.context = context
        return DraftPlan(self.mask, self.draft_length)

    def update(self, outcome: StepOutcome) -> None:
        assert self.context is not None
        cache = self.context.cache
        n = outcome.context_length
        # Every committed token but the pending last one is in every layer's cache.
        assert len(self.sequence) == n + 1
        assert cache.lengths == [n] * self.engine.num_layers
        fresh = self.engine.new_cache()
        self.engine.forward(torch.tensor(self.sequence[:n]), 0, fresh)
        for layer in range(self.engine.num_layers):
            torch.testing.assert_close(cache.keys(layer), fresh.keys(layer), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                cache.values(layer), fresh.values(layer), atol=1e-5, rtol=1e-4
            )
        self.audits += 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cache_holds_exactly_the_accepted_tokens_after_every_round(family: str) -> None:
    model = tiny_model(family)
    decoder = SpeculativeDecoder(model, planner=AutoregressivePlanner())
    auditor = _CacheAuditor(decoder.engine, SublayerMask.from_skipped(3, [1, 2, 5]), 4)
    decoder.planner = auditor
    result = decoder.generate(_prompt(3, 9), max_new_tokens=20, streamer=auditor)
    assert auditor.audits == result.stats.rounds > 0
    assert result.stats.drafted_tokens > result.stats.accepted_tokens  # rejections happened


class _ListStreamer(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def test_streamer_receives_exactly_the_returned_tokens_in_order() -> None:
    model = tiny_model("llama")
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.from_skipped(3, [3]), 3))
    streamer = _ListStreamer()
    prompt = _prompt(11, 6)
    result = decoder.generate(prompt, max_new_tokens=17, streamer=streamer)
    assert streamer.chunks[0] == prompt.tolist()  # transformers streamers get the prompt first
    streamed = [token for chunk in streamer.chunks[1:] for token in chunk]
    assert streamed == result.tokens.tolist()
    assert streamer.ended


def test_eos_stops_generation_and_is_included() -> None:
    model = tiny_model("llama")
    prompt = _prompt(5, 8)
    reference = greedy_reference(model, prompt, 20).tolist()
    eos = reference[6]
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.from_skipped(3, [0]), 4))
    result = decoder.generate(prompt, max_new_tokens=20, eos_token_id=[eos])
    assert result.tokens.tolist() == reference[: reference.index(eos) + 1]
    assert result.stats.stop_reason == "eos"


def _working_decoder() -> tuple[SpeculativeDecoder, torch.Tensor, torch.Tensor]:
    model = tiny_model("llama")
    decoder = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.from_skipped(3, [2]), 3))
    prompt = _prompt(9, 10)
    return decoder, prompt, greedy_reference(model, prompt, 12)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda d: d.generate(torch.tensor([], dtype=torch.long)), ValueError, "prompt is empty"),
        (lambda d: d.generate(torch.zeros(2, 5, dtype=torch.long)), ValueError, "has 2 rows"),
        (
            lambda d: d.generate(torch.tensor([1, 2]), max_new_tokens=0),
            ValueError,
            "max_new_tokens",
        ),
        (
            lambda d: d.generate(torch.tensor([1, 2]), max_new_tokens=-3),
            ValueError,
            "max_new_tokens",
        ),
        (
            lambda d: d.generate(torch.zeros(250, dtype=torch.long), max_new_tokens=10),
            ContextLengthError,
            "context",
        ),
        (lambda d: d.generate(torch.tensor([1, 500])), ValueError, "token ids must be in"),
        (lambda d: d.generate(torch.tensor([0.5, 1.0])), ValueError, "integer token ids"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_decoder_still_works(call, error, message) -> None:  # type: ignore[no-untyped-def]
    decoder, prompt, expected = _working_decoder()
    with pytest.raises(error, match=message):
        call(decoder)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=12).tokens, expected)


def test_mask_of_the_wrong_length_is_refused_and_the_decoder_recovers() -> None:
    decoder, prompt, expected = _working_decoder()
    decoder.planner = StaticPlanner(SublayerMask.full(2), 3)
    with pytest.raises(ValueError, match="static mask has 4 items, the model 6"):
        decoder.generate(prompt, max_new_tokens=12)
    decoder.planner = StaticPlanner(SublayerMask.from_skipped(3, [2]), 3)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=12).tokens, expected)


def test_nan_logits_raise_and_the_decoder_recovers_after_the_model_is_fixed() -> None:
    decoder, prompt, expected = _working_decoder()
    weight = decoder.engine.lm_head.weight  # type: ignore[union-attr]
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[5, 0] = float("nan")
    try:
        with pytest.raises(NonFiniteLogitsError, match="NaN/inf logits"):
            decoder.generate(prompt, max_new_tokens=12)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.equal(decoder.generate(prompt, max_new_tokens=12).tokens, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_draft_length": 0},
        {"window_rounds": 0},
        {"confidence_threshold": 1.5},
        {"confidence_threshold": -0.1},
    ],
)
def test_out_of_range_hyper_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SpeculativeDecoder(tiny_model("llama"), planner=AutoregressivePlanner(), **kwargs)  # type: ignore[arg-type]


def test_stats_are_consistent_and_serialisable() -> None:
    decoder, prompt, _ = _working_decoder()
    stats = decoder.generate(prompt, max_new_tokens=12).stats
    data = stats.to_dict()
    assert data["new_tokens"] == 12
    assert data["decoding_steps"] == len(data["accept_lengths"]) == stats.rounds
    assert 0.0 <= data["acceptance_rate"] <= 1.0
    assert data["per_position_acceptance"][0] == pytest.approx(
        stats.accepted_at_position[0] / stats.drafted_at_position[0]
    )
    assert stats.plans and stats.plans[0].draft_length == 3
    assert "tok/s" in stats.summary()
    assert isinstance(stats.to_json(), str)


@pytest.mark.parametrize("planner_name", sorted(PLANNERS.names()))
@settings(max_examples=examples(4))
@given(seed=st.integers(0, 10_000), prompt_length=st.integers(4, 24))
def test_every_registered_planner_is_lossless(
    planner_name: str, seed: int, prompt_length: int
) -> None:
    """Each planner built from its default config, on a model deep enough for real plans."""
    model = tiny_model("llama", num_layers=10)  # deeper than early-exit's default exit layer
    decoder = SpeculativeDecoder.from_config(model, {"planner": {"name": planner_name}})
    prompt = _prompt(seed, prompt_length)
    result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.tokens, greedy_reference(model, prompt, NEW_TOKENS))


class _WindowChoice(AutoregressivePlanner):
    """Plain steps that ask for the reference window on the rounds in ``wanted``."""

    uses_window = True

    def __init__(self, wanted: set[int]) -> None:
        self.wanted = wanted
        self.asked: list[int] = []
        self.windows: list[tuple[bool, int | None]] = []

    def plan(self, context: PlanningContext) -> DraftPlan:
        window = context.window
        self.windows.append((context.has_window, None if window is None else window.start))
        return super().plan(context)

    def wants_window(self, tokens: torch.Tensor) -> bool:
        self.asked.append(tokens.numel())
        return len(self.asked) - 1 in self.wanted


def test_the_window_is_recorded_only_on_the_rounds_the_planner_asks() -> None:
    model = tiny_model("llama")
    prompt = _prompt(3, 12)
    # Asked before the prefill (index 0) and before each verify pass; record rounds 2-4 only.
    planner = _WindowChoice(wanted={3, 4, 5})
    decoder = SpeculativeDecoder(model, planner=planner, proxy=None, cost_model=None)
    result = decoder.generate(prompt, max_new_tokens=10)
    assert torch.equal(result.tokens, greedy_reference(model, prompt, 10))
    # The planner saw the committed sequence: the prompt, then one more token per round.
    assert planner.asked == list(range(12, 12 + 10))
    # No window before round 3; fresh windows in rounds 3-5; stale (kept, not fresh) after.
    fresh = [has for has, _ in planner.windows]
    assert fresh == [False, False, False, True, True, True, False, False, False]
    starts = {start for _, start in planner.windows if start is not None}
    assert starts == {14}  # the rounds recorded contiguously from position 14 on
    assert decoder._window.end == 17
