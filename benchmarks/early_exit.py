"""Does the confidence early exit cut drafted-but-rejected tokens? (SmolLM2, real text)

For a fixed draft (a static mask found once by the knapsack DP is not needed: a mask that
skips a spread of items is enough to make drafts fallible) and γ = 8, decode the same
Austen prompts with τ_conf = 0 (never stop early) and τ_conf = 0.7 (the default) and count
drafted, accepted and rejected draft tokens. Greedy outputs are checked to be identical.

    python benchmarks/early_exit.py [--prompts 4] [--new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from knapspec import SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment
from knapspec.bench.prompts import copy_prompt, long_input_prompt
from knapspec.model.loading.provision import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", type=int, nargs="+", default=[5, 9, 17, 25, 33, 41, 49, 53])
    parser.add_argument("--output", type=Path, default=Path("results/decoding/early_exit.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    mask = SublayerMask.from_skipped(model.config.num_hidden_layers, args.skip)
    eos = model.generation_config.eos_token_id
    env = environment(model, args.threads)
    rows = []
    totals: dict[float, dict[str, float]] = {}
    for index in range(args.prompts):
        make = long_input_prompt if index % 2 == 0 else copy_prompt
        prompt = make(tokenizer, 512, seed=index)
        outputs = {}
        for threshold in (0.0, 0.7):
            decoder = SpeculativeDecoder(
                model, planner=StaticPlanner(mask, 8), confidence_threshold=threshold
            )
            result = decoder.generate(prompt, max_new_tokens=args.new_tokens, eos_token_id=eos)
            stats = result.stats
            outputs[threshold] = result.tokens
            row = {
                "prompt": index,
                "scenario": make.__name__,
                "confidence_threshold": threshold,
                "drafted": stats.drafted_tokens,
                "accepted": stats.accepted_tokens,
                "rejected": stats.drafted_tokens - stats.accepted_tokens,
                "rounds": stats.rounds,
                "new_tokens": stats.new_tokens,
                "wall_time": stats.wall_time_s,
                "mask_skipped": list(mask.skipped),
                **env,
            }
            rows.append(row)
            total = totals.setdefault(threshold, {"drafted": 0, "rejected": 0, "time": 0.0})
            total["drafted"] += row["drafted"]
            total["rejected"] += row["rejected"]
            total["time"] += row["wall_time"]
        if not torch.equal(outputs[0.0], outputs[0.7]):
            raise SystemExit("LOSSLESSNESS FAILURE: outputs differ between thresholds")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    for threshold, total in totals.items():
        print(
            f"tau_conf={threshold}: drafted {total['drafted']:.0f}, rejected "
            f"{total['rejected']:.0f}, wall {total['time']:.1f} s"
        )


if __name__ == "__main__":
    main()
