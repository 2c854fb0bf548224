"""Token trees, chains and their hindsight oracles, replayed on recorded greedy outputs.

Greedy decoding's output is fixed whatever the drafts, so lookup drafting can be replayed
on token ids alone (as ``benchmarks/lookup_replay.py`` does for chain cuts): each round the
lookup drafter proposes from the prompt and the committed tokens, a policy picks what to
verify, the round accepts what greedy verification would (the deepest verified path that
equals the output) plus one token, and costs ``t_verify(verified + 1, n)``. Policies:

* ``chain``: the knapsack planner's TPT cut of the chain (``tree_nodes = 0``);
* ``tree``: the default, ``LookupPricing`` with trees on (32 nodes, the TPT-best subtree);
* ``chain-oracle``: in hindsight, exactly the chain's matching tokens, when that pays;
* ``tree-oracle``: in hindsight, the deepest matching path of the default 32-node tree;
* ``wide-oracle``: the same in a 63-node tree of 64 occurrences instead of 8 (the ceiling
  of broader candidates, issue #31's "every earlier occurrence").

Costs come from this machine's fitted cost model at ``--threads`` (default 2, the timed
runs' setting; ``--curve measured``) or from a
hypothetical cheap-width curve ``t_verify(k) = t_step·(1 + (k - 1)/30)`` (``--curve
wide``: 16 tokens for 1.5 steps, the figure issue #31 quotes for bf16 with AMX; not measured
here). The planner prices with the same curve it is charged. The result is decode-phase
speed over plain steps, planning and drafting time excluded (microseconds a round).

Outputs: ``results/drafters/replay_outputs.json`` (long-input, recorded by
``lookup_replay.py``) and a Spec-Bench run's ``model_answer/ar.jsonl`` (both turns; their
prompts rebuilt with the chat template).

    python benchmarks/tree_replay.py [--spec-bench results/bench/spec-bench-fp32]
        [--curve measured wide] [--threads 2] [--output results/drafters/tree_replay.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from knapspec.bench.env import environment
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.bench.specbench.runner import chat_ids
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters.base import LOOKUP, DraftRequest
from knapspec.drafters.lookup import LookupConfig, LookupDrafter
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners.lookup import MAX_TREE_NODES, LookupPricing
from knapspec.types import Draft, DraftTree

POLICIES = ("chain", "tree", "chain-oracle", "tree-oracle", "wide-oracle")
#: Verification-cost curves: this machine's fitted cost model, or a hypothetical per-token
#: slope over its one-token step (16 tokens for 1.5 steps: issue #31's AMX bf16 figure).
CURVE_SLOPES: dict[str, float | None] = {"measured": None, "wide": 1.0 / 30.0}


class CurveCost:
    """Duck-typed cost model: ``verify_cost``/``step_cost`` from a fitted model or from a
    hypothetical per-token slope over the fitted one-token step."""

    def __init__(self, fitted: Any, slope: float | None) -> None:
        self.fitted = fitted
        self.slope = slope

    def step_cost(self, n: int) -> float:
        return float(self.fitted.step_cost(n))

    def verify_cost(self, tokens: int, n: int) -> float:
        if self.slope is None:
            return float(self.fitted.verify_cost(tokens, n))
        return self.step_cost(n) * (1.0 + self.slope * (tokens - 1))


def deepest_match(tree: DraftTree, kept: set[int], expected: list[int]) -> int:
    """How many tokens greedy verification accepts: the deepest path of ``kept`` nodes whose
    tokens equal ``expected`` in order."""
    children: dict[int, dict[int, int]] = {}
    for node in kept:
        children.setdefault(tree.parents[node], {})[tree.tokens[node]] = node
    node, hits = -1, 0
    while hits < len(expected):
        nxt = children.get(node, {}).get(expected[hits])
        if nxt is None:
            break
        node, hits = nxt, hits + 1
    return hits


def full_tree(draft: Draft) -> DraftTree:
    """The proposal as a tree (a chain proposal is a tree without branches)."""
    if draft.tree is not None:
        return draft.tree
    size = len(draft.tokens)
    return DraftTree(draft.tokens, tuple(range(-1, size - 1)), (1.0,) * size, (0,) * size)


def replay(
    prompt: list[int], output: list[int], policy: str, cost: CurveCost, max_draft: int
) -> dict[str, float]:
    """Replay ``output`` (its first token comes from the prefill) under ``policy``.

    Returns the decode-phase speedup over plain steps, rounds, tokens per round, the draft
    nodes verified and accepted (``accepted + rounds == len(output) - 1``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
    default = LookupConfig()
    tree_nodes, candidates = default.tree_nodes, default.max_candidates
    if policy in ("chain", "chain-oracle"):
        tree_nodes = 0
    elif policy == "wide-oracle":
        tree_nodes, candidates = MAX_TREE_NODES, 64
    drafter = LookupDrafter(LookupConfig(tree_nodes=tree_nodes, max_candidates=candidates))
    drafter.reset(prompt + output[:1])
    pricing = LookupPricing()
    position, spent, plain, rounds, verified, accepted = 1, 0.0, 0.0, 0, 0, 0
    while position < len(output):
        n = len(prompt) + position
        room = min(max_draft, len(output) - position - 1)
        draft = drafter.propose(DraftRequest(room)) if room > 0 else None
        expected = output[position : position + room]
        nodes = 0
        hits = 0
        if draft is not None and draft.tokens:
            tree = full_tree(draft)
            if policy.endswith("oracle"):
                hits = deepest_match(tree, set(range(len(tree))), expected)
                # Drafting the matching path pays only if it beats plain steps.
                if hits and cost.verify_cost(hits + 1, n) < (hits + 1) * cost.step_cost(n):
                    nodes = hits
                else:
                    hits = 0
            else:
                context = SimpleNamespace(
                    proposal=lambda name, d=draft: d if name == LOOKUP else None,
                    context_length=n,
                    trees=policy == "tree",
                )
                option = pricing.price(context, cost, max_draft)  # type: ignore[arg-type]
                if option is not None and option.draft_length > 0:
                    if option.tree_nodes is None:
                        kept = set(tree.chain()[: option.draft_length])
                    else:
                        kept = set(option.tree_nodes)
                    nodes = len(kept)
                    hits = deepest_match(tree, kept, expected)
        committed = output[position : position + hits + 1]
        if not policy.endswith("oracle"):
            proposals = (draft,) if draft is not None and draft.tokens else ()
            pricing.observe(SimpleNamespace(proposals=proposals, committed_tokens=tuple(committed)))  # type: ignore[arg-type]
        drafter.extend(committed)
        for offset in range(len(committed)):
            plain += cost.step_cost(n + offset)
        spent += cost.verify_cost(nodes + 1, n)
        position += len(committed)
        rounds += 1
        verified += nodes
        accepted += hits
    return {
        "speedup": plain / spent,
        "rounds": rounds,
        "tokens_per_round": (len(output) - 1) / rounds,
        "verified_nodes": verified,
        "accepted": accepted,
    }


def long_input_records(path: Path) -> Iterator[dict[str, Any]]:
    for key, record in json.loads(path.read_text()).items():
        _, context, seed, _ = key.split("/")
        yield {
            "scenario": f"long-input-{context}",
            "item": f"seed{seed}",
            "prompt": record["prompt"],
            "output": record["output"],
        }


def spec_bench_records(run: Path, tokenizer: Any) -> Iterator[dict[str, Any]]:
    questions = {str(q.question_id): q for q in load_questions(packaged_questions())}
    with (run / "model_answer" / "ar.jsonl").open() as handle:
        for line in handle:
            answer = json.loads(line)
            question = questions[str(answer["question_id"])]
            extra = answer["knapspec"]
            outputs = extra["output_ids"]
            lengths = extra["prompt_tokens"]
            texts = answer["choices"][0]["turns"]
            messages: list[dict[str, str]] = []
            for turn, output in enumerate(outputs):
                messages.append({"role": "user", "content": question.turns[turn]})
                prompt = chat_ids(tokenizer, messages).tolist()
                if len(prompt) != lengths[turn]:
                    raise ValueError(
                        f"question {question.question_id} turn {turn}: rebuilt prompt has "
                        f"{len(prompt)} tokens, the run recorded {lengths[turn]}"
                    )
                messages.append({"role": "assistant", "content": texts[turn]})
                if len(output) > 1:
                    yield {
                        "scenario": f"spec-bench/{answer['category']}",
                        "item": f"q{question.question_id}t{turn + 1}",
                        "prompt": prompt,
                        "output": output,
                    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--long-input", type=Path, default=Path("results/drafters/replay_outputs.json")
    )
    parser.add_argument("--spec-bench", type=Path, default=None, help="a Spec-Bench run dir")
    parser.add_argument("--curve", nargs="+", default=["measured", "wide"], choices=CURVE_SLOPES)
    parser.add_argument("--max-draft", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=2, help="the cost model of this thread count"
    )
    parser.add_argument("--output", type=Path, default=Path("results/drafters/tree_replay.jsonl"))
    args = parser.parse_args()
    # Profiles are keyed by thread count: price rounds as the timed runs (2 threads) do.
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    fitted = SpeculativeDecoder(model).cost_model
    env = environment(model, args.threads)
    records = list(long_input_records(args.long_input))
    if args.spec_bench is not None:
        records += list(spec_bench_records(args.spec_bench, tokenizer))
    rows = []
    for curve in args.curve:
        cost = CurveCost(fitted, CURVE_SLOPES[curve])
        for record in records:
            for policy in POLICIES:
                result = replay(record["prompt"], record["output"], policy, cost, args.max_draft)
                rows.append(
                    {
                        "curve": curve,
                        "scenario": record["scenario"],
                        "item": record["item"],
                        "policy": policy,
                        **result,
                    }
                )
    write_rows(args.output, rows, env)
    summarise(rows)


def write_rows(path: Path, rows: list[dict[str, Any]], env: dict[str, Any]) -> None:
    """One JSON line per replayed output and policy, each with the environment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for row in rows:
            handle.write(json.dumps({**row, "env": env}) + "\n")


def summarise(rows: list[dict[str, Any]]) -> None:
    """Print, per curve and scenario group, the median speedup of each policy."""
    groups = sorted({(r["curve"], r["scenario"].split("/")[0]) for r in rows})
    for curve, group in groups:
        picked = [r for r in rows if r["curve"] == curve and r["scenario"].split("/")[0] == group]
        line = [f"{curve:8s} {group:16s} n={len(picked) // len(POLICIES):3d}"]
        for policy in POLICIES:
            values = [r["speedup"] for r in picked if r["policy"] == policy]
            line.append(f"{policy} {statistics.median(values):.3f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
