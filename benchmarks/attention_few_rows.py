"""A/B of the row-invariant attention kernel on its bf16 path: microseconds per call of
``attend_rows_batched`` for decode-step shapes (B sequences, q queries, n keys; SmolLM2's 9
query heads over 3 K/V heads, head size 64), best of three loops, for the kernel built from
``ATT_SRC`` (a C file beside a copy of ``bfloat16.h``; default: the repository's), its
outputs saved to the path given so that two builds can be compared bitwise.

    python benchmarks/attention_few_rows.py /tmp/new.pt
    ATT_SRC=/tmp/old/row_attention.c python benchmarks/attention_few_rows.py /tmp/old.pt
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch

import knapspec.model.kernels.row_attention as row_attention

SHAPES = ((1, 1), (4, 1), (16, 1), (4, 4), (16, 4), (1, 64), (3, 7))


def main() -> None:
    torch.set_num_threads(2)
    if os.environ.get("ATT_SRC"):
        row_attention.LIBRARY.source = Path(os.environ["ATT_SRC"])
    print(row_attention.bf16_attention_unit(), row_attention.LIBRARY.path().name)
    torch.manual_seed(0)
    outputs = []
    for batch, queries in SHAPES:
        for keys_count in (300, 1000):
            query = torch.randn(batch, 9, queries, 64).bfloat16()
            keys = torch.randn(16, 3, 2048, 64).bfloat16()[:batch, :, :keys_count]
            values = torch.randn(16, 3, 2048, 64).bfloat16()[:batch, :, :keys_count]
            lengths = (torch.arange(queries) + keys_count - queries + 1).expand(batch, queries)
            lengths = lengths.contiguous()

            call = functools.partial(
                row_attention.attend_rows_batched, query, keys, values, lengths, 0.125
            )

            result = call()
            assert result is not None, "the compiled kernel did not serve"
            outputs.append(result.clone())
            for _ in range(20):
                call()
            reps = 300 if queries < 8 else 30
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                for _ in range(reps):
                    call()
                best = min(best, (time.perf_counter() - started) / reps)
            print(f"B{batch} q{queries} n{keys_count}: {best * 1e6:.1f} us")
    torch.save(outputs, sys.argv[1])


if __name__ == "__main__":
    main()
