"""Static batches vs continuous batching over a queue of prompts, plain and speculative.

``Q`` long-input prompts (the bench's ``throughput`` prompts, ``N`` tokens each, 128 new
tokens a row, greedy) go through ``B`` slots in four ways, interleaved per pair round:

* ``ar-static`` / ``knapspec-static``: ``Q / B`` calls of ``B`` prompts each, one after the
  other (a call ends with its slowest row);
* ``ar-continuous`` / ``knapspec-continuous``: one ``generate_batch(..., max_batch_rows=B)``
  call (a finished row's slot goes to the next prompt at once).

``ar`` is plain batched decoding through our engine; ``knapspec`` the default decoder (lookup
and layer-skip drafts and γ = 0 under the batch TPT search). Every row is checked against
``ar-static``'s. Throughput is new tokens over all rows per second of wall time, prefill
included. Writes ``results/engine/continuous_batching.jsonl``: one line per call, with the
CPU and the engine's kernel table.

    python benchmarks/continuous_batching.py [--queue 12] [--batch-size 4] [--context 1024]
        [--pairs 2] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.scenarios import default_scenarios
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner

Rows = list[list[int]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--queue", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/engine/continuous_batching.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    scenario = next(s for s in default_scenarios() if s.name == "throughput")
    prompts = [p.input_ids for p in scenario.prompts(tokenizer, args.context, args.queue)]
    eos = [int(tokenizer.eos_token_id)]
    decoders = {
        "ar": SpeculativeDecoder(model, planner=AutoregressivePlanner()),
        "knapspec": SpeculativeDecoder(model),
    }
    env = {**environment(model, args.threads), **kernel_record(decoders["knapspec"].engine)}
    size = args.batch_size

    def static(decoder: SpeculativeDecoder) -> Rows:
        rows: Rows = []
        for first in range(0, len(prompts), size):
            chunk = prompts[first : first + size]
            result = decoder.generate_batch(chunk, max_new_tokens=args.new_tokens, eos_token_id=eos)
            rows.extend(tokens.tolist() for tokens in result.tokens)
        return rows

    def continuous(decoder: SpeculativeDecoder) -> Rows:
        result = decoder.generate_batch(
            prompts, max_new_tokens=args.new_tokens, eos_token_id=eos, max_batch_rows=size
        )
        return [tokens.tolist() for tokens in result.tokens]

    methods: dict[str, Callable[[], Rows]] = {
        f"{name}-{mode}": (lambda d=decoder, f=fn: f(d))
        for name, decoder in decoders.items()
        for mode, fn in (("static", static), ("continuous", continuous))
    }
    for decoder in decoders.values():  # warm-up: first-call costs, profiles, kernel tables
        decoder.generate_batch(
            [p[:256] for p in prompts[: size + 1]], max_new_tokens=8, max_batch_rows=size
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    reference: Rows | None = None
    with args.output.open("a", encoding="utf-8") as out:
        for pair in range(args.pairs):
            order = list(methods) if pair % 2 == 0 else list(reversed(methods))
            for name in order:
                start = time.perf_counter()
                rows = methods[name]()
                elapsed = time.perf_counter() - start
                if name == "ar-static" and reference is None:
                    reference = rows
                seconds[name].append(elapsed)
                identical = rows == (reference or rows)
                if not identical:
                    print(f"pair {pair} {name}: rows differ from ar-static's", flush=True)
                record = {
                    "method": name,
                    "pair": pair,
                    "queue": args.queue,
                    "batch_size": size,
                    "context": args.context,
                    "new_tokens": sum(len(r) for r in rows),
                    "seconds": elapsed,
                    "identical_to_ar_static": identical,
                    "rows": rows,
                    "environment": env,
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                print(f"pair {pair} {name}: {elapsed:.2f} s", flush=True)
    assert reference is not None
    tokens = sum(len(r) for r in reference)
    print(f"\n{env['device']}, {args.queue} prompts x {args.context} tokens, B = {size}")
    base = statistics.median(seconds["ar-static"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(
            f"{name:22s} {median:7.2f} s  {tokens / median:6.1f} tokens/s  "
            f"{base / median:.2f}x ar-static"
        )


if __name__ == "__main__":
    main()
