"""Tiny random models of the supported families, built in code (milliseconds, offline).

Their outputs mean nothing; they exercise the same code paths as real checkpoints.
"""

from __future__ import annotations

from functools import cache

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=256,
    # No EOS: model.generate would otherwise stop (or, with min_new_tokens, suppress the
    # EOS logit) and the reference would not be plain greedy decoding.
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


@cache
def tiny_model(family: str = "llama", num_layers: int = 3, seed: int = 0) -> PreTrainedModel:
    """A random model of ``family`` with ``num_layers`` layers (cached per arguments)."""
    torch.manual_seed(seed)
    kwargs = dict(_COMMON, num_hidden_layers=num_layers)
    model: PreTrainedModel
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kwargs, sliding_window=None))
    else:
        raise ValueError(family)
    # Sharper logits than the default init, so greedy ties (which no implementation can
    # resolve identically) are vanishingly rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def greedy_reference(model: PreTrainedModel, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``model.generate(do_sample=False)`` continuation ``(new_tokens,)`` of ``prompt (n,)``."""
    ids = prompt.unsqueeze(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
    )
    return out[0, prompt.numel() :]
