"""What the incremental lookup index costs: microseconds per committed token and per
proposal, as the context grows to 32k tokens (pure Python, one thread), and what indexing
a whole prompt of that length at once costs (linear in its length).

Feeds real text (the bench corpus, tokenised) token by token into a
:class:`~knapspec.drafters.LookupDrafter` and times ``extend`` per token and ``propose``
at context lengths 512 .. 32768; then indexes each length's prefix as one prompt
(``reset``, what a call does with its prompt). Writes one JSON line per context length.

    python benchmarks/lookup_index.py [--output results/drafters/lookup_index.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from knapspec.bench.env import cpu_name
from knapspec.bench.prompts import corpus
from knapspec.drafters import DraftRequest, LookupDrafter
from knapspec.model.loading.provision import load_model_and_tokenizer

CHECKPOINTS = (512, 1024, 2048, 4096, 8192, 16384, 32768)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("results/drafters/lookup_index.jsonl"))
    parser.add_argument("--proposals", type=int, default=200, help="timed proposals per point")
    args = parser.parse_args()
    _, tokenizer = load_model_and_tokenizer()
    text = corpus()[1][:160_000]  # about 37k tokens: enough for the last checkpoint
    tokens: list[int] = tokenizer(text)["input_ids"][: CHECKPOINTS[-1]]
    drafter = LookupDrafter()
    drafter.reset([])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    with args.output.open("a") as handle:
        for checkpoint in CHECKPOINTS:
            started = time.perf_counter()
            for token in tokens[done:checkpoint]:
                drafter.extend([token])
            extend_us = 1e6 * (time.perf_counter() - started) / max(1, checkpoint - done)
            done = checkpoint
            propose_us = []
            for _ in range(args.proposals):
                draft = drafter.propose(DraftRequest(10))
                propose_us.append(1e6 * draft.seconds)
            prompt = LookupDrafter()
            started = time.perf_counter()
            prompt.reset(tokens[:checkpoint])
            reset_ms = 1e3 * (time.perf_counter() - started)
            line = {
                "context": checkpoint,
                "index_prompt_ms": reset_ms,
                "index_prompt_us_per_token": 1e3 * reset_ms / checkpoint,
                "extend_us_per_token": extend_us,
                "propose_us_median": statistics.median(propose_us),
                "propose_us_max": max(propose_us),
                "cpu": cpu_name(),
            }
            handle.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
