"""``benchmarks/scale_gguf.py`` (step 1 in ``scale_gguf_write.py``) and its writer
``benchmarks/gguf_random.py`` at a tiny shape, and the table ``benchmarks/scale_table.py``
makes of both benchmarks' lines.

The files must round-trip through gguf-py's reader (llama.cpp's names, shapes and types;
the float16 data the random model's numbers, query and key rows of the ``llama`` family
reordered), the reordering must turn transformers' half rotation into llama.cpp's pair
rotation, and, where a Python with ``llama_cpp`` is at hand, llama.cpp's logits must
follow transformers' (and must not when the reordering is left out: the check's power).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
import torch
from benchmarks import gguf_random
from benchmarks.gguf_random import (
    QUANTS,
    gguf_name,
    interleave_rotary_halves,
    rope_factors,
    round_like_file,
    write_random_ggufs,
)
from benchmarks.scale_gguf import MIN_CORRELATION, build_parser
from benchmarks.scale_gguf_write import write
from benchmarks.scale_table import markdown, table_rows

import knapspec.testing.shapes as shapes_module
from knapspec.testing.shapes import (
    SHAPES,
    ModelShape,
    parameter_shapes,
    random_model,
    random_parameters,
)

ROOT = Path(__file__).resolve().parents[1]
#: Each family's layout at widths a test runs in seconds; head_dim 32 with 4 heads makes
#: the attention width (128) differ from the hidden size, as Qwen3-0.6B's does. The hidden
#: size is a real one: with ``N(0, 0.02²)`` weights the attention scores' spread grows
#: with it (``0.0004 · hidden`` without q/k norms), and at a toy width attention is so
#: nearly uniform that no rotary order would change the logits.
TINY = {
    family: attrs.evolve(
        SHAPES[base],
        name=f"test/tiny-{family}",
        hidden=1024,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        layers=2,
        vocab=320,
    )
    for family, base in (("qwen3", "Qwen3-0.6B"), ("llama", "Llama-3.2-1B"))
}

#: A Python that can import llama_cpp (this one, or the one named by the variable).
LLAMACPP_PYTHON_ENV = "KNAPSPEC_LLAMACPP_PYTHON"


def test_the_names_are_llama_cpps() -> None:
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    assert gguf_name("model.norm.weight") == "output_norm.weight"
    assert gguf_name("model.layers.3.self_attn.o_proj.weight") == "blk.3.attn_output.weight"
    assert gguf_name("model.layers.11.self_attn.k_norm.weight") == "blk.11.attn_k_norm.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    with pytest.raises(KeyError):
        gguf_name("model.layers.0.mlp.up_proj.bias_scale.weight")


def _rotate_halves(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """transformers' rotation of ``x (d,)``: ``x_j`` pairs with ``x_{j+d/2}``."""
    half = x.shape[0] // 2
    a, b = x[:half], x[half:]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([a * cos - b * sin, b * cos + a * sin])


def _rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """llama.cpp's ``llama`` rotation of ``x (d,)``: ``x_{2j}`` pairs with ``x_{2j+1}``."""
    a, b = x[0::2], x[1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=1).reshape(-1)


