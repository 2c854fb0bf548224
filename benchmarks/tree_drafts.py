"""Token trees against chains: the default decoder with and without lookup trees.

Two decoders share one engine: ``tree`` (the default, ``drafters.lookup.tree_nodes`` = 32)
and ``chain`` (``tree_nodes = 0``); for sampled prompts a plain decoder
(``planner = autoregressive``) runs too. Per prompt the arms run back to back, their order
alternating, after a warm-up; greedy and position-keyed sampled outputs must be identical
across arms (both are plain decoding's tokens). Prompts:

* ``long-input``: the chat template, "summarise" and ``--contexts`` tokens of a novel;
* ``spec-bench``: the first turn of ``--questions`` Spec-Bench dev questions, one per
  category in turn.

Each prompt runs greedy; the long-input prompts also at T = ``--temperature`` (top-p 0.9,
position-keyed, seed = the prompt's index). No stop token on long-input (SmolLM2 ends
some summaries at once); the chat's EOS on Spec-Bench, as the suite does.

    python benchmarks/tree_drafts.py [--contexts 2048 4096] [--documents 2]
        [--questions 13] [--new-tokens 128] [--threads 2] [--repeats 1]

Every call is one JSON line in ``--output`` (wall, prefill, decode phase, rounds, tree
rounds, accepted tokens, per-node counts); a summary line per scenario ends the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from knapspec import SpeculativeDecoder
from knapspec.bench.env import environment
from knapspec.bench.prompts import SUMMARISE, chat_prompt, passage
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.model.loading.provision import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--questions", type=int, default=13)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--output", type=Path, default=Path("results/drafters/trees.jsonl"))
    parser.add_argument(
        "--plot", type=Path, default=None, help="only plot acceptance per node of --output"
    )
    args = parser.parse_args()
    if args.plot is not None:
        plot_node_acceptance(args.output, args.plot)
        return
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    tree = SpeculativeDecoder(model)
    chain = SpeculativeDecoder(tree.engine, {"drafters": {"lookup": {"tree_nodes": 0}}})
    plain = SpeculativeDecoder(tree.engine, {"planner": {"name": "autoregressive"}})
    env = environment(model, args.threads)
    command = "python " + " ".join(sys.argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    warm = chat_prompt(tokenizer, SUMMARISE, passage(tokenizer, 128, seed=99))
    for decoder in (tree, chain, plain):
        decoder.generate(warm, max_new_tokens=16)

    prompts: list[tuple[str, str, torch.Tensor, int | None]] = []
    for context in args.contexts:
        for index in range(args.documents):
            text = chat_prompt(tokenizer, SUMMARISE, passage(tokenizer, context, seed=index))
            prompts.append((f"long-input-{context}", f"doc{index}", text, None))
    by_category: dict[str, list[Any]] = {}
    for question in load_questions(packaged_questions()):
        by_category.setdefault(question.category, []).append(question)
    categories = sorted(by_category)
    for index in range(args.questions):
        question = by_category[categories[index % len(categories)]][index // len(categories)]
        text = chat_prompt(tokenizer, question.turns[0], "")
        eos = tokenizer.eos_token_id
        prompts.append(("spec-bench", f"{question.category}-{question.question_id}", text, eos))

    summary: dict[str, dict[str, list[float]]] = {}
    with args.output.open("a") as sink:
        runs = [
            (repeat, index, prompt)
            for repeat in range(args.repeats)
            for index, prompt in enumerate(prompts)
        ]
        for repeat, index, (scenario, name, prompt, eos) in runs:
            modes: list[dict[str, Any]] = [{}]
            if scenario.startswith("long-input"):
                modes.append(
                    {
                        "do_sample": True,
                        "temperature": args.temperature,
                        "top_p": 0.9,
                        "seed": index,
                    }
                )
            for sampling in modes:
                arms = [("tree", tree), ("chain", chain)]
                if sampling:
                    arms.append(("plain", plain))
                if (index + repeat) % 2:
                    arms.reverse()  # alternate who goes first, per prompt and per pass
                rows = {
                    arm: _call(decoder, prompt, args.new_tokens, eos, sampling or None)
                    for arm, decoder in arms
                }
                reference = rows["chain"]["tokens"]
                same = all(row["tokens"] == reference for row in rows.values())
                label = scenario + (f" T={args.temperature}" if sampling else " greedy")
                for arm, row in rows.items():
                    tokens = row.pop("tokens")
                    record = {
                        "scenario": label,
                        "prompt": name,
                        "repeat": repeat,
                        "arm": arm,
                        "identical": same,
                        "new_tokens": len(tokens),
                        **row,
                        "env": env,
                        "command": command,
                    }
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()
                ratio = rows["chain"]["decode_s"] / max(rows["tree"]["decode_s"], 1e-9)
                wall = rows["chain"]["wall_s"] / max(rows["tree"]["wall_s"], 1e-9)
                entry = summary.setdefault(label, {"decode": [], "wall": [], "vs_plain": []})
                entry["decode"].append(ratio)
                entry["wall"].append(wall)
                if "plain" in rows:
                    entry["vs_plain"].append(rows["plain"]["wall_s"] / rows["tree"]["wall_s"])
                print(
                    f"{label} {name}: tree/chain decode {ratio:.2f}x wall {wall:.2f}x "
                    f"tree rounds {rows['tree']['tree_rounds']} identical {same}",
                    flush=True,
                )
        for label, entry in summary.items():
            line = {
                "summary": label,
                "tree_vs_chain_decode_median": statistics.median(entry["decode"]),
                "tree_vs_chain_decode_range": [min(entry["decode"]), max(entry["decode"])],
                "tree_vs_chain_wall_median": statistics.median(entry["wall"]),
                "tree_vs_plain_wall_median": (
                    statistics.median(entry["vs_plain"]) if entry["vs_plain"] else None
                ),
                "prompts": len(entry["decode"]),
                "env": env,
                "command": command,
            }
            sink.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)


def _call(
    decoder: SpeculativeDecoder,
    prompt: torch.Tensor,
    new_tokens: int,
    eos: int | None,
    sampling: dict[str, Any] | None,
) -> dict[str, Any]:
    result = decoder.generate(
        prompt, max_new_tokens=new_tokens, eos_token_id=eos, sampling=sampling
    )
    stats = result.stats
    return {
        "tokens": result.tokens.tolist(),
        "wall_s": stats.wall_time_s,
        "prefill_s": stats.prefill_time_s,
        "decode_s": stats.wall_time_s - stats.prefill_time_s,
        "prompt_tokens": stats.prompt_tokens,
        "rounds": stats.rounds,
        "tree_rounds": stats.tree_rounds,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "mean_accepted_length": stats.mean_accepted_length,
        "tree_nodes": [
            [depth, rank, *counts] for (depth, rank), counts in sorted(stats.tree_nodes.items())
        ],
    }


def plot_node_acceptance(results: Path, figure: Path) -> None:
    """Acceptance of tree nodes by depth and sibling rank over the tree arm's rounds, with
    the verified count on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts: dict[tuple[int, int], list[int]] = {}
    for line in results.read_text().splitlines():
        record = json.loads(line)
        if record.get("arm") != "tree":
            continue
        for depth, rank, verified, accepted in record["tree_nodes"]:
            cell = counts.setdefault((depth, rank), [0, 0])
            cell[0] += verified
            cell[1] += accepted
    depths = sorted({depth for depth, _ in counts})[:6]
    ranks = sorted({rank for _, rank in counts})[:4]
    width = 0.8 / len(ranks)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, rank in enumerate(ranks):
        xs, ys, ns = [], [], []
        for depth in depths:
            verified, accepted = counts.get((depth, rank), [0, 0])
            if verified:
                xs.append(depth + (k - (len(ranks) - 1) / 2) * width)
                ys.append(accepted / verified)
                ns.append(verified)
        bars = ax.bar(xs, ys, width, label=f"rank {rank}" + (" (heaviest)" if rank == 0 else ""))
        for bar, n in zip(bars, ns, strict=True):
            ax.annotate(
                str(n),
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xlabel("depth (draft position)")
    ax.set_ylabel("accepted / verified")
    ax.set_title("Lookup tree nodes: acceptance by depth and sibling rank (count on bars)")
    ax.set_xticks(depths)
    ax.legend(fontsize=8)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    print(f"wrote {figure}")


if __name__ == "__main__":
    main()
