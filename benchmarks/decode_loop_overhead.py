"""What the speculative decoder's own bookkeeping costs when it decides not to speculate.

Three decoders on the same prompt, interleaved (order alternates per pair), 2 threads:

- ``ar``: the ``autoregressive`` planner (plain steps; no window, no cost model);
- ``ar-window``: plain steps that record the reference window on every verify pass, as
  every window-reading planner did before ``Planner.wants_window``: the price of the
  recording alone;
- ``knapsack``: the default decoder (knapsack planner, copy gate, online cost model).

On text where the planner keeps γ = 0 (a summary), ``knapsack / ar`` is the whole cost
of KnapSpec's machinery. Writes one JSON line per run and prints the median per-pair
ratios of wall time (prefill included) and of decode time (after the prefill).

    python benchmarks/decode_loop_overhead.py [--contexts 512 2048] [--pairs 6] [--sampling]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.bench.scenarios import SAMPLING
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner
from knapspec.sampling import SamplingParams


class RecordingAutoregressivePlanner(AutoregressivePlanner):
    """Plain steps that ask for the reference window every round."""

    uses_window = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sampling", action="store_true", help="T = 0.7, top-p 0.9")
    parser.add_argument(
        "--output", type=Path, default=Path("results/engine/decode_loop_overhead.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    sampling = SAMPLING if args.sampling else SamplingParams()
    decoders = {
        "ar": SpeculativeDecoder(model, planner=AutoregressivePlanner(), sampling=sampling),
        "ar-window": SpeculativeDecoder(
            model, planner=RecordingAutoregressivePlanner(), sampling=sampling
        ),
        "knapsack": SpeculativeDecoder(model, sampling=sampling),
    }
    env = environment(model, args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("a") as handle:
        for context in args.contexts:
            prompt = long_input_prompt(tokenizer, context, seed=context)
            for decoder in decoders.values():  # warm-up
                decoder.generate(prompt, max_new_tokens=16)
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in decoders}
            for pair in range(args.pairs):
                order = list(decoders) if pair % 2 == 0 else list(reversed(decoders))
                for name in order:
                    stats = decoders[name].generate(prompt, max_new_tokens=args.new_tokens).stats
                    row = {
                        "wall_time": stats.wall_time_s,
                        "decode_time": stats.wall_time_s - stats.prefill_time_s,
                        "plan_time": stats.plan_time_s,
                        "verify_time": stats.verify_time_s,
                        "new_tokens": stats.new_tokens,
                    }
                    runs[name].append(row)
                    line = {
                        "method": name,
                        "context": context,
                        "prompt_tokens": prompt.numel(),
                        "pair": pair,
                        "sampling": args.sampling,
                        **row,
                        "env": env,
                    }
                    handle.write(json.dumps(line) + "\n")
                    handle.flush()
            for name in ("ar-window", "knapsack"):
                pairs = list(zip(runs["ar"], runs[name], strict=True))
                wall = statistics.median(a["wall_time"] / b["wall_time"] for a, b in pairs)
                decode = statistics.median(a["decode_time"] / b["decode_time"] for a, b in pairs)
                print(
                    f"n={context} sampling={args.sampling} {name}: speed vs ar "
                    f"{wall:.3f} (wall), {decode:.3f} (decode only)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
