"""Tiny random models built in code, reference windows and planning contexts over them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from knapspec.costmodels.base import CostModel
from knapspec.proxies.base import ValueProxy
from knapspec.sampling import SamplingParams
from knapspec.window import ReferenceWindow

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import PlanningContext

from knapspec.testing.doubles import AnalyticCostModel, TopOneProxy


def tiny_llama(
    num_layers: int = 8,
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    seed: int = 0,
    layer_damping: float = 1.0,
    head_scale: float = 1.0,
) -> LlamaForCausalLM:
    """A random Llama (4 query / 2 KV heads, no EOS) built in code, in eval mode.

    Args:
        layer_damping: factor on the output projections (``o_proj``, ``down_proj``) of every
            layer but the first. Below 1, deep layers move the residual little, so drafts
            that skip them agree with the full model often (0.3: most drafts accepted,
            some rejected).
        head_scale: factor on the LM head. Sharper logits (e.g. 8) make greedy near-ties,
            which no two implementations resolve alike, vanishingly rare.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(layer_damping)
            layer.mlp.down_proj.weight.mul_(layer_damping)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    result: LlamaForCausalLM = model
    return result


def tiny_engine(
    num_layers: int = 8, *, seed: int = 0, layer_damping: float = 1.0
) -> SublayerEngine:
    """:func:`tiny_llama` wrapped in a :class:`~knapspec.model.engine.SublayerEngine`."""
    from knapspec.model.engine import SublayerEngine

    return SublayerEngine(tiny_llama(num_layers, seed=seed, layer_damping=layer_damping))


def tiny_model(family: str = "llama", num_layers: int = 3, seed: int = 0) -> PreTrainedModel:
    """A random model of ``family`` (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"`` or
    ``"gemma3"``; hidden 64, vocab 97, 4 query / 2 KV heads, no EOS) in eval mode, its LM
    head scaled by 8 so that greedy ties, which no two implementations resolve alike, are
    vanishingly rare.

    ``"gemma3"`` is a Gemma 3 text model as the real one is laid out
    (:data:`TINY_GEMMA3`): one K/V head for four query heads of 256, every layer but the
    last (and every third) attending over a sliding window of 8 tokens, so that short
    tests cross the window, a query scale from ``query_pre_attn_scalar`` that is not
    ``head_dim``, and random norm weights (Gemma scales by ``1 + w``, zero at init).
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
        "mistral": (
            transformers.MistralConfig,
            transformers.MistralForCausalLM,
            {"sliding_window": None},
        ),
        "gemma3": (
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForCausalLM,
            {
                **TINY_GEMMA3,
                "layer_types": [
                    "full_attention"
                    if (i + 1) % 3 == 0 or i + 1 == num_layers
                    else "sliding_attention"
                    for i in range(num_layers)
                ],
            },
        ),
    }
    if family not in classes:
        raise ValueError(f"family must be one of {', '.join(classes)}, got {family!r}")
    config_class, model_class, extra = classes[family]
    torch.manual_seed(seed)
    model: PreTrainedModel = model_class(
        config_class(**{**TINY_FAMILY_SHAPE, **extra}, num_hidden_layers=num_layers)
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        if family == "gemma3":
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.uniform_(-0.5, 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.train(False)  # eval mode
    return model


#: The shape of :func:`tiny_model`'s models.
TINY_FAMILY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 97,
    "max_position_embeddings": 256,
    # No EOS: model.generate would otherwise stop (or, with min_new_tokens, suppress the
    # EOS logit) and the reference would not be plain greedy decoding.
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}


#: What :func:`tiny_model` changes for ``"gemma3"`` (the layer types follow from the layers).
TINY_GEMMA3: dict[str, Any] = {
    "num_key_value_heads": 1,
    "head_dim": 256,
    "sliding_window": 8,
    "query_pre_attn_scalar": 64,
}


def random_tokens(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    """``(length,)`` random token ids; the same seed gives prefixes of one stream."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator)


def random_window(
    engine: SublayerEngine, length: int, window_size: int, seed: int
) -> tuple[KVCache, ReferenceWindow]:
    """:func:`reference_window` over ``length`` random tokens (:func:`random_tokens`)."""
    return reference_window(engine, random_tokens(engine.vocab_size, length, seed), window_size)


def reference_window(
    engine: SublayerEngine, token_ids: torch.Tensor, window_size: int
) -> tuple[KVCache, ReferenceWindow]:
    """A cache holding ``token_ids (n,)`` (full model) and the window of its last tokens."""
    cache = engine.new_cache(token_ids.numel() + 16)
    with torch.inference_mode():
        out = engine.forward(token_ids, 0, cache, capture_points=True, capture_last=window_size)
    if out.points is None:
        raise RuntimeError("the engine did not capture the window's points")
    window = ReferenceWindow(
        points=out.points,
        token_ids=token_ids[-window_size:],
        target_tokens=out.logits[-window_size:].argmax(dim=-1),
        start=token_ids.numel() - window_size,
    )
    return cache, window


def planning_context(
    engine: SublayerEngine,
    *,
    cost_model: CostModel | None = None,
    proxy: ValueProxy | None = None,
    context_length: int = 40,
    window_size: int = 12,
    with_window: bool = True,
    max_draft_length: int = 10,
    seed: int = 1234,
    round_index: int = 0,
) -> PlanningContext:
    """A planning context over a cache of ``context_length`` random tokens.

    Defaults: :class:`AnalyticCostModel` and :class:`TopOneProxy`.
    """
    from knapspec.planners.base import PlanningContext

    tokens = random_tokens(engine.vocab_size, context_length, seed)
    cache, window = reference_window(engine, tokens, window_size)
    return PlanningContext(
        engine=engine,
        cache=cache,
        context_length=context_length,
        window=window if with_window else None,
        cost_model=cost_model if cost_model is not None else AnalyticCostModel(engine.num_layers),
        proxy=proxy if proxy is not None else TopOneProxy(),
        max_draft_length=max_draft_length,
        sampling=SamplingParams(),
        round_index=round_index,
        tokens=tokens,
    )


__all__ = [
    "TINY_FAMILY_SHAPE",
    "TINY_GEMMA3",
    "planning_context",
    "random_tokens",
    "random_window",
    "reference_window",
    "tiny_engine",
    "tiny_llama",
    "tiny_model",
]
