"""Soak: an hour of mixed calls on one long-lived decoder, the way a server would use it.

One default :class:`~knapspec.SpeculativeDecoder` on the real SmolLM2-135M takes call after
call, drawn at random (seeded) from a mix: greedy single prompts of 64 to 1024 tokens (long
input, copying, quoting), sampled ones (T = 0.7, top-p 0.9), greedy batches of 2 to 4 rows,
and continuous batches (``max_batch_rows=2``). The run fails when

* a greedy output differs from plain decoding (the ``autoregressive`` planner, computed once
  per prompt and length and kept);
* a call raises anything;
* the resident memory grows: after a warm-up (the first 10 % of the run, at least one call
  of each kind) the largest RSS of the last quarter of the calls must be within 5 % of the
  largest RSS seen during the warm-up.

Writes one JSON line per call (kind, rows, prompt and new tokens, seconds, RSS, whether it
matched) and a summary line to ``--output``; exits 1 on a failure. The hour needs a quiet
machine; ``--minutes 1`` is the smoke run.

    python benchmarks/soak.py [--minutes 60] [--seed 0] [--output results/soak/soak.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import copy_prompt, long_input_prompt, quote_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner

KINDS = ("greedy", "sampling", "batch", "continuous")
LENGTHS = (64, 256, 1024)
MAKERS: dict[str, Callable[[Any, int, int], torch.Tensor]] = {
    "long-input": long_input_prompt,
    "copy": copy_prompt,
    "quote": quote_prompt,
}
TOLERANCE = 0.05


def rss_bytes() -> int:
    """This process's resident set size now (Linux ``/proc``; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_flat(samples: Sequence[int], warmup: int, tolerance: float = TOLERANCE) -> bool:
    """Whether the largest of the last quarter of ``samples`` is within ``tolerance`` of
    the largest of the first ``warmup`` (a run too short to have both passes)."""
    if warmup < 1 or len(samples) <= warmup:
        return True
    tail = samples[max(warmup, len(samples) - max(1, len(samples) // 4)) :]
    return max(tail) <= (1.0 + tolerance) * max(samples[:warmup])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per kind and length")
    parser.add_argument("--output", type=Path, default=Path("results/soak/soak.jsonl"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    eos = int(tokenizer.eos_token_id)
    decoder = SpeculativeDecoder(model)
    plain = SpeculativeDecoder(decoder.engine, planner=AutoregressivePlanner())
    pool = [
        (f"{name}-{length}-{seed}", make(tokenizer, length, seed))
        for name, make in MAKERS.items()
        for length in LENGTHS
        for seed in range(args.prompts)
    ]
    references: dict[tuple[str, int], torch.Tensor] = {}

    def reference(name: str, prompt: torch.Tensor, new: int) -> torch.Tensor:
        if (name, new) not in references:
            references[name, new] = plain.generate(
                prompt, max_new_tokens=new, eos_token_id=eos
            ).tokens
        return references[name, new]

    args.output.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 60.0 * args.minutes
    warmup_until = time.monotonic() + 6.0 * args.minutes  # the first 10 %
    samples: list[int] = []
    warmup = 0
    seen: set[str] = set()
    failures = 0
    with args.output.open("w", encoding="utf-8") as out:
        out.write(json.dumps({"run": environment(model, args.threads), "args": vars(args)},
                             default=str) + "\n")  # fmt: skip
        out.write(json.dumps({"kernels": kernel_record(decoder.engine)}) + "\n")
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            rows = 1 if kind in ("greedy", "sampling") else rng.randint(2, 4)
            picked = rng.sample(pool, rows)
            new = rng.choice((16, 64, 128))
            record: dict[str, Any] = {
                "kind": kind,
                "prompts": [name for name, _ in picked],
                "prompt_tokens": [int(p.numel()) for _, p in picked],
                "new_tokens": new,
            }
            started = time.perf_counter()
            try:
                if kind == "sampling":
                    params = {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                              "seed": rng.randrange(2**32)}  # fmt: skip
                    result = decoder.generate(
                        picked[0][1], max_new_tokens=new, eos_token_id=eos, sampling=params
                    )
                    tokens = [result.tokens]
                    ok = all(0 <= int(t) < decoder.engine.vocab_size for t in result.tokens)
                    record["seconds"] = time.perf_counter() - started
                else:
                    if kind == "greedy":
                        one = decoder.generate(picked[0][1], max_new_tokens=new, eos_token_id=eos)
                        tokens = [one.tokens]
                    else:
                        batch = decoder.generate_batch(
                            [p for _, p in picked],
                            max_new_tokens=new,
                            eos_token_id=eos,
                            max_batch_rows=2 if kind == "continuous" else None,
                        )
                        tokens = batch.tokens
                    record["seconds"] = time.perf_counter() - started
                    ok = all(
                        torch.equal(t, reference(name, p, new))
                        for (name, p), t in zip(picked, tokens, strict=True)
                    )
                record["generated"] = [int(t.numel()) for t in tokens]
                record["ok"] = ok
            except Exception as error:  # a soak records every failure and goes on
                record["ok"] = False
                record["error"] = f"{type(error).__name__}: {error}"
            samples.append(rss_bytes())
            record["rss_mb"] = round(samples[-1] / 2**20, 1)
            seen.add(kind)
            if time.monotonic() < warmup_until or seen != set(KINDS):
                warmup = len(samples)
            failures += not record["ok"]
            out.write(json.dumps(record) + "\n")
            out.flush()
            status = "ok" if record["ok"] else f"FAILED {record.get('error', 'output differs')}"
            print(f"{len(samples):5d} {kind:10s} rows={rows} new={new} "
                  f"rss={record['rss_mb']} MB {status}", flush=True)  # fmt: skip
        flat = rss_flat(samples, warmup)
        summary = {
            "summary": True,
            "calls": len(samples),
            "failures": failures,
            "warmup_calls": warmup,
            "rss_warmup_max_mb": round(max(samples[:warmup], default=0) / 2**20, 1),
            "rss_last_quarter_max_mb": round(
                max(samples[-max(1, len(samples) // 4) :], default=0) / 2**20, 1
            ),
            "rss_flat": flat,
            "rss_judged": 0 < warmup < len(samples),
            "passed": failures == 0 and flat,
        }
        out.write(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
