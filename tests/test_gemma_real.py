"""The exactness contract on the real Gemma 3 270M (provisioned on first use), past its
512-token window: greedy speculative decoding equals plain decoding token for token, a
batch's rows equal each row alone, seeded sampling equals plain seeded sampling, in
float32 and (where the CPU has bf16 units) bfloat16; and ``knapspec serve`` answers
completions sent together exactly as each sent alone, through the ``openai`` client.

Drafting is forced (the cost model under which any draft pays, the search gates opened:
the default planner would draft little on a model whose head is most of a step) and
asserted, so every check verifies many rows, local layers' windows included.
"""

from __future__ import annotations

import asyncio

import attrs
import pytest
import torch

from knapspec import (
    FixedLookupBatchPolicy,
    SamplingParams,
    SpeculativeDecoder,
    StaticPlanner,
    SublayerMask,
)
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.loading.dtypes import bf16_units
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.testing import CheapDraftCostModel
from test_lossless_drafting import FORCING

pytestmark = [pytest.mark.real_model]

MODEL = "gemma-3-270m"
PROMPT_TOKENS = 600  # past the local layers' 512-token window
NEW_TOKENS = 48
SEEDS = (1, 2)

DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=[] if bf16_units() else [pytest.mark.slow],  # never chosen without bf16 units
    ),
]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def gemma(request):  # type: ignore[no-untyped-def]
    model, tokenizer = load_model_and_tokenizer(MODEL, dtype=request.param, progress=False)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert next(model.parameters()).dtype == request.param
    prompts = [long_input_prompt(tokenizer, PROMPT_TOKENS, seed=seed) for seed in SEEDS]
    layers = model.config.num_hidden_layers
    plain = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.full(layers), 0))
    drafting = SpeculativeDecoder.from_config(model, {"planner": FORCING["knapsack"]})
    drafting.cost_model = CheapDraftCostModel(layers)
    return plain, drafting, prompts


def test_speculative_greedy_equals_plain_past_the_window(gemma) -> None:  # type: ignore[no-untyped-def]
    plain, drafting, prompts = gemma
    for index, prompt in enumerate(prompts):
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS).tokens
        result = drafting.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.stats.drafted_tokens > 0
        assert result.tokens.tolist() == expected.tolist(), f"prompt {index} differs"


def test_batch_rows_equal_plain_alone(gemma) -> None:  # type: ignore[no-untyped-def]
    plain, drafting, prompts = gemma
    result = drafting.generate_batch(
        prompts, max_new_tokens=NEW_TOKENS, policy=FixedLookupBatchPolicy(4)
    )
    assert sum(stats.drafted_tokens for stats in result.stats) > 0
    for row, prompt in enumerate(prompts):
        alone = plain.generate(prompt, max_new_tokens=NEW_TOKENS).tokens
        assert result.tokens[row].tolist() == alone.tolist(), f"row {row} differs"


def test_seeded_sampling_equals_plain_sampling(gemma) -> None:  # type: ignore[no-untyped-def]
    plain, drafting, prompts = gemma
    for seed in (5, 6):
        sampling = attrs.evolve(
            SamplingParams(do_sample=True, temperature=0.7, top_p=0.95), seed=seed
        )
        expected = plain.generate(prompts[0], max_new_tokens=NEW_TOKENS, sampling=sampling)
        result = drafting.generate(prompts[0], max_new_tokens=NEW_TOKENS, sampling=sampling)
        assert result.stats.drafted_tokens > 0
        assert result.tokens.tolist() == expected.tokens.tolist(), f"seed {seed} differs"


PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def test_the_server_answers_together_as_alone() -> None:
    openai = pytest.importorskip("openai", reason="the serve tests need knapspec[serve,test]")
    pytest.importorskip("fastapi", reason="the serve tests need knapspec[serve]")
    from serve_support import running

    args = ("--dtype", "float32", "--max-batch", "4", "--max-model-len", "1024")
    with running(MODEL, *args, "--threads", "2", ready_timeout=900) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        jobs = [{"prompt": p, "max_tokens": 32, "temperature": 0} for p in PROMPTS]
        jobs.append(jobs[0] | {"temperature": 0.8, "top_p": 0.9, "seed": 3})
        alone = [client.completions.create(model=model, **job).choices[0].text for job in jobs]
        assert "France" in alone[1]  # a base model continues the text: not always "Paris"

        async def together() -> list[str]:
            async_client = openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key="none", max_retries=0
            )
            answers = await asyncio.gather(
                *(async_client.completions.create(model=model, **job) for job in jobs)
            )
            return [answer.choices[0].text for answer in answers]

        assert asyncio.run(together()) == alone
        stream = client.completions.create(model=model, stream=True, **jobs[2])
        assert "".join(c.choices[0].text for c in stream if c.choices) == alone[2]
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
