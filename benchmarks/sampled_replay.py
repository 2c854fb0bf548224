"""Lookup chains, trees and their hindsight oracles on *sampled* outputs, and the wall-time
ceiling they put on issue #31's sampling goal.

Position-keyed sampling (the default) draws the token at absolute position ``t`` as
``argmax(s_t + G_t)`` with noise fixed by the seed and ``t`` (``docs/theory.md``), so a
sampled call's output is plain sampling's whatever was drafted, and a draft token is
accepted exactly when it equals the output's token at its position: lookup drafting can be
replayed on token ids alone, as ``benchmarks/tree_replay.py`` does for greedy outputs
(same policies, same cost model, decode phase only, planning excluded).

The script first records plain position-keyed sampled calls on the long-input prompts
(``--contexts``, ``--prompts`` documents, ``--seeds`` seeds each; T = 0.7, top-p 0.9, the
``sampling`` scenario's settings), timing each call's prefill and decode phase, then
replays every policy on each output. A policy's decode-phase speed ``s`` bounds the wall
speed-up over plain sampling of the same call by ``(P + D) / (P + D / s)`` (``P``, ``D``:
the plain call's measured prefill and decode seconds): no drafter shortens the prefill.

``--curve wide`` also prices every round with the hypothetical cheap-width curve of
``tree_replay.py`` (16 tokens for 1.5 steps); its wall bound still uses this machine's
prefill, so it shows what cheap width alone would give.

    python benchmarks/sampled_replay.py [--contexts 2048 4096] [--prompts 4] [--seeds 3]
        [--new-tokens 128] [--curve measured wide]
        [--outputs results/drafters/sampled_outputs.json]
        [--output results/drafters/sampled_replay.jsonl]

``--outputs`` is reused when it exists (delete it to record again); it stores token ids
and timings, the prompts are rebuilt from ``(context, document)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from knapspec import SamplingParams, SpeculativeDecoder, StaticPlanner, SublayerMask
from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.loading.provision import load_model_and_tokenizer

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.tree_replay import CURVE_SLOPES, POLICIES, CurveCost, replay, write_rows


def wall_bound(prefill_s: float, decode_s: float, decode_speedup: float) -> float:
    """The wall-time speed-up of a call whose decode phase runs ``decode_speedup`` times
    faster and whose prefill is unchanged: ``(P + D) / (P + D / s)``."""
    if prefill_s < 0 or decode_s <= 0 or decode_speedup <= 0:
        raise ValueError(
            f"need prefill >= 0, decode > 0 and speed-up > 0 seconds, got {prefill_s}, "
            f"{decode_s}, {decode_speedup}"
        )
    return (prefill_s + decode_s) / (prefill_s + decode_s / decode_speedup)


def record_outputs(args: argparse.Namespace, model: Any, tokenizer: Any) -> dict[str, Any]:
    """Plain position-keyed sampled calls: token ids, prompt length, prefill and decode s."""
    layers = model.config.num_hidden_layers
    plain = SpeculativeDecoder(model, planner=StaticPlanner(SublayerMask.full(layers), 0))
    warm = long_input_prompt(tokenizer, 128, seed=99)
    plain.generate(warm, max_new_tokens=8)
    records: dict[str, Any] = {}
    for context in args.contexts:
        for document in range(args.prompts):
            prompt = long_input_prompt(tokenizer, context, seed=document)
            for seed in range(args.seeds):
                sampling = SamplingParams(
                    do_sample=True, temperature=args.T, top_p=args.top_p, seed=seed
                )
                result = plain.generate(prompt, max_new_tokens=args.new_tokens, sampling=sampling)
                stats = result.stats
                key = f"long-input/{context}/{document}/{seed}"
                records[key] = {
                    "prompt_tokens": prompt.numel(),
                    "output": result.tokens.tolist(),
                    "prefill_s": stats.prefill_time_s,
                    "decode_s": stats.wall_time_s - stats.prefill_time_s,
                }
                print(key, f"{stats.wall_time_s:.1f} s", flush=True)
    return records


def recording_settings(stored: dict[str, Any]) -> dict[str, Any]:
    """What a stored recording holds: contexts, documents, seeds, new tokens, T, top-p."""
    keys = [key.split("/") for key in stored["records"]]
    lengths = {len(record["output"]) for record in stored["records"].values()}
    return {
        "contexts": sorted({int(k[1]) for k in keys}),
        "prompts": len({k[2] for k in keys}),
        "seeds": len({k[3] for k in keys}),
        "new_tokens": max(lengths) if lengths else 0,
        "T": stored["temperature"],
        "top_p": stored["top_p"],
    }


def check_recording(stored: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    """Refuse to replay a recording made with other settings than the command asks for
    (it would silently answer another question)."""
    held = recording_settings(stored)
    asked = {
        "contexts": sorted(set(args.contexts)),
        "prompts": args.prompts,
        "seeds": args.seeds,
        "new_tokens": args.new_tokens,
        "T": args.T,
        "top_p": args.top_p,
    }
    differ = {name: (held[name], asked[name]) for name in asked if held[name] != asked[name]}
    if differ:
        listed = ", ".join(f"{name} {h} (asked {a})" for name, (h, a) in differ.items())
        raise ValueError(
            f"{path} was recorded with other settings: {listed}; delete it or pass "
            "--outputs with a new path to record again"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--T", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-draft", type=int, default=10)
    parser.add_argument("--curve", nargs="+", default=["measured", "wide"], choices=CURVE_SLOPES)
    parser.add_argument(
        "--outputs", type=Path, default=Path("results/drafters/sampled_outputs.json")
    )
    parser.add_argument(
        "--output", type=Path, default=Path("results/drafters/sampled_replay.jsonl")
    )
    args = parser.parse_args()
    stored: dict[str, Any] | None = None
    if args.outputs.exists():  # checked before the model loads: a mismatch fails at once
        stored = json.loads(args.outputs.read_text())
        try:
            check_recording(stored, args, args.outputs)
        except ValueError as error:
            parser.error(str(error))
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    env = environment(model, args.threads)
    if stored is None:
        stored = {
            "command": "python " + " ".join(sys.argv),
            "temperature": args.T,
            "top_p": args.top_p,
            "env": env,
            "records": record_outputs(args, model, tokenizer),
        }
        args.outputs.parent.mkdir(parents=True, exist_ok=True)
        args.outputs.write_text(json.dumps(stored))
    # Rounds are priced by the cost model the timed runs use: this machine's profile at
    # --threads (profiles are keyed by thread count).
    fitted = SpeculativeDecoder(model).cost_model
    rows = []
    prompts: dict[tuple[int, int], list[int]] = {}
    for key, record in stored["records"].items():
        _, context, document, seed = key.split("/")
        ids = (int(context), int(document))
        if ids not in prompts:
            prompts[ids] = long_input_prompt(tokenizer, ids[0], seed=ids[1]).tolist()
        prompt = prompts[ids]
        if len(prompt) != record["prompt_tokens"]:
            raise ValueError(
                f"{key}: rebuilt prompt has {len(prompt)} tokens, the recording had "
                f"{record['prompt_tokens']}"
            )
        for curve, policy in itertools.product(args.curve, POLICIES):
            cost = CurveCost(fitted, CURVE_SLOPES[curve])
            result = replay(prompt, record["output"], policy, cost, args.max_draft)
            bound = wall_bound(record["prefill_s"], record["decode_s"], result["speedup"])
            rows.append(
                {
                    "curve": curve,
                    "scenario": f"long-input-{context} T={stored['temperature']}",
                    "item": f"doc{document}-seed{seed}",
                    "policy": policy,
                    **result,
                    "prefill_share": record["prefill_s"]
                    / (record["prefill_s"] + record["decode_s"]),
                    "wall_bound": bound,
                }
            )
    write_rows(args.output, rows, env)
    summarise(rows)


def summarise(rows: list[dict[str, Any]]) -> None:
    """Per curve, scenario and policy: median decode-phase speed and wall-time bound (the
    bound uses this machine's prefill, so under the ``wide`` curve it is indicative only)."""
    for curve, scenario in sorted({(r["curve"], r["scenario"]) for r in rows}):
        picked = [r for r in rows if r["scenario"] == scenario and r["curve"] == curve]
        share = statistics.median(r["prefill_share"] for r in picked)
        outputs = len(picked) // len(POLICIES)
        print(f"{curve} {scenario}: {outputs} outputs, prefill share {share:.2f}")
        for policy in POLICIES:
            mine = [r for r in picked if r["policy"] == policy]
            decode = statistics.median(r["speedup"] for r in mine)
            bound = statistics.median(r["wall_bound"] for r in mine)
            accepted = sum(r["accepted"] for r in mine)
            verified = sum(r["verified_nodes"] for r in mine)
            print(
                f"  {policy:13s} decode {decode:.3f}  wall bound {bound:.3f}  "
                f"accepted {accepted} of {verified} verified"
            )


if __name__ == "__main__":
    main()
