"""The published shapes of the 0.6-8B models CPU users run, as random-weight models.

No weights of that size can be had offline, but their shapes can: a model with a published
config and random weights has the real step costs, the real memory traffic and a real
exactness check (greedy speculative output must equal plain decoding), only not real
acceptance. :data:`SHAPES` holds the configs; :func:`random_model` builds a model of any
of them at any depth (full depth for benchmarks; ``layers=2`` and a small ``vocab`` for
tests), with a fixed seed, directly in the requested dtype: the modules are made on the
``meta`` device, given uninitialised storage, and filled in place, so an 8B bf16 model
never exists in float32 (16 GB, not 32) and nothing runs the framework's slow initialisers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@attrs.frozen
class ModelShape:
    """One published configuration (the fields of its ``config.json`` that set the cost).

    Attributes:
        name: the checkpoint's name on the Hugging Face hub.
        family: ``"llama"`` or ``"qwen3"`` (Qwen3 adds RMSNorms on queries and keys).
        rope_scaling: Llama 3's frequency scaling (``rope_type`` ``"llama3"``), or None.
    """

    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    tied_embeddings: bool
    max_positions: int
    rms_norm_eps: float
    rope_scaling: dict[str, Any] | None = None

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalises queries and keys per head (Qwen3)."""
        return self.family == "qwen3"

    def parameters(self, *, layers: int | None = None, vocab: int | None = None) -> int:
        """Parameter count (tied embeddings counted once) at ``layers`` / ``vocab``."""
        layers = self.layers if layers is None else layers
        vocab = self.vocab if vocab is None else vocab
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (2 * q + 2 * kv)  # q, o and k, v projections
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return layers * (attention + mlp + norms) + embeddings + self.hidden

    def kv_bytes_per_token(self, dtype: torch.dtype, *, layers: int | None = None) -> int:
        """Bytes of K/V one cached token takes over all layers."""
        layers = self.layers if layers is None else layers
        return 2 * layers * self.kv_heads * self.head_dim * _itemsize(dtype)

    def config(self, *, layers: int | None = None, vocab: int | None = None) -> Any:
        """The ``transformers`` config, optionally at another depth or vocabulary, without
        EOS / BOS / pad tokens (random weights: a greedy run must not stop early)."""
        import transformers

        config_class = {
            "llama": transformers.LlamaConfig,
            "qwen3": transformers.Qwen3Config,
        }[self.family]
        extra: dict[str, Any] = {}
        if self.rope_scaling is not None:
            extra["rope_scaling"] = dict(self.rope_scaling)
        config = config_class(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers if layers is None else layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab if vocab is None else vocab,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.tied_embeddings,
            max_position_embeddings=self.max_positions,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act="silu",
            attention_bias=False,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
            attn_implementation="sdpa",  # what knapspec's loader asks for
            **extra,
        )
        config.name_or_path = f"random-{self.name.rsplit('/', 1)[-1]}"
        return config


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: The published configs (each checkpoint's ``config.json`` on the Hugging Face hub:
#: Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B: head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6,
#: tied embeddings, 40,960 positions, vocab 151,936; meta-llama/Llama-3.2-1B and -3B:
#: rope_theta 5e5, llama3 rope scaling with factor 32, tied embeddings, 131,072
#: positions, vocab 128,256; meta-llama/Llama-3.1-8B: the same with factor 8 and an untied
#: LM head). Sizes: 0.60 / 1.24 / 1.72 / 3.21 / 8.03 B parameters.
SHAPES: dict[str, ModelShape] = {
    shape.name.rsplit("/", 1)[-1]: shape
    for shape in (
        ModelShape(
            name="Qwen/Qwen3-0.6B",
            family="qwen3",
            hidden=1024,
            intermediate=3072,
            layers=28,
            heads=16,
            kv_heads=8,
            head_dim=128,
            vocab=151936,
            rope_theta=1_000_000.0,
            tied_embeddings=True,
            max_positions=40960,
            rms_norm_eps=1e-6,
        ),
        ModelShape(
            name="meta-llama/Llama-3.2-1B",
            family="llama",
            hidden=2048,
            intermediate=8192,
            layers=16,
            heads=32,
            kv_heads=8,
            head_dim=64,
            vocab=128256,
            rope_theta=500_000.0,
            tied_embeddings=True,
            max_positions=131072,
            rms_norm_eps=1e-5,
            rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
        ),
        ModelShape(
            name="Qwen/Qwen3-1.7B",
            family="qwen3",
            hidden=2048,
            intermediate=6144,
            layers=28,
            heads=16,
            kv_heads=8,
            head_dim=128,
            vocab=151936,
            rope_theta=1_000_000.0,
            tied_embeddings=True,
            max_positions=40960,
            rms_norm_eps=1e-6,
        ),
        ModelShape(
            name="meta-llama/Llama-3.2-3B",
            family="llama",
            hidden=3072,
            intermediate=8192,
            layers=28,
            heads=24,
            kv_heads=8,
            head_dim=128,
            vocab=128256,
            rope_theta=500_000.0,
            tied_embeddings=True,
            max_positions=131072,
            rms_norm_eps=1e-5,
            rope_scaling={**_LLAMA3_SCALING, "factor": 32.0},
        ),
        ModelShape(
            name="meta-llama/Llama-3.1-8B",
            family="llama",
            hidden=4096,
            intermediate=14336,
            layers=32,
            heads=32,
            kv_heads=8,
            head_dim=128,
            vocab=128256,
            rope_theta=500_000.0,
            tied_embeddings=False,
            max_positions=131072,
            rms_norm_eps=1e-5,
            rope_scaling={**_LLAMA3_SCALING, "factor": 8.0},
        ),
    )
}

#: Standard deviation of the random weights (the checkpoints' ``initializer_range``).
WEIGHT_STD = 0.02


def shape(name: str) -> ModelShape:
    """The shape called ``name`` (``"Qwen3-0.6B"``, ... or the full hub name)."""
    key = name.rsplit("/", 1)[-1]
    if key not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return SHAPES[key]


@torch.no_grad()
def random_model(
    name: str | ModelShape,
    *,
    layers: int | None = None,
    vocab: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = WEIGHT_STD,
    head_scale: float = 1.0,
) -> PreTrainedModel:
    """A model of a published shape with random weights, in eval mode, on the CPU.

    Every matrix (embeddings, projections, LM head) is drawn from ``N(0, std²)`` in place,
    in ``dtype`` (no float32 copy: the peak is the model itself), and every norm weight is
    one. The same
    ``(shape, layers, vocab, dtype, seed)`` gives the same weights; a matrix's values do
    not depend on the depth (layer ``i`` is the same in a 2-layer and a full model).

    Args:
        layers: depth (None: the published one).
        vocab: vocabulary size (None: the published one; tests use a few hundred).
        head_scale: factor on the LM head (an untied head only; sharper logits make the
            greedy near-ties that no two implementations resolve alike rarer).
    """
    spec = name if isinstance(name, ModelShape) else shape(name)
    model = _skeleton(spec, layers=layers, vocab=vocab)
    config: Any = model.config
    torch.nn.Module.to(model, dtype)  # on meta: no storage to cast yet
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied LM head storage of its own: tie again
    backbone: Any = model.model
    # The rotary tables are buffers computed at construction (float32): compute them again.
    backbone.rotary_emb = type(backbone.rotary_emb)(config=config)
    generator = torch.Generator()
    for parameter_name, parameter in model.named_parameters():
        _draw(parameter_name, parameter, generator, seed=seed, std=std)
    if head_scale != 1.0 and not spec.tied_embeddings:
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.bos_token_id = None
    model.train(False)
    return model


@torch.no_grad()
def random_parameters(
    name: str | ModelShape,
    *,
    layers: int | None = None,
    vocab: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = WEIGHT_STD,
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`random_model`'s parameters one at a time, each drawn afresh, without the model.

    Yields ``(transformers parameter name, tensor)`` in the model's parameter order (a
    tied LM head once, as ``model.embed_tokens.weight``), each tensor the same numbers
    ``random_model`` puts there with the same arguments (``head_scale`` 1). Only one
    tensor exists at a time, so a writer can stream a model that does not fit in memory
    twice (or at all, in float32). A ``bfloat16`` draw is the ``float32`` draw rounded.
    """
    generator = torch.Generator()
    for parameter_name, parameter in _skeleton(name, layers=layers, vocab=vocab).named_parameters():
        tensor = torch.empty(parameter.shape, dtype=dtype)
        _draw(parameter_name, tensor, generator, seed=seed, std=std)
        yield parameter_name, tensor


def parameter_shapes(
    name: str | ModelShape, *, layers: int | None = None, vocab: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """``(transformers parameter name, shape)`` of each parameter, in the order
    :func:`random_parameters` yields them (nothing is allocated)."""
    model = _skeleton(name, layers=layers, vocab=vocab)
    return [(key, tuple(value.shape)) for key, value in model.named_parameters()]


def _skeleton(name: str | ModelShape, *, layers: int | None, vocab: int | None) -> PreTrainedModel:
    """The ``transformers`` model of ``name`` on the ``meta`` device (no storage)."""
    spec = name if isinstance(name, ModelShape) else shape(name)
    import transformers

    model_class = {
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[spec.family]
    with torch.device("meta"):
        model: PreTrainedModel = model_class(spec.config(layers=layers, vocab=vocab))
    return model


def _draw(
    parameter_name: str, out: torch.Tensor, generator: torch.Generator, *, seed: int, std: float
) -> None:
    """Fill ``out`` in place: ones for a norm weight (1-D), else ``N(0, std²)`` from a seed
    fixed per matrix by its name, so that depth does not shift the draws."""
    if out.dim() == 1:  # RMSNorm weights
        out.fill_(1.0)
        return
    generator.manual_seed(seed * 1_000_003 + _name_seed(parameter_name))
    out.normal_(0.0, std, generator=generator)  # in place, in its own dtype


def _name_seed(name: str) -> int:
    """A stable small integer from a parameter's name (``hash`` varies per process)."""
    value = 0
    for char in name.encode():
        value = (value * 131 + char) % 1_000_000_007
    return value


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters (a tied tensor counted once)."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += parameter.numel() * parameter.element_size()
    return total


__all__ = [
    "SHAPES",
    "WEIGHT_STD",
    "ModelShape",
    "parameter_shapes",
    "random_model",
    "random_parameters",
    "shape",
    "weight_bytes",
]
