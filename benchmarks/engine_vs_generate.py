"""Plain decoding through the knapspec engine (γ = 0 every round) vs ``model.generate``.

Side by side in one process, interleaved pairs after a warm-up, prefill included, greedy,
real SmolLM2-135M-Instruct and real text (the protocol of ``knapspec.bench.runner``). Checks
token equality. Every line records the CPU, its vector flags, the BLAS and the engine's
kernel table: the ratio holds for that machine only.

    python benchmarks/engine_vs_generate.py [--contexts 512 2048 4096] [--pairs 3]
        [--new-tokens 128] [--model gemma-3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import long_input_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default="default", help="a known model (default, gemma-3-270m) or a directory"
    )
    parser.add_argument(
        "--output", type=Path, default=Path("results/engine/engine_vs_generate.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    decoder = SpeculativeDecoder(model, planner=AutoregressivePlanner())
    env = {**environment(model, args.threads), **kernel_record(decoder.engine)}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    eos = model.generation_config.eos_token_id

    def hf(ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        """``model.generate`` as users call it (greedy, stops at EOS)."""
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new_tokens,
            do_sample=False,
        )
        return time.perf_counter() - start, out[0, ids.shape[1] :]

    def ours(ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        out = decoder.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=eos)
        return time.perf_counter() - start, out.tokens

    rows = []
    for context in args.contexts:
        prompt = long_input_prompt(tokenizer, context, seed=context)
        ids = prompt.unsqueeze(0)

        hf(ids), ours(ids)  # warm-up
        ratios = []
        for pair in range(args.pairs):
            t_hf, tok_hf = hf(ids)
            t_ours, tok_ours = ours(ids)
            if not torch.equal(tok_hf, tok_ours):
                raise SystemExit(f"LOSSLESSNESS FAILURE at context {context}: outputs differ")
            ratios.append(t_hf / t_ours)
            row = {
                "context": context,
                "pair": pair,
                "generate_s": t_hf,
                "engine_s": t_ours,
                "speedup": t_hf / t_ours,
                "new_tokens": len(tok_ours),
                **env,
            }
            rows.append(row)
            print(
                json.dumps(
                    {k: row[k] for k in ("context", "pair", "generate_s", "engine_s", "speedup")}
                )
            )
        print(
            f"context {context}: engine/generate speedup median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
        )
    with args.output.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
