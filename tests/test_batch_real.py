"""Batches on the real SmolLM2-135M-Instruct and real text: a ragged batch of prompts of
mixed lengths gives every row exactly ``model.generate``'s greedy tokens for that prompt
alone, with lookup drafts verified in the batch (asserted: drafts were made)."""

from __future__ import annotations

import pytest
import torch

from knapspec import FixedLookupBatchPolicy, LookupPlanner, SpeculativeDecoder
from knapspec.bench.prompts import copy_prompt, long_input_prompt
from knapspec.model.loading.provision import load_model_and_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

NEW_TOKENS = 20


def _assert_rows_equal_generate(model, prompts, result) -> None:  # type: ignore[no-untyped-def]
    """Every row equals ``model.generate``'s greedy tokens for that prompt alone."""
    for row, prompt in enumerate(prompts):
        ids = prompt.unsqueeze(0)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        assert torch.equal(result.tokens[row], out[0, prompt.numel() :]), f"row {row} differs"


def test_a_mixed_length_batch_equals_each_prompt_alone() -> None:
    model, tokenizer = load_model_and_tokenizer(progress=False)
    prompts = [
        copy_prompt(tokenizer, 160, seed=1),  # copies: lookup drafts are accepted
        long_input_prompt(tokenizer, 48, seed=2),
        long_input_prompt(tokenizer, 300, seed=3),
    ]
    assert len({p.numel() for p in prompts}) == 3
    eos = model.generation_config.eos_token_id
    decoder = SpeculativeDecoder(model, planner=LookupPlanner())
    result = decoder.generate_batch(
        prompts, max_new_tokens=NEW_TOKENS, eos_token_id=eos, policy=FixedLookupBatchPolicy(4)
    )
    _assert_rows_equal_generate(model, prompts, result)
    assert result.stats[0].accepted_tokens > 0


def test_a_batch_drafting_with_a_shared_subnetwork_equals_each_prompt_alone() -> None:
    """Real text, a real layer-skipping mask (every third MLP and the last attention items
    skipped), sub-network drafts forced in every row: still model.generate's tokens."""
    from knapspec import FixedSubnetworkBatchPolicy, StaticPlanner, SublayerMask

    model, tokenizer = load_model_and_tokenizer(progress=False)
    layers = model.config.num_hidden_layers
    skipped = tuple(sorted({2 * layer + 1 for layer in range(0, layers, 3)} | {2 * layers - 2}))
    prompts = [copy_prompt(tokenizer, 120, seed=4), long_input_prompt(tokenizer, 200, seed=5)]
    eos = model.generation_config.eos_token_id
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(SublayerMask.from_skipped(layers, skipped), 3)
    )
    result = decoder.generate_batch(
        prompts, max_new_tokens=NEW_TOKENS, eos_token_id=eos, policy=FixedSubnetworkBatchPolicy(3)
    )
    _assert_rows_equal_generate(model, prompts, result)
    assert all(stats.drafters["subnetwork"].drafted > 0 for stats in result.stats)
    assert sum(s.accepted_tokens for s in result.stats) > 0
