"""``packed-linear`` against ``row-linear``: the exact engine's products, A/B in one run.

Both kernels are row-invariant by construction; ``packed-linear`` (bfloat16 on CPUs with
AVX512-BF16) reads each weight packed in VNNI order and accumulates every output in one
float32 lane, where ``row-linear`` splits each dot product over vector lanes and sums them
at the end. This times, on the real SmolLM2 and Spec-Bench first turns, one exact engine
with the probe's table (the packed kernel where it won) and with the same table running
``row-linear`` instead, interleaved in blocks (packed, row, packed, row, ...):

* plain batched decode rounds (the autoregressive planner) at 1, 4 and 16 rows;
* a chunk-invariant prefill (the path a server with a prefix cache runs) of one long
  Spec-Bench prompt repeated to ``--prefill-tokens`` tokens.

Writes ``results/engine/packed-linear-<cpu>.jsonl``: one line per case and kernel (median,
p10, p90 in ms) and a summary line per case.

    python benchmarks/packed_linear.py [--rows 1 4 16] [--blocks 4] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import chat_prompt
from knapspec.bench.records import append_jsonl
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.bench.timing import batched_round_seconds, spread_ms
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.table import PACKED_KERNEL, ROW_LINEAR_KERNEL, KernelTable
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.model.machine import host_cpu_model
from knapspec.planners import AutoregressivePlanner


def _swapped(table: KernelTable) -> KernelTable:
    """``table`` with every ``packed-linear`` product run by ``row-linear``."""

    def swap(name: str) -> str:
        return ROW_LINEAR_KERNEL if name == PACKED_KERNEL else name

    return attrs.evolve(
        table,
        choices={shape: tuple(swap(n) for n in names) for shape, names in table.choices.items()},
        large={shape: swap(name) for shape, name in table.large.items()},
    )


def _prefills(engine: SublayerEngine, prompt: torch.Tensor, times: int) -> list[float]:
    """Seconds of ``times`` chunk-invariant prefills of ``prompt`` (after one warm-up)."""
    seconds = []
    with torch.inference_mode():
        for index in range(times + 1):
            cache = engine.new_cache(prompt.numel() + 8)
            started = time.perf_counter()
            engine.forward(prompt, 0, cache, all_logits=False)
            if index:
                seconds.append(time.perf_counter() - started)
    return seconds


def _interleaved(
    engine: SublayerEngine,
    tables: dict[str, KernelTable],
    blocks: int,
    measure: Callable[[], list[float]],
) -> dict[str, list[float]]:
    """``measure()`` under each table in turn, ``blocks`` times each."""
    timings: dict[str, list[float]] = {name: [] for name in tables}
    for _ in range(blocks):
        for name, table in tables.items():
            engine.use_kernels(table)
            timings[name] += measure()
    engine.use_kernels(tables[PACKED_KERNEL])
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--blocks", type=int, default=4, help="blocks per kernel")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per block")
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--prefills", type=int, default=3, help="timed prefills per block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(dtype=torch.bfloat16)
    engine = SublayerEngine(model)
    packed = engine.kernels
    chosen = {name for names in packed.choices.values() for name in names}
    if PACKED_KERNEL not in chosen:
        raise SystemExit(
            f"the probe chose {sorted(chosen)} here, not {PACKED_KERNEL} (it needs a CPU with "
            "avx512_bf16 and a C compiler): nothing to compare"
        )
    tables = {PACKED_KERNEL: packed, ROW_LINEAR_KERNEL: _swapped(packed)}
    decoder = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    questions = [q.turns[0] for q in load_questions(packaged_questions())]
    slug = re.sub(r"[^a-z0-9]+", "-", host_cpu_model().lower()).strip("-")
    output = args.output or Path(f"results/engine/packed-linear-{slug}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    env = {**environment(model, args.threads), "dtype": "bfloat16"}
    cases: dict[str, Callable[[], list[float]]] = {}
    for rows in args.rows:
        prompts = [chat_prompt(tokenizer, question, "").tolist() for question in questions[:rows]]
        cases[f"round-{rows}"] = lambda p=prompts: batched_round_seconds(
            decoder, p, warm=5, timed=args.rounds
        )
    longest = max((chat_prompt(tokenizer, q, "").tolist() for q in questions), key=len)
    repeated = (longest * (args.prefill_tokens // len(longest) + 1))[: args.prefill_tokens]
    prompt = torch.tensor(repeated)
    engine.enable_chunk_invariance()
    cases[f"prefill-{prompt.numel()}"] = lambda: _prefills(engine, prompt, args.prefills)
    lines: list[dict[str, object]] = []
    for case, measure in cases.items():
        timings = _interleaved(engine, tables, args.blocks, measure)
        medians = {}
        for kernel, seconds in timings.items():
            medians[kernel] = statistics.median(seconds) * 1e3
            spread = spread_ms(seconds)
            lines.append({**env, "kind": case, "kernel": kernel, "samples": len(seconds), **spread})
        ratio = medians[ROW_LINEAR_KERNEL] / medians[PACKED_KERNEL]
        lines.append({**env, "kind": "summary", "case": case, "row_over_packed": round(ratio, 3)})
        print(
            f"{case:>14}: packed {medians[PACKED_KERNEL]:8.1f} ms, row-linear "
            f"{medians[ROW_LINEAR_KERNEL]:8.1f} ms ({ratio:.2f}x)",
            flush=True,
        )
    for line in lines:
        append_jsonl(output, json.dumps(line))
    print(f"wrote {len(lines)} lines to {output}")


if __name__ == "__main__":
    main()
