"""Tiny random models of the supported families, built in code (milliseconds, offline).

Their outputs mean nothing; they exercise the same code paths as real checkpoints.
"""

from __future__ import annotations

from functools import cache

import torch
from transformers import PreTrainedModel

from knapspec import testing

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")


@cache
def tiny_model(family: str = "llama", num_layers: int = 3, seed: int = 0) -> PreTrainedModel:
    """:func:`knapspec.testing.tiny_model`, cached per arguments (do not modify it)."""
    return testing.tiny_model(family, num_layers, seed)


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
