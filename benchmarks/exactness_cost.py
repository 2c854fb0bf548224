"""What the exactness contract costs, and where knapspec stands against transformers.

For one ``--dtype`` (the dtype knapspec decodes in): the plain decoder (autoregressive,
through knapspec's engine) and the default decoder, each on an exact engine (the default)
and on one built with ``exact=False``, beside ``model.generate`` in float32 *and* in
bfloat16. Long-input prompts of about ``--lengths`` tokens (a novel passage to summarise)
and Spec-Bench first turns from the packaged questions (``--spec-bench K``: K per
category), greedy, ``--new-tokens`` each, prefill included.

Every method runs on its own copy of the model (an engine fuses its model's projections in
place), interleaved per prompt with the order alternating, after a warm-up. Each decoder's
tokens are compared with the exact plain decoder's: an exact method that differs is a bug,
and the line says so. Each line records the wall time, the time to the first token (the
prefill) and the decode phase, the CPU model and its bf16 / AMX flags, threads and dtypes.

    python benchmarks/exactness_cost.py --dtype bfloat16 [--lengths 512 2048 4096]
        [--prompts 2] [--spec-bench 2] [--new-tokens 128] [--threads 2]

Appends JSON lines to ``--output`` (default ``results/exactness/cost-<dtype>.jsonl``) and
prints a summary: per prompt set, the median speed (new tokens per second, prefill
included) of each method over float32 and bfloat16 ``model.generate`` (higher is faster).
Tokens per second, not wall time, because a method of other numerics (bf16 against fp32,
``exact=False``) may reach EOS elsewhere; ``equals_plain_exact`` says which did.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from knapspec import SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import chat_prompt, long_input_prompt
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.dtypes import DTYPES
from knapspec.model.loading.provision import load_model_and_tokenizer

KNAPSPEC_METHODS = ("plain exact", "default exact", "plain inexact", "default inexact")
GENERATE_METHODS = ("generate float32", "generate bfloat16")


class _FirstTokenClock(BaseStreamer):  # type: ignore[misc]
    """Records when ``model.generate`` hands over its first new token (the prompt comes
    first, then one call per token)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _prompts(tokenizer: Any, args: argparse.Namespace) -> list[tuple[str, int, torch.Tensor]]:
    """``(set name, index, prompt ids (n,))`` for every long-input and Spec-Bench prompt."""
    prompts = [
        (f"long-{length}", index, long_input_prompt(tokenizer, length, seed=index))
        for length in args.lengths
        for index in range(args.prompts)
    ]
    if args.spec_bench:
        taken: dict[str, int] = defaultdict(int)
        for question in load_questions(packaged_questions()):
            if taken[question.category] < args.spec_bench:
                index = taken[question.category]
                taken[question.category] += 1
                ids = chat_prompt(tokenizer, question.turns[0], "")
                prompts.append((f"spec-bench/{question.category}", index, ids))
    return prompts


def _run(
    decoder: SpeculativeDecoder | None, model: Any, prompt: torch.Tensor, new_tokens: int, eos: int
) -> dict[str, Any]:
    """One greedy call: wall time, time to first token, tokens."""
    start = time.perf_counter()
    if decoder is None:
        ids = prompt.unsqueeze(0)
        clock = _FirstTokenClock()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            streamer=clock,
        )
        wall = time.perf_counter() - start
        tokens = out[0, prompt.numel() :].tolist()
        prefill = (clock.first_token_at or time.perf_counter()) - start
    else:
        result = decoder.generate(prompt, max_new_tokens=new_tokens, eos_token_id=eos)
        wall = time.perf_counter() - start
        tokens = result.tokens.tolist()
        prefill = result.stats.prefill_time_s
    return {"wall": wall, "prefill": prefill, "tokens": tokens}


