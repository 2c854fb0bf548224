"""Conversations and cached prefixes: time to first token and turn time, warm vs cold.

Real SmolLM2-135M-Instruct, float32, greedy, the default decoder (or ``--planner``). Four
measurements, each warm/cold pair in one process, alternating which runs first:

* ``turn2``: turn 2 of a conversation whose turn 1 is a ~``--context``-token passage to
  summarise. Warm: ``conversation.send`` (the cache holds turn 1). Cold: ``generate`` on the
  whole conversation with the default (fused-attention) prefill, what a call without a
  conversation costs. Time to first token (``stats.prefill_time_s``), turn time, equality.
* ``shared_prefix``: two prompts that share the passage, different questions after it.
  Warm: a decoder with a prefix cache that has seen the first. Cold: one without (fused
  prefill, as above).
* ``prefill_cost``: one cold prefill of the passage with the chunk-invariant attention
  (what conversations and prefix caches run) and one with PyTorch's fused attention (the
  default for other calls), on the same engine: what exactness across chunkings costs.
* ``rss``: resident memory after each of ``--rss-turns`` short turns of one conversation,
  then after as many distinct prompts through a decoder with a ``--budget-mib`` prefix cache.

    python benchmarks/conversation.py [--context 2000] [--new-tokens 128] [--pairs 3]
        [--rss-turns 50] [--budget-mib 64] [--threads 2]

A 1-pair smoke run: ``--context 300 --new-tokens 8 --pairs 1 --rss-turns 3``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import passage
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer

SUMMARISE = "Summarise the following passage in a few sentences."
FOLLOW_UP = "Now list three names or places that appear in it, one per line."
QUESTIONS = ("Who is the main character of this passage?", "Where does this passage take place?")


def rss_mib() -> float:
    """Current resident set size in MiB (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


@contextlib.contextmanager
def fused_prefill(engine: Any) -> Iterator[None]:
    """The default prefill (PyTorch's fused attention) for a cold call on an engine that a
    conversation or prefix cache made chunk-invariant (the baseline a user without them
    gets)."""
    engine.chunk_invariant = False
    try:
        yield
    finally:
        engine.chunk_invariant = True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=2000, help="passage tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rss-turns", type=int, default=50)
    parser.add_argument("--budget-mib", type=float, default=64.0)
    parser.add_argument("--planner", default=None, help="planner name (default: the config's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/conversation/conversation.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    config: dict[str, Any] = {"planner": {"name": args.planner}} if args.planner else {}
    decoder = SpeculativeDecoder(model, config)
    cached = SpeculativeDecoder(decoder.engine, {**config, "prefix_cache_mib": 4096})
    env = {**environment(model, args.threads), **kernel_record(decoder.engine)}
    eos = tokenizer.eos_token_id
    text = passage(tokenizer, args.context, 0)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    lines: list[dict[str, Any]] = []

    def record(kind: str, **fields: Any) -> None:
        line = {"benchmark": kind, **fields, **env}
        lines.append(line)
        print(json.dumps({k: v for k, v in line.items() if k not in env}), flush=True)

    # ------------------------------------------------------------------ turn 2
    first_message = f"{SUMMARISE}\n\n{text}"
    for pair in range(args.pairs):
        conversation = decoder.conversation(tokenizer)
        conversation.send(first_message, max_new_tokens=args.new_tokens)  # turn 1, untimed
        prompt = template_ids(
            tokenizer, [*conversation.messages, {"role": "user", "content": FOLLOW_UP}]
        )
        runs: dict[str, Any] = {}
        for kind in ("warm", "cold") if pair % 2 == 0 else ("cold", "warm"):
            if kind == "warm":
                runs[kind] = conversation.send(FOLLOW_UP, max_new_tokens=args.new_tokens).result
            else:
                with fused_prefill(decoder.engine):
                    runs[kind] = decoder.generate(
                        prompt, max_new_tokens=args.new_tokens, eos_token_id=eos
                    )
        warm, cold = runs["warm"].stats, runs["cold"].stats
        record(
            "turn2",
            pair=pair,
            prompt_tokens=prompt.numel(),
            cached_prompt_tokens=warm.cached_prompt_tokens,
            ttft_warm_s=warm.prefill_time_s,
            ttft_cold_s=cold.prefill_time_s,
            turn_warm_s=warm.wall_time_s,
            turn_cold_s=cold.wall_time_s,
            new_tokens=[warm.new_tokens, cold.new_tokens],
            identical_tokens=bool(torch.equal(runs["warm"].tokens, runs["cold"].tokens)),
        )

    # ---------------------------------------------------------- shared prefix
    prompts = [
        template_ids(tokenizer, [{"role": "user", "content": f"{text}\n\n{question}"}])
        for question in QUESTIONS
    ]
    for pair in range(args.pairs):
        assert cached.prefix_cache is not None
        cached.prefix_cache.clear()
        cached.generate(prompts[0], max_new_tokens=8, eos_token_id=eos)  # seen once, untimed
        results: dict[str, Any] = {}
        for kind in ("warm", "cold") if pair % 2 == 0 else ("cold", "warm"):
            if kind == "warm":
                results[kind] = cached.generate(prompts[1], max_new_tokens=8, eos_token_id=eos)
            else:
                with fused_prefill(decoder.engine):
                    results[kind] = decoder.generate(prompts[1], max_new_tokens=8, eos_token_id=eos)
        record(
            "shared_prefix",
            pair=pair,
            prompt_tokens=prompts[1].numel(),
            cached_prompt_tokens=results["warm"].stats.cached_prompt_tokens,
            ttft_warm_s=results["warm"].stats.prefill_time_s,
            ttft_cold_s=results["cold"].stats.prefill_time_s,
            identical_tokens=bool(torch.equal(results["warm"].tokens, results["cold"].tokens)),
        )

    # ----------------------------------------------------------- prefill cost
    # One engine, its chunk-invariant attention switched off for the "fused" runs (a second
    # engine on the same model would re-fuse its weights and slow the first one down).
    engine = decoder.engine
    ids = prompts[0]
    timings: dict[str, list[float]] = {"invariant": [], "fused": []}
    try:
        for pair in range(args.pairs):
            for kind in ("invariant", "fused") if pair % 2 == 0 else ("fused", "invariant"):
                engine.chunk_invariant = kind == "invariant"
                cache = engine.new_cache(ids.numel())
                start = time.perf_counter()
                engine.forward(ids, 0, cache, all_logits=False)
                timings[kind].append(time.perf_counter() - start)
    finally:
        engine.chunk_invariant = True
    record(
        "prefill_cost",
        prompt_tokens=ids.numel(),
        invariant_s=statistics.median(timings["invariant"]),
        fused_s=statistics.median(timings["fused"]),
        ratio=statistics.median(timings["invariant"]) / statistics.median(timings["fused"]),
    )

    # ------------------------------------------------------------------- RSS
    conversation = decoder.conversation(tokenizer)
    memory = [rss_mib()]
    for turn in range(args.rss_turns):
        conversation.send(f"Tell me one short fact about the number {turn}.", max_new_tokens=32)
        memory.append(rss_mib())
    record(
        "rss_conversation",
        turns=args.rss_turns,
        conversation_tokens=conversation.tokens.numel(),
        kv_cache_mib=conversation.cache_bytes() / (1 << 20),
        rss_mib=memory,
    )
    budgeted = SpeculativeDecoder(decoder.engine, {**config, "prefix_cache_mib": args.budget_mib})
    memory = [rss_mib()]
    for turn in range(args.rss_turns):
        question = f"Question {turn}: what happens in the passage, in one line?"
        ids = template_ids(
            tokenizer, [{"role": "user", "content": f"{text[: 400 + 37 * turn]}\n\n{question}"}]
        )
        budgeted.generate(ids, max_new_tokens=16, eos_token_id=eos)
        memory.append(rss_mib())
    assert budgeted.prefix_cache is not None
    record(
        "rss_prefix_cache",
        calls=args.rss_turns,
        budget_mib=args.budget_mib,
        cache_mib=budgeted.prefix_cache.nbytes / (1 << 20),
        entries=len(budgeted.prefix_cache),
        evictions=budgeted.prefix_cache.stats.evictions,
        rss_mib=memory,
    )
    with args.output.open("a", encoding="utf-8") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
