"""``F.linear`` vs knapspec's few-row kernel on SmolLM2-135M's weight shapes.

For each projection shape of the model (q/o, k/v, gate/up, down, LM head) and each row
count ``1..8, 11, 16``, the median time of ``F.linear(x, W)`` and of
:func:`knapspec.model.kernels.table.linear` (``(W @ x.T).T``, 1 and 3 rows padded to 2 and 4),
interleaved in one process, 2 threads. Writes ``results/engine/small_row_linear.jsonl``.

    python benchmarks/small_row_linear.py [--repeats 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from knapspec.bench.env import cpu_name
from knapspec.bench.timing import median_seconds
from knapspec.model.kernels.table import linear

#: (name, out_features, in_features) of SmolLM2-135M's projections.
SHAPES = (
    ("q_proj/o_proj", 576, 576),
    ("k_proj/v_proj", 192, 576),
    ("gate_proj/up_proj", 1536, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 11, 16)


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``call`` (the harness's own timer)."""
    return 1e3 * median_seconds(call, torch.device("cpu"), repeats=repeats, warmup=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--output", type=Path, default=Path("results/engine/small_row_linear.jsonl")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_name()
    generator = torch.Generator().manual_seed(0)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as handle:
        for name, out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features, generator=generator)
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=generator)
                reference = median_ms(lambda: F.linear(x, weight), args.repeats)  # noqa: B023
                kernel = median_ms(lambda: linear(x, weight), args.repeats)  # noqa: B023
                line = {
                    "shape": name,
                    "out_features": out_features,
                    "in_features": in_features,
                    "rows": rows,
                    "f_linear_ms": reference,
                    "kernel_ms": kernel,
                    "speedup": reference / kernel,
                    "threads": args.threads,
                    "cpu": cpu,
                    "torch": torch.__version__,
                }
                handle.write(json.dumps(line) + "\n")
                print(
                    f"{name:18s} rows {rows:2d}: F.linear {reference:7.3f} ms, "
                    f"kernel {kernel:7.3f} ms ({reference / kernel:.2f}x)"
                )


if __name__ == "__main__":
    main()