def _summary(rows: list[dict[str, Any]]) -> str:
    """Per prompt set, each method's median speed (new tokens per second of wall time,
    prefill included: outputs of other numerics may stop at EOS elsewhere) over both
    ``model.generate`` runs."""
    by_prompt: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_prompt[(row["prompt_set"], row["prompt"])][row["method"]] = row
    sets = sorted({key[0] for key in by_prompt})
    lines = ["prompt set | method | vs fp32 generate | vs bf16 generate | prefill share"]
    for name in sets:
        group = [methods for key, methods in by_prompt.items() if key[0] == name]
        for method in (*KNAPSPEC_METHODS, *GENERATE_METHODS):
            fp32 = [_speed(m[method]) / _speed(m["generate float32"]) for m in group]
            bf16 = [_speed(m[method]) / _speed(m["generate bfloat16"]) for m in group]
            share = [m[method]["prefill_share"] for m in group]
            lines.append(
                f"{name} | {method} | {statistics.median(fp32):.2f}x | "
                f"{statistics.median(bf16):.2f}x | {statistics.median(share):.0%}"
            )
    return "\n".join(lines)


def _speed(row: dict[str, Any]) -> float:
    """New tokens per second of wall time."""
    return float(row["new_tokens"]) / float(row["wall_time_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 4096])
    parser.add_argument("--prompts", type=int, default=2, help="long-input prompts per length")
    parser.add_argument("--spec-bench", type=int, default=2, help="first turns per category")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    output = args.output or Path(f"results/exactness/cost-{args.dtype}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)

    def load(in_dtype: torch.dtype) -> Any:
        return load_model_and_tokenizer(dtype=in_dtype, progress=False)[0]

    exact_model, tokenizer = load_model_and_tokenizer(dtype=dtype, progress=False)
    loose_model = load(dtype)
    references = {
        "generate float32": load(torch.float32),
        "generate bfloat16": load(torch.bfloat16),
    }
    layers = exact_model.config.num_hidden_layers
    exact, loose = SublayerEngine(exact_model), SublayerEngine(loose_model, exact=False)

    def plain(engine: SublayerEngine) -> SpeculativeDecoder:
        return SpeculativeDecoder(engine, planner=StaticPlanner(SublayerMask.full(layers), 0))

    decoders: dict[str, SpeculativeDecoder | None] = {
        "plain exact": plain(exact),
        "default exact": SpeculativeDecoder(exact),
        "plain inexact": plain(loose),
        "default inexact": SpeculativeDecoder(loose),
        **dict.fromkeys(GENERATE_METHODS),
    }
    models = {
        **dict.fromkeys(("plain exact", "default exact"), exact_model),
        **dict.fromkeys(("plain inexact", "default inexact"), loose_model),
        **references,
    }
    env = {
        **environment(exact_model, args.threads),
        "invariance": exact.invariance.kernels if exact.invariance else None,
        "attention": exact.exact_attention_path,
        **kernel_record(exact),
    }
    command = "python " + " ".join(sys.argv)
    eos = tokenizer.eos_token_id
    warm = long_input_prompt(tokenizer, 128, seed=99)
    for name, decoder in decoders.items():  # kernels, planners' first measurements
        _run(decoder, models[name], warm, 16, eos)
    rows: list[dict[str, Any]] = []
    for turn, (prompt_set, index, prompt) in enumerate(_prompts(tokenizer, args)):
        order = list(decoders) if turn % 2 == 0 else list(reversed(decoders))
        results = {
            name: _run(decoders[name], models[name], prompt, args.new_tokens, eos) for name in order
        }
        reference = results["plain exact"]["tokens"]
        for name in decoders:
            result = results[name]
            row = {
                "prompt_set": prompt_set,
                "prompt": index,
                "prompt_tokens": prompt.numel(),
                "method": name,
                "method_dtype": "float32"
                if name == "generate float32"
                else "bfloat16"
                if name == "generate bfloat16"
                else args.dtype,
                "wall_time_s": result["wall"],
                "prefill_s": result["prefill"],
                "decode_s": result["wall"] - result["prefill"],
                "prefill_share": result["prefill"] / result["wall"],
                "new_tokens": len(result["tokens"]),
                "equals_plain_exact": result["tokens"] == reference,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            with output.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({**row, **env, "command": command}) + "\n")
    print(_summary(rows))


if __name__ == "__main__":
    main()
