"""``model.generate(custom_generate=...)`` runs knapspec with the GenerationConfig's settings."""

from __future__ import annotations

import pytest
import torch
from tests.tiny_models import greedy_reference, tiny_model

from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.integrations.hf import make_custom_generate
from knapspec.planners import StaticPlanner
from knapspec.sampling import SamplingParams
from knapspec.types import SublayerMask


def _decoder() -> SpeculativeDecoder:
    return SpeculativeDecoder(
        tiny_model("llama"), planner=StaticPlanner(SublayerMask.from_skipped(3, [1, 4]), 3)
    )


def test_custom_generate_returns_the_decoders_tokens_and_honours_max_new_tokens() -> None:
    decoder = _decoder()
    model = decoder.engine.model
    prompt = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    out = model.generate(  # type: ignore[operator]
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=15,
        do_sample=False,
        custom_generate=make_custom_generate(decoder),
    )
    direct = decoder.generate(prompt, max_new_tokens=15)
    assert torch.equal(out, direct.sequences)
    assert torch.equal(out[0, 9:], greedy_reference(model, prompt[0], 15))  # type: ignore[arg-type]


def test_custom_generate_honours_eos() -> None:
    decoder = _decoder()
    model = decoder.engine.model
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = greedy_reference(model, prompt[0], 12).tolist()  # type: ignore[arg-type]
    eos = reference[4]
    out = model.generate(  # type: ignore[operator]
        prompt,
        max_new_tokens=12,
        eos_token_id=eos,
        do_sample=False,
        custom_generate=make_custom_generate(decoder),
    )
    assert out[0, 7:].tolist() == reference[: reference.index(eos) + 1]


def test_custom_generate_sampling_reads_temperature_top_k_top_p() -> None:
    decoder = _decoder()
    model = decoder.engine.model
    prompt = torch.randint(0, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    seen: list[SamplingParams] = []
    original = decoder.generate

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["sampling"])
        return original(*args, **kwargs)

    decoder.generate = spy  # type: ignore[method-assign]
    out = model.generate(  # type: ignore[operator]
        prompt,
        max_new_tokens=6,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        custom_generate=make_custom_generate(decoder),
    )
    assert out.shape == (1, 11)
    assert seen == [SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)]


def test_custom_generate_refuses_batches() -> None:
    decoder = _decoder()
    model = decoder.engine.model
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="batch size 2"):
        model.generate(  # type: ignore[operator]
            prompt, max_new_tokens=4, custom_generate=make_custom_generate(decoder)
        )
