"""Does a layer-skip draft pay in bfloat16? The hindsight oracle per dtype, side by side.

On 2-core CPUs no layer-skip draft of SmolLM2 has paid in float32 (oracle 1.00x): a
verification of k tokens costs nearly k one-token steps (v(k) rises steeply), so a draft
must be both cheap and accepted. bf16 units (AMX tiles, AVX512-BF16) change v(k): a
16-row bf16 product streams the weights once. This runs the bench's oracle
(``knapspec.bench.oracle.oracle_frontier``: mask families grown by cosine, α
teacher-forced over the real greedy continuation, draft and verify costs measured on this
machine) for each ``--dtypes`` on the same prompts, exact engine, and reports v(k) and the
best layer-skip (mask, γ) over plain decoding, beside the lookup family.

    python benchmarks/layerskip_dtype.py [--dtypes float32 bfloat16] [--contexts 512 2048]
        [--new-tokens 128] [--threads 2]

Appends one JSON line per dtype and context to ``--output`` (with every candidate, the CPU
model and its bf16 / AMX flags) and prints the frontier.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from knapspec.bench.env import environment
from knapspec.bench.oracle import OracleOptions, oracle_frontier
from knapspec.bench.prompts import long_input_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters.lookup import LookupDrafter
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.dtypes import DTYPES
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-items", type=int, default=24, help="largest skipped-item count")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default="default", help="a known model (default, gemma-3-270m) or a directory"
    )
    parser.add_argument("--output", type=Path, default=Path("results/oracle/layerskip_dtype.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = OracleOptions(
        sizes=tuple(range(2, args.max_items + 1, 2)), families=("greedy", "layers")
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for name in args.dtypes:
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=DTYPES[name], progress=False)
        engine = SublayerEngine(model)
        plain = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
        env = environment(model, args.threads)
        for context in args.contexts:
            prompt = long_input_prompt(tokenizer, context, seed=context)
            continuation = plain.generate(prompt, max_new_tokens=args.new_tokens).tokens
            result = oracle_frontier(engine, prompt, continuation, options, lookup=LookupDrafter)
            line = {"dtype": name, "context": context, **result.to_dict(), **env}
            with args.output.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")
            ratios = ", ".join(f"{v:.2f}" for v in result.verify_ratio[:9])
            best = result.best
            print(
                f"{name} n={result.context_length}: v(1..9) = {ratios}; layer-skip oracle "
                f"{result.subnetwork_speedup:.3f}x"
                + (
                    f" (skip {best.num_skipped}, α {best.alpha:.2f}, γ {best.best_draft_length})"
                    if best is not None
                    else " (nothing beats plain decoding)"
                )
                + f"; lookup oracle {result.lookup_speedup:.3f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
