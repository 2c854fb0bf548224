"""What the exactness contract costs: the same decoders with the exact engine (the default)
and with ``exact=False``, beside ``model.generate``, on long-input prompts.

Two copies of the model (an engine fuses its model's projections; a second engine on the
same model would re-fuse them under the first), five methods interleaved per prompt,
alternating their order, greedy, prefill included. Every exact decoder's tokens are
compared with the exact plain decoding's.

    python benchmarks/exactness_cost.py [--lengths 512 2048] [--prompts 2]
        [--new-tokens 128] [--threads 2]

Each measurement is appended to ``--output`` as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from knapspec import SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.engine import SublayerEngine
from knapspec.model.provision import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/exactness/cost.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    exact_model, tokenizer = load_model_and_tokenizer(progress=False)
    loose_model, _ = load_model_and_tokenizer(progress=False)
    reference_model, _ = load_model_and_tokenizer(progress=False)
    layers = exact_model.config.num_hidden_layers
    exact, loose = SublayerEngine(exact_model), SublayerEngine(loose_model, exact=False)

    def plain(engine: SublayerEngine) -> SpeculativeDecoder:
        return SpeculativeDecoder(engine, planner=StaticPlanner(SublayerMask.full(layers), 0))

    methods: dict[str, Any] = {
        "plain exact": plain(exact),
        "default exact": SpeculativeDecoder(exact),
        "plain inexact": plain(loose),
        "default inexact": SpeculativeDecoder(loose),
        "model.generate": None,
    }
    env = environment(exact_model, args.threads)
    command = "python " + " ".join(sys.argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    # Warm-up: every method once on a short prompt (kernels, planners' first measurements).
    warm = long_input_prompt(tokenizer, 128, seed=99)
    for name, decoder in methods.items():
        _run(name, decoder, reference_model, warm, 16, eos)
    for length in args.lengths:
        for index in range(args.prompts):
            prompt = long_input_prompt(tokenizer, length, seed=index)
            order = list(methods) if index % 2 == 0 else list(reversed(methods))
            results = {
                name: _run(name, methods[name], reference_model, prompt, args.new_tokens, eos)
                for name in order
            }
            reference = results["plain exact"]["tokens"]
            for name in methods:
                row = {
                    "length": length,
                    "prompt": index,
                    "prompt_tokens": prompt.numel(),
                    "method": name,
                    "wall_time_s": results[name]["wall"],
                    "new_tokens": len(results[name]["tokens"]),
                    "equals_plain_exact": results[name]["tokens"] == reference,
                }
                print(json.dumps(row), flush=True)
                with args.output.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps({**row, **env, "command": command}) + "\n")


def _run(
    name: str,
    decoder: SpeculativeDecoder | None,
    model: Any,
    prompt: torch.Tensor,
    new_tokens: int,
    eos: int,
) -> dict[str, Any]:
    start = time.perf_counter()
    if decoder is None:
        ids = prompt.unsqueeze(0)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
        )
        tokens = out[0, prompt.numel() :].tolist()
    else:
        tokens = decoder.generate(prompt, max_new_tokens=new_tokens, eos_token_id=eos).tokens
        tokens = tokens.tolist()
    return {"wall": time.perf_counter() - start, "tokens": tokens}


if __name__ == "__main__":
    main()
