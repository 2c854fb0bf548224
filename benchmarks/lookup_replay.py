"""Replay lookup drafting on recorded greedy outputs: how each cut policy would do, decode only.

Greedy decoding is deterministic, so the target's output for a prompt is fixed whatever the
drafts. This study records it once per prompt (plain decoding through the engine), then
replays rounds on token ids alone: the lookup drafter proposes from prompt + committed
tokens, a policy cuts the proposal at γ, the round accepts the proposal's leading tokens that
equal the output and commits one more, and costs ``v(γ + 1)`` plain steps, the machine's
verify curve from the cost model. The ratio is plain steps over replayed cost (prefill and
planning excluded), so policies (fixed k, the knapsack planner's TPT cut under the online
acceptance estimate, the hindsight oracle) compare exactly on the same outputs in seconds.

    python benchmarks/lookup_replay.py [--contexts 2048 4096] [--seeds 0 1 2] [--copy]

Writes ``results/drafters/lookup_replay.jsonl`` (one line per prompt and policy) and caches
the recorded outputs in ``results/drafters/replay_outputs.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters.acceptance import LookupAcceptance
from knapspec.drafters.base import DraftRequest
from knapspec.drafters.lookup import LookupDrafter
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner
from knapspec.planners.objective import best_chained_length

#: A policy maps (proposal tokens, match length, verify costs) to γ; it may learn from
#: ``observe(proposal, match_length, committed)`` after each round.
Policy = Any


class FixedLength:
    """Draft min(k, proposal) tokens whenever there is a proposal (transformers' rule)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def cut(self, proposal: tuple[int, ...], match: int, verify: np.ndarray) -> int:
        return min(self.k, len(proposal))

    def observe(self, proposal: tuple[int, ...], match: int, committed: list[int]) -> None:
        pass


class TptCut:
    """The knapsack planner's rule: the TPT-optimal cut under :class:`LookupAcceptance`."""

    def __init__(self) -> None:
        self.acceptance = LookupAcceptance()

    def cut(self, proposal: tuple[int, ...], match: int, verify: np.ndarray) -> int:
        if not proposal:
            return 0
        rates = self.acceptance.conditional(self.acceptance.bucket(match), len(proposal))
        gamma, _ = best_chained_length(rates, verify[: len(proposal) + 1])
        return gamma

    def observe(self, proposal: tuple[int, ...], match: int, committed: list[int]) -> None:
        self.acceptance.observe_round(proposal, match, committed)


def replay(
    prompt: list[int], output: list[int], policy: Policy, verify: np.ndarray, max_draft: int
) -> dict[str, float]:
    """Replay ``output`` (its first token comes from the prefill) under ``policy``."""
    drafter = LookupDrafter()
    drafter.reset(prompt + output[:1])
    position, cost, rounds, drafted, accepted = 1, 0.0, 0, 0, 0
    while position < len(output):
        room = min(max_draft, len(output) - position - 1)
        proposal = drafter.propose(DraftRequest(room)) if room > 0 else None
        tokens = proposal.tokens if proposal is not None else ()
        match = proposal.match_length if proposal is not None else 0
        gamma = policy.cut(tokens, match, verify) if tokens else 0
        hits = 0
        while hits < gamma and tokens[hits] == output[position + hits]:
            hits += 1
        committed = output[position : position + hits + 1]
        policy.observe(tokens, match, committed)
        drafter.extend(committed)
        position += len(committed)
        cost += float(verify[gamma])
        rounds += 1
        drafted += gamma
        accepted += hits
    steps = len(output) - 1
    return {
        "speedup": steps / cost,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
    }


def oracle(prompt: list[int], output: list[int], verify: np.ndarray, max_draft: int) -> float:
    """Best replay in hindsight: every round drafts exactly the proposal's matching tokens."""
    drafter = LookupDrafter()
    drafter.reset(prompt + output[:1])
    position, cost = 1, 0.0
    while position < len(output):
        room = min(max_draft, len(output) - position - 1)
        tokens = drafter.propose(DraftRequest(room)).tokens if room > 0 else ()
        hits = 0
        while hits < len(tokens) and tokens[hits] == output[position + hits]:
            hits += 1
        # Drafting the hits pays only if it beats plain steps over the same tokens.
        gamma = hits if hits and verify[hits] < hits + 1 else 0
        committed = output[position : position + gamma + 1]
        drafter.extend(committed)
        position += len(committed)
        cost += float(verify[gamma])
    return (len(output) - 1) / cost


def record_outputs(
    contexts: list[int], seeds: list[int], new_tokens: int, cache: Path
) -> tuple[list[dict[str, Any]], np.ndarray, dict[str, Any]]:
    model, tokenizer = load_model_and_tokenizer()
    decoder = SpeculativeDecoder(model, planner=AutoregressivePlanner())
    knapspec = SpeculativeDecoder(model)  # its cost model gives this machine's v(k)
    known = json.loads(cache.read_text()) if cache.exists() else {}
    records = []
    for context in contexts:
        for seed in seeds:
            key = f"long-input/{context}/{seed}/{new_tokens}"
            if key not in known:
                prompt = long_input_prompt(tokenizer, context, seed=seed)
                out = decoder.generate(prompt, max_new_tokens=new_tokens)
                known[key] = {"prompt": prompt.tolist(), "output": out.tokens.tolist()}
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(known))  # a long recording survives a stop
            records.append({"key": key, "context": context, "seed": seed, **known[key]})
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(known))
    cost_model = knapspec.cost_model
    curves = {}
    for context in contexts:
        n = context + 64
        step = cost_model.step_cost(n)
        curves[context] = np.array([cost_model.verify_cost(k, n) / step for k in range(1, 18)])
    return records, curves, environment(model, torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-draft", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/drafters/lookup_replay.jsonl"))
    parser.add_argument("--cache", type=Path, default=Path("results/drafters/replay_outputs.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records, curves, env = record_outputs(args.contexts, args.seeds, args.new_tokens, args.cache)
    policies: dict[str, Callable[[], Policy]] = {
        "knapspec-tpt": TptCut,
        **{f"lookup-k{k}": (lambda k=k: FixedLength(k)) for k in (1, 2, 3, 5, 10)},
    }
    rows = []
    for record in records:
        verify = curves[record["context"]]
        where = {"context": record["context"], "seed": record["seed"]}
        for name, make in policies.items():
            result = replay(record["prompt"], record["output"], make(), verify, args.max_draft)
            rows.append({**where, "policy": name, **result})
        best = oracle(record["prompt"], record["output"], verify, args.max_draft)
        rows.append({**where, "policy": "oracle", "speedup": best})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "env": env}) + "\n")
    for context in args.contexts:
        print(f"context {context}: v(k) = {np.round(curves[context][:11], 2).tolist()}")
        for name in [*policies, "oracle"]:
            values = [r["speedup"] for r in rows if r["context"] == context and r["policy"] == name]
            print(
                f"  {name:14s} decode-only speedup median {statistics.median(values):.3f} "
                f"(per prompt {', '.join(f'{v:.2f}' for v in values)})"
            )


if __name__ == "__main__":
    main()
