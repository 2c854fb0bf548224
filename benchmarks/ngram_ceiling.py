"""How far can any pricing of knapspec's lookup drafts lead vLLM's n-gram method at one client?

Issue #48 asks the knapspec proposer inside ``vllm serve`` for 1.15x vLLM's n-gram method
(k = 5) at one client. At one client vLLM's step costs about the same for 1 to 6 tokens on
the CPUs measured (results/serve/HISTORY.md, "What vLLM's step cost"), so a method's decode speed is
its **tokens per verification round**, and the most any pricing can add to a proposer is
to draft exactly the accepted part of each proposal, every round: the same rounds as
drafting the whole proposal, at the narrowest width. That ceiling is computed here exactly,
on token ids alone, by replaying rounds over recorded greedy answers:

* the answers are knapspec's own greedy decoding (bf16 engine), which vLLM's equal except
  where its verification rounds a near-tie otherwise (counted in results/serve/HISTORY.md);
* ``ngram-k`` is vLLM 0.32's n-gram rule (``vllm/v1/spec_decode/ngram_proposer.py``): the
  longest suffix n-gram of the context, ``prompt_lookup_min`` <= n <= ``prompt_lookup_max``,
  found earlier in it, its *earliest* occurrence, the next k tokens;
* ``knapspec-cap`` is the proposer's lookup (:class:`~knapspec.drafters.LookupIndex`: the
  longest suffix match, a weighted vote of its recent occurrences), up to ``cap`` tokens;
  ``+history`` also looks up in the earlier requests' prompts and answers (in the order
  the benchmark sends them), as ``KNAPSPEC_VLLM_HISTORY_TOKENS`` does.

A round drafts the proposal, accepts its leading tokens that equal the answer and commits
one more. Reported per set and method: tokens per round (its decode speedup over plain
decoding at a flat step cost) and its ratio to ``ngram-5``.

    python benchmarks/ngram_ceiling.py [--per-category 2] [--copy-seeds 2] [--cap 16]

Writes ``results/vllm/ngram_ceiling.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from knapspec.bench.env import environment
from knapspec.bench.records import append_jsonl
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters import LookupIndex
from knapspec.model.loading.provision import default_model_path, load_model_and_tokenizer

if __package__ in (None, ""):  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vllm_proposer import prompt_sets

#: ``propose(context) -> draft tokens``; one per request (it may keep state).
Proposer = Callable[[list[int]], list[int]]


def ngram_proposal(
    context: Sequence[int], k: int, min_ngram: int = 1, max_ngram: int = 4
) -> list[int]:
    """vLLM's n-gram rule: the next ``k`` tokens after the earliest occurrence of the
    longest suffix n-gram (``min_ngram <= n <= max_ngram``) found earlier in ``context``."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        for start in range(length - n):
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + k])
    return []


def replay(prompt: list[int], answer: list[int], propose: Proposer) -> tuple[int, int, int]:
    """Rounds over ``answer``: ``(rounds, drafted, accepted)``."""
    context = list(prompt)
    position = rounds = drafted = accepted = 0
    while position < len(answer):
        draft = propose(context)
        hits = 0
        while (
            hits < len(draft)
            and position + hits < len(answer) - 1
            and draft[hits] == answer[position + hits]
        ):
            hits += 1
        context.extend(answer[position : position + hits + 1])
        position += hits + 1
        rounds, drafted, accepted = rounds + 1, drafted + len(draft), accepted + hits
    return rounds, drafted, accepted


def lookup_proposers(
    cap: int, history_tokens: int
) -> Callable[[list[int]], tuple[Proposer, Callable[[list[int]], None]]]:
    """Per request, knapspec's lookup proposer and what to do when the request ends."""
    history: list[LookupIndex] = []

    def start(prompt: list[int]) -> tuple[Proposer, Callable[[list[int]], None]]:
        index = LookupIndex(4)

        def propose(context: list[int]) -> list[int]:
            index.extend(context[len(index) :])
            tokens, _support, _match = index.propose(cap, history=history)
            return tokens

        def finish(sequence: list[int]) -> None:
            if history_tokens <= 0:
                return
            index.extend(sequence[len(index) :])
            history.append(index)
            while sum(len(h) for h in history) > history_tokens:
                history.pop(0)

        return propose, finish

    return start


def method_starts(
    cap: int,
) -> dict[str, Callable[[], Callable[[list[int]], tuple[Proposer, Callable[..., None]]]]]:
    """Per method, a factory of its per-request proposers (fresh history per set)."""

    def ngram(k: int) -> Callable[[list[int]], tuple[Proposer, Callable[..., None]]]:
        return lambda prompt: (lambda context: ngram_proposal(context, k), lambda s: None)

    return {
        "ngram-3": lambda: ngram(3),
        "ngram-5": lambda: ngram(5),
        f"knapspec-{cap}": lambda: lookup_proposers(cap, 0),
        f"knapspec-{cap}+history": lambda: lookup_proposers(cap, 16384),
    }


def record_answers(
    decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    return [
        decoder.generate(prompt, max_new_tokens=max_new_tokens).tokens.tolist()
        for prompt in prompts
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--copy-seeds", type=int, default=2)
    parser.add_argument("--passage-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cap", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/vllm/ngram_ceiling.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _tokenizer = load_model_and_tokenizer(dtype=torch.bfloat16)
    decoder = SpeculativeDecoder(model)
    # The sets benchmarks/vllm_proposer.py sends, in its order.
    sets = prompt_sets(str(default_model_path()), args)
    specbench = [ids for _name, ids in sets["specbench"]]
    copy = [ids for _name, ids in sets["copy"]]
    env = environment(model, args.threads)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for set_name, prompts in (("specbench", specbench), ("copy", copy)):
        answers = record_answers(decoder, prompts, args.max_tokens)
        results: dict[str, dict[str, Any]] = {}
        for method, factory in method_starts(args.cap).items():
            start = factory()
            rounds = drafted = accepted = tokens = 0
            for prompt, answer in zip(prompts, answers, strict=True):
                propose, finish = start(prompt)
                r, d, a = replay(prompt, answer, propose)
                finish(prompt + answer)
                rounds, drafted, accepted, tokens = (
                    rounds + r,
                    drafted + d,
                    accepted + a,
                    tokens + len(answer),
                )
            results[method] = {
                "rounds": rounds,
                "drafted": drafted,
                "accepted": accepted,
                "tokens": tokens,
                "tokens_per_round": tokens / rounds,
            }
        base = results["ngram-5"]["tokens_per_round"]
        for method, result in results.items():
            line = {
                **env,
                "set": set_name,
                "requests": len(prompts),
                "method": method,
                **result,
                "over_ngram5": result["tokens_per_round"] / base,
            }
            append_jsonl(args.output, json.dumps(line))
            print(
                f"{set_name:9s} {method:22s} {result['tokens_per_round']:.3f} tokens/round "
                f"({line['over_ngram5']:.3f}x n-gram k=5), accepted {result['accepted']} of "
                f"{result['drafted']} drafted",
                flush=True,
            )


if __name__ == "__main__":
    main()
