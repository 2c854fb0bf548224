"""This machine's kernel table: what tuning chose, what it cost, and v(k) with and without it.

Measures, on SmolLM2-135M-Instruct fp32 (2 threads by default):

1. the first engine on this machine (no cached table: the kernels are timed and checked)
   and a second one (table read from the cache), in wall seconds;
2. whole engine steps of k = 1 .. D + 1 tokens after 512, 2048 and 4096 cached tokens,
   with the tuned table and with plain ``F.linear``, interleaved (median of ``--repeats``):
   the tuned step must never be slower than ``F.linear``'s, and v(k) = step(k) / step(1).

Writes ``results/engine/kernels-<cpu>.jsonl``: one ``table`` line (key, table, timing of
the tuning, the end-to-end checks) and one ``step`` line per context, k and backend.

    python benchmarks/kernel_table.py [--contexts 512 2048 4096] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import long_input_prompt
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.model.machine import host_cpu_model
from knapspec.model.tuning.autotune import KernelKey, kernel_table_path, load_or_tune


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--max-k", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    slug = re.sub(r"[^a-z0-9]+", "-", host_cpu_model().lower()).strip("-")
    output = args.output or Path(f"results/engine/kernels-{slug}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    env = environment(model, args.threads)
    rows: list[dict[str, object]] = []

    # 1. First use (an empty cache directory: the table is measured) and second use.
    with tempfile.TemporaryDirectory() as scratch:
        previous = os.environ.get("KNAPSPEC_CACHE")
        os.environ["KNAPSPEC_CACHE"] = scratch
        try:
            start = time.perf_counter()
            engine = SublayerEngine(model, progress=True)
            first_use = time.perf_counter() - start
            start = time.perf_counter()
            SublayerEngine(model)
            second_use = time.perf_counter() - start
            result = load_or_tune(engine)
            assert kernel_table_path(KernelKey.for_engine(engine)).exists()
        finally:
            if previous is None:
                del os.environ["KNAPSPEC_CACHE"]
            else:
                os.environ["KNAPSPEC_CACHE"] = previous
    print(f"first use {first_use:.1f} s (tuning {result.seconds:.1f} s), second {second_use:.3f} s")
    print(engine.kernels.summary())
    rows.append(
        {
            "kind": "table",
            "first_use_s": first_use,
            "second_use_s": second_use,
            "fingerprint": engine.kernels.fingerprint(),
            **result.to_dict(),
            **env,
        }
    )

    # 2. Whole steps of k tokens: tuned table vs plain F.linear, interleaved.
    plain = SublayerEngine(model, kernels="f.linear")
    widths = list(range(1, args.max_k + 1))
    for context in args.contexts:
        ids = long_input_prompt(tokenizer, context + args.max_k, seed=context)
        n = ids.numel() - args.max_k
        cache = engine.new_cache(ids.numel())
        engine.forward(ids[:n], 0, cache, all_logits=False)
        seconds: dict[tuple[str, int], list[float]] = {}
        for repeat in range(args.repeats + 1):
            for k in widths:
                for name, candidate in (("engine", engine), ("engine-f.linear", plain)):
                    start = time.perf_counter()
                    candidate.forward(ids[n : n + k], n, cache)
                    elapsed = time.perf_counter() - start
                    cache.crop(n)
                    if repeat:
                        seconds.setdefault((name, k), []).append(elapsed)
        for name in ("engine", "engine-f.linear"):
            one = statistics.median(seconds[(name, 1)])
            for k in widths:
                median = statistics.median(seconds[(name, k)])
                rows.append(
                    {
                        "kind": "step",
                        "context": n,
                        "backend": name,
                        "k": k,
                        "seconds": median,
                        "v": median / one,
                        "vs_f_linear": median / statistics.median(seconds[("engine-f.linear", k)]),
                        "samples": seconds[(name, k)],
                        **env,
                    }
                )
        summary = [
            f"{k}:{statistics.median(seconds[('engine', k)]) * 1e3:.1f}/"
            f"{statistics.median(seconds[('engine-f.linear', k)]) * 1e3:.1f}"
            for k in widths
        ]
        print(f"context {n}: k: tuned/F.linear ms  " + "  ".join(summary))
    with output.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
