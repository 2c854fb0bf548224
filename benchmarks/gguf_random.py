"""knapspec's random-weight models of published shapes, written as GGUF files llama.cpp runs.

The numbers are :func:`knapspec.testing.shapes.random_parameters`' float32 draws (the same
seed gives the same weights ``benchmarks/scale.py`` times; its bfloat16 model is those
draws rounded), streamed one tensor at a time into one file per format, so that no model
of any size is held twice:

* ``F16``: every matrix in float16 (the embedding too); norm weights in float32;
* ``Q8_0`` / ``Q4_0``: every matrix in that format, norms in float32 (``pure``: a file
  made by ``llama-quantize`` without ``--pure`` keeps the output matrix in a wider format;
  the numpy quantizers here have none wider that llama.cpp pairs with Q4_0).

The layout is llama.cpp's for its ``llama`` and ``qwen3`` architectures: tensor names from
gguf-py's tables, query and key rows of the ``llama`` family put in the interleaved order
its rotary embedding reads (transformers keeps each head's two halves apart; ``qwen3``
rotates halves as transformers does), Llama 3's frequency scaling as a ``rope_freqs``
tensor (transformers' scaled inverse frequencies over the plain ones), head sizes written
out (Qwen3-0.6B's 128 is not ``hidden / heads``). The vocabulary is a generated
SentencePiece-style one of the model's size (three control tokens, 256 byte tokens, then
``▁t<i>``): the benchmark feeds token ids, so no text ever passes through it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from knapspec.testing.shapes import ModelShape, parameter_shapes, random_parameters

QUANTS: dict[str, gguf.GGMLQuantizationType] = {
    "F16": gguf.GGMLQuantizationType.F16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
}
_FILE_TYPES = {
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}
_T = gguf.MODEL_TENSOR
#: transformers' module path inside a decoder layer -> llama.cpp's tensor.
_LAYER = {
    "input_layernorm": _T.ATTN_NORM,
    "self_attn.q_proj": _T.ATTN_Q,
    "self_attn.k_proj": _T.ATTN_K,
    "self_attn.v_proj": _T.ATTN_V,
    "self_attn.o_proj": _T.ATTN_OUT,
    "self_attn.q_norm": _T.ATTN_Q_NORM,
    "self_attn.k_norm": _T.ATTN_K_NORM,
    "post_attention_layernorm": _T.FFN_NORM,
    "mlp.gate_proj": _T.FFN_GATE,
    "mlp.up_proj": _T.FFN_UP,
    "mlp.down_proj": _T.FFN_DOWN,
}
_GLOBAL = {"model.embed_tokens": _T.TOKEN_EMBD, "model.norm": _T.OUTPUT_NORM, "lm_head": _T.OUTPUT}
#: Rows quantized per call (bounds the quantizer's temporaries on an 8B embedding).
_CHUNK_ELEMENTS = 1 << 24


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of the transformers parameter ``hf_name`` (``...weight``)."""
    module, suffix = hf_name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{gguf.TENSOR_NAMES[_GLOBAL[module]]}.{suffix}"
    prefix, index, inner = module.split(".", 3)[1:]
    if prefix != "layers" or inner not in _LAYER:
        raise KeyError(f"no GGUF name for {hf_name!r}")
    return f"{gguf.TENSOR_NAMES[_LAYER[inner]].format(bid=int(index))}.{suffix}"


def interleave_rotary_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``weight (heads·d, n)`` with each head's rows reordered from transformers' halves
    (``x_j`` and ``x_{j+d/2}`` rotate together) to adjacent pairs (rows ``2j, 2j+1``), the
    order llama.cpp's ``llama`` rotary embedding reads."""
    rows, columns = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, columns).transpose(1, 2).reshape(rows, columns)


def rope_factors(spec: ModelShape) -> np.ndarray | None:
    """``(head_dim / 2,)`` llama.cpp's per-frequency divisors for Llama 3's scaled rotary
    embedding (plain inverse frequencies over transformers' scaled ones), or None."""
    if spec.rope_scaling is None:
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = spec.config(layers=1, vocab=8)
    scaled, _ = ROPE_INIT_FUNCTIONS[spec.rope_scaling["rope_type"]](config, "cpu")
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim
    plain = 1.0 / spec.rope_theta**exponents
    factors: np.ndarray = (plain / scaled.double()).float().numpy()
    return factors


