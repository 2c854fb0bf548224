"""Lookup-draft acceptance under sampling: rejection sampling against position-keyed.

For each long-input prompt (about ``--tokens`` tokens of Austen after "Summarize the
following passage") and each seed, decode ``--new-tokens`` tokens at temperature ``--T``
with the lookup planner under both verification schemes, and count drafted and accepted
lookup tokens. Under position-keyed sampling the output is also compared token for token
with plain sampling (the autoregressive planner) of the same seed. Acceptance counts are
not timings, so a busy machine does not change them; the wall times recorded are noisy.

    python benchmarks/sampling_acceptance.py [--prompts 2] [--seeds 3] [--tokens 2048]
        [--reference-seeds 1] [--first-seed 0]

Each row is appended to ``--output`` as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from knapspec import SamplingParams, SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import LookupPlanner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed, first-seed+1, ..."
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--T", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--reference-seeds",
        type=int,
        default=None,
        help="compare with plain sampling for the first N seeds only (default: all)",
    )
    parser.add_argument(
        "--output", type=Path, default=Path("results/decoding/sampling_acceptance.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    env = environment(model, args.threads)
    layers = model.config.num_hidden_layers
    lookup = SpeculativeDecoder(model, planner=LookupPlanner())
    plain = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.full(layers), 0))
    command = "python " + " ".join(sys.argv)
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for index in range(args.prompts):
        prompt = long_input_prompt(tokenizer, args.tokens, seed=index)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            reference = None
            for scheme in ("rejection", "position-keyed"):
                params = SamplingParams(
                    do_sample=True, temperature=args.T, seed=seed, verification=scheme
                )
                result = lookup.generate(prompt, max_new_tokens=args.new_tokens, sampling=params)
                stats = result.stats
                row = {
                    "prompt": index,
                    "prompt_tokens": prompt.numel(),
                    "seed": seed,
                    "temperature": args.T,
                    "verification": scheme,
                    "planner": "lookup",
                    "drafted": stats.drafted_tokens,
                    "accepted": stats.accepted_tokens,
                    "rounds": stats.rounds,
                    "new_tokens": stats.new_tokens,
                    "wall_time": stats.wall_time_s,
                }
                checked = (
                    args.reference_seeds is None or seed - args.first_seed < args.reference_seeds
                )
                if scheme == "position-keyed" and checked:
                    plain_result = plain.generate(
                        prompt, max_new_tokens=args.new_tokens, sampling=params
                    )
                    reference = plain_result.tokens
                    # Plain sampling of the same seed, right after: the speed-up's baseline.
                    row["plain_wall_time"] = plain_result.stats.wall_time_s
                    same = result.tokens.tolist() == reference.tolist()
                    row["equals_plain_sampling"] = same
                    if not same:
                        first = next(
                            i
                            for i, (a, b) in enumerate(zip(result.tokens, reference, strict=False))
                            if int(a) != int(b)
                        )
                        row["first_difference"] = first
                rows.append(row)
                print(json.dumps(row), flush=True)
                with args.output.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps({**row, **env, "command": command}) + "\n")
    for scheme in ("rejection", "position-keyed"):
        chosen = [r for r in rows if r["verification"] == scheme]
        drafted = sum(r["drafted"] for r in chosen)
        accepted = sum(r["accepted"] for r in chosen)
        print(f"{scheme}: {accepted}/{drafted} lookup tokens accepted ({accepted / drafted:.3f})")


if __name__ == "__main__":
    main()
