"""Batched throughput: transformers' batched ``model.generate`` vs our batched plain decoding
vs our batched speculation, side by side in one process.

For each batch size ``B`` the prompts are ``B`` long-input prompts ("Summarize the
following passage" + about ``--context`` tokens of a novel, each from its own seed, so the
lengths differ a little: a ragged, left-padded batch for transformers). Per pair the three
methods run interleaved after a warm-up (prefill included, greedy, EOS per row):

* ``hf``: ``model.generate`` on the left-padded ``(B, n)`` batch (SDPA, its dynamic cache);
* ``plain``: ``SpeculativeDecoder.generate_batch(..., policy=PlainBatchPolicy())`` (γ = 0);
* ``spec``: the default decoder's ``generate`` on the list of prompts (lookup drafts per
  row, γ chosen at batch level from the cost model; B = 1 takes the single-sequence path
  with the full knapsack planner).

Throughput is new tokens over all rows (each up to and including its EOS) per second.
``plain`` and ``spec`` must give every row identical tokens (else the run stops: a bug);
whether transformers' padded batch gave the same tokens is recorded per pair
(``hf_rows_equal``; padding changes its arithmetic slightly). Every line records the CPU,
its flags, the BLAS and the engine's kernel table.

    python benchmarks/batch_throughput.py [--batch-sizes 1 4 8] [--context 2048]
        [--new-tokens 128] [--pairs 3] [--output results/engine/batch_throughput.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from knapspec import (
    AutoregressivePlanner,
    PlainBatchPolicy,
    SpeculativeDecoder,
    load_model_and_tokenizer,
)
from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import long_input_prompt


def _until_eos(tokens: torch.Tensor, eos: set[int]) -> list[int]:
    """The row's tokens up to and including its first EOS (transformers pads after it)."""
    out: list[int] = []
    for token in tokens.tolist():
        out.append(token)
        if token in eos:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/engine/batch_throughput.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer()
    plain = SpeculativeDecoder(model, planner=AutoregressivePlanner())
    spec = SpeculativeDecoder(model)
    env = {**environment(model, args.threads), **kernel_record(spec.engine)}
    eos_id = model.generation_config.eos_token_id
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id or [])
    pad = next(iter(eos)) if eos else 0

    def hf(prompts: list[torch.Tensor]) -> tuple[float, list[list[int]]]:
        width = max(p.numel() for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - prompt.numel() :] = prompt
            mask[row, width - prompt.numel() :] = 1
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        seconds = time.perf_counter() - start
        return seconds, [_until_eos(row[width:], eos) for row in out]

    def ours(decoder: SpeculativeDecoder, prompts: list[torch.Tensor], policy: Any) -> Any:
        start = time.perf_counter()
        if len(prompts) == 1:
            single = decoder.generate(
                prompts[0], max_new_tokens=args.new_tokens, eos_token_id=eos_id
            )
            rows = [single.tokens.tolist()]
        else:
            result = decoder.generate_batch(
                prompts, max_new_tokens=args.new_tokens, eos_token_id=eos_id, policy=policy
            )
            rows = [tokens.tolist() for tokens in result.tokens]
        return time.perf_counter() - start, rows

    records = []
    for batch in args.batch_sizes:
        prompts = [
            long_input_prompt(tokenizer, args.context, seed=args.context + row)
            for row in range(batch)
        ]
        hf(prompts), ours(plain, prompts, PlainBatchPolicy()), ours(spec, prompts, None)
        plain_vs_hf, spec_vs_plain = [], []
        for pair in range(args.pairs):
            t_hf, rows_hf = hf(prompts)
            t_plain, rows_plain = ours(plain, prompts, PlainBatchPolicy())
            t_spec, rows_spec = ours(spec, prompts, None)
            if rows_plain != rows_spec:
                raise SystemExit(f"LOSSLESSNESS FAILURE at B={batch}: plain and spec differ")
            new = sum(len(row) for row in rows_plain)
            new_hf = sum(len(row) for row in rows_hf)
            record = {
                "batch_size": batch,
                "pair": pair,
                "context": args.context,
                "prompt_tokens": [p.numel() for p in prompts],
                "new_tokens": new,
                "hf_new_tokens": new_hf,
                "hf_rows_equal": sum(a == b for a, b in zip(rows_hf, rows_plain, strict=True)),
                "hf_s": t_hf,
                "plain_s": t_plain,
                "spec_s": t_spec,
                "hf_tokens_per_s": new_hf / t_hf,
                "plain_tokens_per_s": new / t_plain,
                "spec_tokens_per_s": new / t_spec,
                **env,
            }
            plain_vs_hf.append(record["plain_tokens_per_s"] / record["hf_tokens_per_s"])
            spec_vs_plain.append(t_plain / t_spec)
            records.append(record)
            print(json.dumps({k: record[k] for k in list(record)[:15]}), flush=True)
        print(
            f"B={batch}: plain/hf throughput median {statistics.median(plain_vs_hf):.3f} "
            f"(min {min(plain_vs_hf):.3f}, max {max(plain_vs_hf):.3f}); spec/plain median "
            f"{statistics.median(spec_vs_plain):.3f} (min {min(spec_vs_plain):.3f}, max "
            f"{max(spec_vs_plain):.3f})",
            flush=True,
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