def _vocabulary(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A generated SentencePiece vocabulary of ``vocab`` tokens (ids only ever matter)."""
    specials = ["<unk>", "<s>", "</s>"]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    byte_count = 256 if vocab >= len(specials) + 256 else 0
    tokens = specials + [f"<0x{b:02X}>" for b in range(byte_count)]
    kinds += [gguf.TokenType.BYTE] * byte_count
    normal = vocab - len(tokens)
    tokens += [f"\u2581t{i}" for i in range(normal)]
    kinds += [gguf.TokenType.NORMAL] * normal
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(
        [0.0] * (len(specials) + byte_count) + [-float(i) for i in range(normal)]
    )
    writer.add_token_types([int(k) for k in kinds])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def _metadata(
    writer: gguf.GGUFWriter, spec: ModelShape, layers: int, vocab: int, quant: str
) -> None:
    writer.add_name(f"random-{spec.name.rsplit('/', 1)[-1]}")
    writer.add_context_length(spec.max_positions)
    writer.add_embedding_length(spec.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type(_FILE_TYPES[quant])
    if quant != "F16":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _vocabulary(writer, vocab)


def _stored_type(shape: tuple[int, ...], quant: str) -> gguf.GGMLQuantizationType:
    """Matrices in ``quant``; vectors (norm weights, rotary factors) in float32."""
    return QUANTS[quant] if len(shape) == 2 else gguf.GGMLQuantizationType.F32


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """``array (rows, n)`` or ``(n,)`` float32 stored as ``qtype`` (raw bytes for a block
    format, quantized in row chunks)."""
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return gguf.quants.quantize(array, qtype)
    step = max(1, _CHUNK_ELEMENTS // array.shape[-1])
    parts = [gguf.quants.quantize(array[i : i + step], qtype) for i in range(0, len(array), step)]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


@torch.no_grad()
def round_like_file(
    model: torch.nn.Module, spec: ModelShape, quant: str, *, layers: int, vocab: int, seed: int
) -> None:
    """Set ``model``'s matrices (a :func:`~knapspec.testing.shapes.random_model` of ``spec``
    with ``seed``) to what the ``quant`` file stores, read back (norm weights stay one):
    transformers on these weights is what llama.cpp should compute from the file, up to
    its own arithmetic. Row chunks bound the temporaries (an 8B embedding)."""
    qtype = QUANTS[quant]
    for name, tensor in random_parameters(spec, layers=layers, vocab=vocab, seed=seed):
        if tensor.dim() != 2:
            continue
        target = model.get_parameter(name)
        step = max(1, _CHUNK_ELEMENTS // tensor.shape[1])
        for i in range(0, tensor.shape[0], step):
            stored = encode(tensor[i : i + step].numpy(), qtype)
            values = gguf.quants.dequantize(stored, qtype).reshape(-1, tensor.shape[1])
            target[i : i + step].copy_(torch.from_numpy(values))


def _tensors(
    spec: ModelShape, layers: int, vocab: int, seed: int
) -> Iterator[tuple[str, np.ndarray]]:
    """``(gguf name, float32 array)`` in file order: the rotary factors, then the model."""
    factors = rope_factors(spec)
    if factors is not None:
        yield f"{gguf.TENSOR_NAMES[_T.ROPE_FREQS]}.weight", factors
    permute = spec.family == "llama"
    for name, tensor in random_parameters(spec, layers=layers, vocab=vocab, seed=seed):
        if permute and name.endswith("self_attn.q_proj.weight"):
            tensor = interleave_rotary_halves(tensor, spec.heads)
        elif permute and name.endswith("self_attn.k_proj.weight"):
            tensor = interleave_rotary_halves(tensor, spec.kv_heads)
        yield gguf_name(name), tensor.numpy()


def write_random_ggufs(
    spec: ModelShape,
    directory: Path,
    *,
    layers: int,
    vocab: int,
    seed: int = 0,
    quants: tuple[str, ...] = tuple(QUANTS),
) -> dict[str, dict[str, Any]]:
    """Write ``<stem>-<quant>.gguf`` per format in one pass over the random weights.

    Returns per format: ``path``, ``tensor_bytes`` (all tensor data, counted as
    ``benchmarks/scale.py`` counts weight bytes: an untied embedding, of which a step reads
    one row, included), ``step_bytes`` (without an untied embedding: what a one-row step
    streams) and ``parameters``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"random-{spec.name.rsplit('/', 1)[-1]}-L{layers}-V{vocab}-s{seed}"
    shapes = [(gguf_name(n), s) for n, s in parameter_shapes(spec, layers=layers, vocab=vocab)]
    factors = rope_factors(spec)
    if factors is not None:
        shapes.insert(0, (f"{gguf.TENSOR_NAMES[_T.ROPE_FREQS]}.weight", tuple(factors.shape)))
    parameters = spec.parameters(layers=layers, vocab=vocab)
    writers: dict[str, gguf.GGUFWriter] = {}
    out: dict[str, dict[str, Any]] = {}
    for quant in quants:
        path = directory / f"{stem}-{quant}.gguf"
        writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[_ARCH[spec.family]])
        _metadata(writer, spec, layers, vocab, quant)
        total = unread = 0
        for name, tensor_shape in shapes:
            qtype = _stored_type(tensor_shape, quant)
            nbytes = _nbytes(tensor_shape, qtype)
            total += nbytes
            if name == "token_embd.weight" and not spec.tied_embeddings:
                unread = nbytes  # a step gathers one row of it
            dtype = np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32
            raw = (
                None
                if qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)
                else qtype
            )
            writer.add_tensor_info(name, tensor_shape, np.dtype(dtype), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writers[quant] = writer
        out[quant] = {
            "path": str(path),
            "tensor_bytes": total,
            "step_bytes": total - unread,
            "parameters": parameters,
        }
    for name, array in _tensors(spec, layers, vocab, seed):
        for quant, writer in writers.items():
            assert next(iter(writer.tensors[0])) == name  # the data in the info's order
            writer.write_tensor_data(encode(array, _stored_type(array.shape, quant)))
    for writer in writers.values():
        writer.close()
    return out


__all__ = [
    "QUANTS",
    "encode",
    "gguf_name",
    "interleave_rotary_halves",
    "rope_factors",
    "round_like_file",
    "write_random_ggufs",
]
