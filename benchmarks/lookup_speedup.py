"""Lookup drafts on the real model: the combined TPT search against plain decoding and
fixed-length prompt lookup, on long "summarise" prompts (the bench's long-input prompts).

Methods, run interleaved per prompt (order rotates per repeat), 2 threads:

- ``ar``: plain decoding (the ``autoregressive`` planner) — the reference;
- ``knapspec``: the default decoder (knapsack planner over {subnetwork, lookup, γ = 0});
- ``lookup-k3`` / ``lookup-k10``: fixed-length lookup (``lookup`` planner, k = 3 / 10).

Greedy outputs are checked token for token against ``ar`` (lossless). Prints, per context
and method, the median per-call speed ratio against ``ar``, the acceptance rate α, the
mean accepted length and the planning + lookup share of wall time; one JSON line per call.

    python benchmarks/lookup_speedup.py [--contexts 2048 4096] [--seeds 0 1 2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.bench.scenarios import SAMPLING
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner, LookupPlanner
from knapspec.planners.lookup import LookupPlannerConfig
from knapspec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["knapspec", "lookup-k3", "lookup-k10"])
    parser.add_argument("--sampling", action="store_true", help="T = 0.7, top-p 0.9")
    parser.add_argument(
        "--output", type=Path, default=Path("results/drafters/lookup_speedup.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    sampling = SAMPLING if args.sampling else SamplingParams()
    builders: dict[str, Any] = {
        "ar": lambda: SpeculativeDecoder(model, planner=AutoregressivePlanner()),
        "knapspec": lambda: SpeculativeDecoder(model),
        "lookup-k3": lambda: SpeculativeDecoder(
            model, planner=LookupPlanner(LookupPlannerConfig(3))
        ),
        "lookup-k10": lambda: SpeculativeDecoder(
            model, planner=LookupPlanner(LookupPlannerConfig(10))
        ),
    }
    names = ["ar", *args.methods]
    decoders = {name: builders[name]() for name in names}
    env = environment(model, args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    warm = long_input_prompt(tokenizer, 256, seed=99)
    for decoder in decoders.values():
        decoder.generate(warm, max_new_tokens=16, sampling=sampling)
    with args.output.open("a") as handle:
        for context in args.contexts:
            ratios: dict[str, list[float]] = {name: [] for name in args.methods}
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for seed in args.seeds:
                prompt = long_input_prompt(tokenizer, context, seed=seed)
                for repeat in range(args.repeats):
                    shift = (seed + repeat) % len(names)
                    order = names[shift:] + names[:shift]
                    results = {}
                    for name in order:
                        call_sampling = (
                            attrs_seed(sampling, 1000 * seed + repeat)
                            if args.sampling
                            else sampling
                        )
                        result = decoders[name].generate(
                            prompt, max_new_tokens=args.new_tokens, sampling=call_sampling
                        )
                        results[name] = result
                    reference = results["ar"]
                    for name in names:
                        stats = results[name].stats
                        lossless = None
                        if not args.sampling:
                            lossless = torch.equal(results[name].tokens, reference.tokens)
                        row = {
                            "method": name,
                            "context": context,
                            "prompt_tokens": prompt.numel(),
                            "seed": seed,
                            "repeat": repeat,
                            "sampling": args.sampling,
                            "lossless": lossless,
                            "speed_vs_ar": reference.stats.wall_time_s / stats.wall_time_s,
                            "wall_time": stats.wall_time_s,
                            "new_tokens": stats.new_tokens,
                            "acceptance_rate": stats.acceptance_rate,
                            "mean_accepted_length": stats.mean_accepted_length,
                            "plan_time": stats.plan_time_s,
                            "lookup_time": stats.lookup_time_s,
                            "drafters": {
                                k: [v.rounds, v.drafted, v.accepted]
                                for k, v in stats.drafters.items()
                            },
                            "env": env,
                        }
                        rows[name].append(row)
                        if name != "ar":
                            ratios[name].append(row["speed_vs_ar"])
                        handle.write(json.dumps(row) + "\n")
                        handle.flush()
            for name in args.methods:
                got = rows[name]
                overhead = statistics.median(
                    (r["plan_time"] + r["lookup_time"]) / r["wall_time"] for r in got
                )
                print(
                    f"n={context} sampling={args.sampling} {name}: median speed vs ar "
                    f"{statistics.median(ratios[name]):.3f} "
                    f"(per call {', '.join(f'{x:.2f}' for x in ratios[name])}), "
                    f"α {statistics.median(r['acceptance_rate'] for r in got):.2f}, "
                    f"mean accepted length "
                    f"{statistics.median(r['mean_accepted_length'] for r in got):.2f}, "
                    f"plan+lookup {100 * overhead:.1f} % of wall, "
                    f"lossless {all(r['lossless'] is not False for r in got)}",
                    flush=True,
                )


def attrs_seed(params: SamplingParams, seed: int) -> SamplingParams:
    import attrs

    return attrs.evolve(params, seed=seed)


if __name__ == "__main__":
    main()
