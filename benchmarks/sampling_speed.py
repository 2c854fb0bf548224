"""The sampling speed-up under both verification schemes: position-keyed (the default since
issue #35) against rejection sampling (the scheme before it), on long-input prompts.

Per prompt and seed, five calls interleaved (their order reversed every other pair):
plain sampling and the default decoder under each scheme, and seeded ``model.generate``
sampling for reference. T = 0.7, top-p 0.9 (the ``sampling`` scenario's settings), prefill
included. Position-keyed outputs are compared token for token: the default decoder's with
plain sampling's of the same seed. The speed-up of each scheme is the median over pairs of
``plain wall time / default wall time`` under that scheme.

    python benchmarks/sampling_speed.py [--tokens 2048] [--prompts 3] [--seeds 2]
        [--new-tokens 128] [--threads 2]

Each call is appended to ``--output`` as one JSON line; a summary line ends the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from knapspec import SamplingParams, SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.loading.provision import load_model_and_tokenizer

SCHEMES = ("position-keyed", "rejection")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--T", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/decoding/sampling_speed.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    # model.generate runs on its own copy: the engine fuses its model's projections.
    reference_model, _ = load_model_and_tokenizer(progress=False)
    layers = model.config.num_hidden_layers
    plain = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.full(layers), 0))
    default = SpeculativeDecoder(plain.engine)
    arms: dict[str, tuple[SpeculativeDecoder | None, str]] = {
        f"{name} {scheme}": (decoder, scheme)
        for scheme in SCHEMES
        for name, decoder in (("plain", plain), ("default", default))
    }
    arms["model.generate"] = (None, "transformers")
    env = environment(model, args.threads)
    command = "python " + " ".join(sys.argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def params(scheme: str, seed: int) -> SamplingParams:
        return SamplingParams(
            do_sample=True, temperature=args.T, top_p=args.top_p, seed=seed, verification=scheme
        )

    # Warm-up: every arm once on a short prompt (kernels, the planner's first measurements).
    warm = long_input_prompt(tokenizer, 128, seed=99)
    for decoder, scheme in arms.values():
        _call(decoder, reference_model, warm, 16, scheme, params, 0)
    ratios: dict[str, list[float]] = {scheme: [] for scheme in SCHEMES}
    pair = 0
    for index in range(args.prompts):
        prompt = long_input_prompt(tokenizer, args.tokens, seed=index)
        for seed in range(args.seeds):
            order = list(arms) if pair % 2 == 0 else list(reversed(arms))
            pair += 1
            results = {
                name: _call(
                    arms[name][0],
                    reference_model,
                    prompt,
                    args.new_tokens,
                    arms[name][1],
                    params,
                    seed,
                )
                for name in order
            }
            for scheme in SCHEMES:
                plain_wall = results[f"plain {scheme}"]["wall_time_s"]
                ratios[scheme].append(plain_wall / results[f"default {scheme}"]["wall_time_s"])
            keyed = results["plain position-keyed"]["tokens"]
            for name in arms:
                result = results[name]
                row = {
                    "prompt": index,
                    "prompt_tokens": prompt.numel(),
                    "seed": seed,
                    "arm": name,
                    "temperature": args.T,
                    "top_p": args.top_p,
                    **{key: value for key, value in result.items() if key != "tokens"},
                    "new_tokens": len(result["tokens"]),
                }
                if name == "default position-keyed":
                    row["equals_plain_sampling"] = result["tokens"] == keyed
                print(json.dumps(row), flush=True)
                with args.output.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps({**row, **env, "command": command}) + "\n")
    summary = {
        "summary": True,
        **{
            f"speedup {scheme} (median plain/default)": statistics.median(ratios[scheme])
            for scheme in SCHEMES
        },
        **{f"speedups {scheme}": ratios[scheme] for scheme in SCHEMES},
    }
    print(json.dumps(summary), flush=True)
    with args.output.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({**summary, **env, "command": command}) + "\n")


def _call(
    decoder: SpeculativeDecoder | None,
    model: Any,
    prompt: torch.Tensor,
    new_tokens: int,
    scheme: str,
    params: Any,
    seed: int,
) -> dict[str, Any]:
    """One sampled call: its wall time, tokens, and (ours) the decode phase and drafts."""
    if decoder is None:
        ids = prompt.unsqueeze(0)
        sampling = params("position-keyed", seed)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=None,
        )
        wall = time.perf_counter() - start
        return {"wall_time_s": wall, "tokens": out[0, prompt.numel() :].tolist()}
    result = decoder.generate(prompt, max_new_tokens=new_tokens, sampling=params(scheme, seed))
    stats = result.stats
    return {
        "wall_time_s": stats.wall_time_s,
        "prefill_s": stats.prefill_time_s,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "rounds": stats.rounds,
        "tokens": result.tokens.tolist(),
    }


if __name__ == "__main__":
    main()
