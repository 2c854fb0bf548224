"""Batched throughput: transformers' batched ``model.generate`` vs our batched plain decoding
vs our batched speculation, as the bench's ``throughput`` scenario.

A thin wrapper: the protocol, the records and the report live in the bench
(:mod:`knapspec.bench.throughput`, ``knapspec bench report``). This runs

    knapspec bench run --scenarios throughput --methods generate ar knapspec \\
        --batch-sizes B... --contexts N --new-tokens T --pairs P --threads 2 \\
        --no-oracle --no-vcurve --run-name NAME --overwrite

and writes ``results/bench/NAME/`` (``throughput.jsonl``, ``run.json``, ``report.md`` with
the throughput table, the CPU named).

    python benchmarks/batch_throughput.py [--batch-sizes 1 4 8] [--context 2048]
        [--new-tokens 128] [--pairs 3] [--run-name throughput]
"""

from __future__ import annotations

import argparse
import sys

from knapspec.bench import cli_main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", nargs="+", default=["1", "4", "8"])
    parser.add_argument("--context", default="2048")
    parser.add_argument("--new-tokens", default="128")
    parser.add_argument("--pairs", default="3")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--run-name", default="throughput")
    args = parser.parse_args()
    return cli_main(
        [
            "run",
            "--scenarios",
            "throughput",
            "--methods",
            "generate",
            "ar",
            "knapspec",
            "--batch-sizes",
            *args.batch_sizes,
            "--contexts",
            args.context,
            "--new-tokens",
            args.new_tokens,
            "--pairs",
            args.pairs,
            "--threads",
            args.threads,
            "--no-oracle",
            "--no-vcurve",
            "--run-name",
            args.run_name,
            "--overwrite",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
