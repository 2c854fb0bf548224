"""A stronger hindsight oracle: masks grown by top-1 agreement instead of cosine.

The bench's oracle (``knapspec bench``) grows each mask family greedily by the cosine of
final hidden states on 4 continuation tokens. Cosine is a cheap proxy and may understate
the frontier. This script grows masks over all 2L items by teacher-forced top-1 agreement
with the AR continuation on ``--calibration`` tokens (ties broken by cosine), then measures
α over the whole continuation and the real draft and verify costs, exactly as the bench's
oracle does (``knapspec.bench.oracle``), next to the cosine-grown ``greedy`` family. Each
growth step runs every remaining item over the calibration tokens, so it takes minutes.

    python benchmarks/oracle_agreement_growth.py [--scenario copy-heavy] [--contexts 2048 4096]

Writes ``results/oracle/agreement_growth.jsonl`` (one line per context: the oracle result
with every candidate) and prints the best candidates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from knapspec.bench.env import environment
from knapspec.bench.oracle import OracleOptions, oracle_frontier
from knapspec.bench.prompts import copy_prompt, long_input_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner

PROMPTS = {"copy-heavy": copy_prompt, "long-input": long_input_prompt}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(PROMPTS), default="copy-heavy")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calibration", type=int, default=48)
    parser.add_argument("--max-items", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/oracle/agreement_growth.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    engine = SublayerEngine(model)
    plain = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    options = OracleOptions(
        sizes=tuple(range(1, args.max_items + 1)),
        families=("greedy", "agreement"),
        calibration_tokens=args.calibration,
    )
    env = environment(model, args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a") as handle:
        for context in args.contexts:
            prompt = PROMPTS[args.scenario](tokenizer, context, seed=context)
            continuation = plain.generate(prompt, max_new_tokens=args.new_tokens).tokens
            result = oracle_frontier(engine, prompt, continuation, options)
            line = {
                "scenario": args.scenario,
                "context": context,
                "calibration_tokens": args.calibration,
                **result.to_dict(),
                "env": env,
            }
            handle.write(json.dumps(line) + "\n")
            handle.flush()
            print(f"{args.scenario} n={result.context_length}: frontier {result.speedup:.3f}x")
            for family in options.families:
                ranked = sorted(
                    (c for c in result.candidates if c.family == family),
                    key=lambda c: -c.speedup,
                )
                for candidate in ranked[:3]:
                    print(
                        f"  {family:9s} skip {candidate.num_skipped:2d}: α {candidate.alpha:.3f}, "
                        f"draft {1e3 * candidate.draft_seconds:.1f} ms, "
                        f"γ {candidate.best_draft_length}, {candidate.speedup:.3f}x",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