def test_interleaving_turns_half_rotation_into_pair_rotation() -> None:
    heads, head_dim, columns = 3, 8, 5
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(heads * head_dim, columns, generator=generator, dtype=torch.float64)
    x = torch.randn(columns, generator=generator, dtype=torch.float64)
    angles = torch.rand(head_dim // 2, generator=generator, dtype=torch.float64) * 6
    reordered = interleave_rotary_halves(weight, heads)
    for h in range(heads):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        hf = _rotate_halves(weight[rows] @ x, angles)
        cpp = _rotate_pairs(reordered[rows] @ x, angles)
        # The same vector, in llama.cpp's order: its pairs are transformers' (j, j + d/2).
        assert torch.allclose(cpp, interleave_rotary_halves(hf[:, None], 1)[:, 0])
    assert not torch.equal(reordered, weight)


def test_llama3_scaling_becomes_frequency_divisors() -> None:
    spec = SHAPES["Llama-3.2-1B"]
    factors = rope_factors(spec)
    assert factors is not None and factors.shape == (spec.head_dim // 2,)
    assert spec.rope_scaling is not None
    assert factors[0] == pytest.approx(1.0)  # the fastest frequencies are not scaled
    assert factors[-1] == pytest.approx(spec.rope_scaling["factor"])  # the slowest fully
    assert np.all(np.diff(factors) >= -1e-5 * factors[1:])  # and those between, smoothly
    assert rope_factors(SHAPES["Qwen3-0.6B"]) is None


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", list(TINY))
def test_the_files_round_trip(family: str, tied: bool, tmp_path: Path) -> None:
    spec = attrs.evolve(TINY[family], tied_embeddings=tied)
    files = write_random_ggufs(spec, tmp_path, layers=2, vocab=spec.vocab, seed=5)
    source = {gguf_name(n): t.numpy() for n, t in random_parameters(spec, vocab=spec.vocab, seed=5)}
    for heads, kind in ((spec.heads, "attn_q"), (spec.kv_heads, "attn_k")):
        for layer in range(2):
            key = f"blk.{layer}.{kind}.weight"
            if family == "llama":
                source[key] = interleave_rotary_halves(torch.from_numpy(source[key]), heads).numpy()
    expected = set(source) | ({"rope_freqs.weight"} if family == "llama" else set())
    assert len(source) == len(parameter_shapes(spec, vocab=spec.vocab))
    assert ("output.weight" in source) is not tied  # a tied head is the embedding
    for quant, entry in files.items():
        # The reference model of the check: transformers' layout, the file's values.
        rounded = random_model(spec, vocab=spec.vocab, seed=5)
        round_like_file(rounded, spec, quant, layers=2, vocab=spec.vocab, seed=5)
        stored = {gguf_name(n): p.detach() for n, p in rounded.named_parameters() if p.dim() == 2}
        reader = gguf.GGUFReader(entry["path"])
        assert _field(reader, "general.architecture") == family
        assert _field(reader, f"{family}.block_count") == 2
        assert _field(reader, f"{family}.attention.key_length") == spec.head_dim
        assert _field(reader, f"{family}.attention.head_count_kv") == spec.kv_heads
        assert len(_field(reader, "tokenizer.ggml.tokens")) == spec.vocab
        tensors = {t.name: t for t in reader.tensors}
        assert set(tensors) == expected
        assert sum(t.n_bytes for t in tensors.values()) == entry["tensor_bytes"]
        unread = 0 if tied else int(tensors["token_embd.weight"].n_bytes)
        assert entry["step_bytes"] == entry["tensor_bytes"] - unread
        for name, array in source.items():
            tensor = tensors[name]
            assert tuple(int(n) for n in tensor.shape) == tuple(reversed(array.shape)), name
            if array.ndim == 1:
                assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, name
                assert np.array_equal(tensor.data, array), name
                continue
            assert tensor.tensor_type == QUANTS[quant], name
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(array.shape)
            if quant == "F16":
                assert np.array_equal(values, array.astype(np.float16).astype(np.float32)), name
            else:  # within one quantization step of its block (32 values along a row)
                levels = {"Q8_0": 127, "Q4_0": 8}[quant]
                blocks = np.abs(array).reshape(-1, 32).max(axis=1, keepdims=True)
                error = np.abs(values - array).reshape(-1, 32)
                assert np.all(error <= blocks / levels * 1.01 + 1e-6), name
                assert error.max() > 0, name
            rotary = {"attn_q": spec.heads, "attn_k": spec.kv_heads}.get(name.split(".")[-2])
            reference = stored[name]
            if family == "llama" and rotary is not None:
                reference = interleave_rotary_halves(reference, rotary)
            assert np.array_equal(values, reference.numpy()), name


def _llamacpp_python() -> str | None:
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return os.environ.get(LLAMACPP_PYTHON_ENV)


def _write_and_time(
    spec: ModelShape, directory: Path, python: str
) -> tuple[int, list[dict[str, Any]]]:
    """Both steps on ``spec`` (two layers); the time step's exit status and its lines."""
    args = build_parser().parse_args(
        [
            "write",
            "--sizes",
            "Qwen3-0.6B",
            "--vocab",
            str(spec.vocab),
            "--prompt-tokens",
            "24",
            "--new-tokens",
            "6",
            "--pairs",
            "1",
            "--prefill-lengths",
            "32",
            "--check-tokens",
            "8",
            "--bandwidth-mib",
            "8",
            "--output-dir",
            str(directory),
        ]
    )
    with pytest.MonkeyPatch.context() as patch:  # write() resolves --sizes through shape()
        patch.setattr(shapes_module, "shape", lambda name: spec)
        write(args)
    (manifest,) = directory.glob("*.json")
    output = directory / "lines.jsonl"
    done = subprocess.run(
        [
            python,
            str(ROOT / "benchmarks" / "scale_gguf.py"),
            "time",
            "--manifest",
            str(manifest),
            "--repeats",
            "2",
            "--prefill-repeats",
            "1",
            "--no-extra-buffers",
            "--output",
            str(output),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = (
        [json.loads(line) for line in output.read_text().splitlines()] if output.exists() else []
    )
    assert lines, done.stderr
    return done.returncode, lines


@pytest.mark.parametrize("family", list(TINY))
def test_llama_cpp_follows_transformers(family: str, tmp_path: Path) -> None:
    python = _llamacpp_python()
    if python is None:
        pytest.skip(
            "llama_cpp is not importable here (llama-cpp-python lives in its own environment: "
            f"set {LLAMACPP_PYTHON_ENV} to that environment's python to run this)"
        )
    status, lines = _write_and_time(TINY[family], tmp_path / "good", python)
    checks = {line["quant"]: line for line in lines if line["kind"] == "check"}
    assert status == 0 and set(checks) == set(QUANTS)
    for quant, line in checks.items():
        assert line["check_passed"] and line["logits_correlation"] >= MIN_CORRELATION[quant]
    assert checks["F16"]["greedy_agree_prefix"] == checks["F16"]["greedy_tokens"] == 8
    assert checks["F16"]["top1_equal"] and checks["Q8_0"]["top1_equal"]
    assert {line["kind"] for line in lines} == {"check", "steps", "generate"}
    if family != "llama":
        return
    # The mutant: query and key rows left in transformers' order. It must have run (the
    # file differs) and the check must fail it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_random, "interleave_rotary_halves", lambda weight, heads: weight)
        status, lines = _write_and_time(TINY[family], tmp_path / "mutant", python)
    mutant = {line["quant"]: line for line in lines if line["kind"] == "check"}
    assert mutant["F16"]["logits_correlation"] != checks["F16"]["logits_correlation"]
    assert status == 1 and not mutant["F16"]["check_passed"]
    assert not mutant["Q8_0"]["check_passed"]
    error = mutant["F16"]["logits_rel_rms_error"]
    assert error > 10 * checks["F16"]["logits_rel_rms_error"]


def test_the_table_puts_each_system_beside_its_own_floor() -> None:
    base = {"shape": "Qwen/Qwen3-0.6B", "layers": 28, "parameters": 1000}
    knapspec = {**base, "dtype": "float32", "weight_bytes": 4000, "floor_ms": 50.0}
    scale_lines = [
        {**knapspec, "kind": "steps", "step_ms": {"1": 100.0, "4": 150.0}},
        {**knapspec, "kind": "steps", "step_ms": {"1": 80.0, "4": 150.0}},
        {
            **knapspec,
            "kind": "generate",
            "seconds": {"plain": 8.0, "generate": 16.0},
            "new_tokens": {"plain": 64, "generate": 64},
        },
        {**knapspec, "kind": "steps", "step_ms": {"1": 1.0}, "quick": True, "layers": 2},
    ]
    q4 = {**base, "quant": "Q4_0", "bytes_per_weight": 0.5625, "floor_ms": 7.0}
    llama_lines = [
        {**q4, "kind": "check"},
        {**q4, "kind": "steps", "step_ms": {"1": 21.0}},
        {**q4, "kind": "generate", "tokens_per_second": 30.0},
        {**q4, "kind": "generate", "tokens_per_second": 40.0},
    ]
    rows = table_rows(scale_lines, llama_lines)
    assert [(r["system"], r["format"]) for r in rows] == [
        ("knapspec plain", "float32"),
        ("llama.cpp", "Q4_0"),
        ("transformers generate", "float32"),
    ]
    knapspec_row, llama_row, hf_row = rows
    assert knapspec_row["step_ms"] == 90.0 and knapspec_row["step_over_floor"] == 1.8
    assert knapspec_row["bytes_per_weight"] == 4.0 and knapspec_row["tokens_per_second"] == 8.0
    assert llama_row["step_over_floor"] == 3.0 and llama_row["tokens_per_second"] == 35.0
    assert hf_row["tokens_per_second"] == 4.0
    table = markdown(rows)
    assert "| Qwen3-0.6B | 28 | llama.cpp | Q4_0 | 0.56 | 7.0 | 21.0 | 3.00 | 35.0 |" in table
