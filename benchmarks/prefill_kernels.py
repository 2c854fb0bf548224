"""A cold prefill through the framework's products, the row-invariant ones, and the engine's
choice between them (:mod:`knapspec.model.tuning.prefill`), on the real model.

Per prompt (Spec-Bench first turns as chat, and novel passages of ``--lengths`` tokens to
summarise), the three dispatches are interleaved round by round (the order rotating), each
a best-of-``--repeats`` cold prefill (``engine.forward`` from position 0, last logits
only): the time to the first token of a call without a prefix cache, less its sampling.
(Whole calls are not compared: the two prefills round differently, so greedy answers in
bf16 may part, and a second call of a prompt copies from the first one's answer.)

    python benchmarks/prefill_kernels.py --dtype bfloat16 [--lengths 512 2048 4096]
        [--spec-bench 8] [--threads 2]

Appends JSON lines to ``--output`` (default ``results/engine/prefill_kernels.jsonl``), each
with the CPU model, its bf16 / AMX flags, the dtype and the engine's prefill choice.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import chat_prompt, long_input_prompt
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer


def _chat_prompts(tokenizer: Any, count: int) -> list[torch.Tensor]:
    """``count`` Spec-Bench first turns spread over the file (it is grouped by category)."""
    questions = load_questions(packaged_questions())
    step = max(1, len(questions) // count)
    return [chat_prompt(tokenizer, q.turns[0], "") for q in questions[::step][:count]]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--spec-bench", type=int, default=8, help="chat prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/engine/prefill_kernels.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(dtype=getattr(torch, args.dtype))
    decoder = SpeculativeDecoder(model)
    engine = decoder.engine
    env = {**environment(model, args.threads), **kernel_record(engine)}
    dispatches = {
        "framework": engine.measured_kernels.large_dispatch(),
        "row-invariant": engine.kernels.large_dispatch(),
        "chosen": dict(engine._prefill_large),
    }
    chosen = dispatches["chosen"]
    prompts = [("spec-bench", ids) for ids in _chat_prompts(tokenizer, args.spec_bench)]
    prompts += [("passage", long_input_prompt(tokenizer, n)) for n in args.lengths]
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def prefill(dispatch: dict[Any, Any], ids: torch.Tensor) -> float:
        engine._prefill_large = dispatch
        cache = engine.new_cache(ids.numel())
        start = time.perf_counter()
        engine.forward(ids, 0, cache, all_logits=False)
        return time.perf_counter() - start

    names = list(dispatches)
    with args.output.open("a") as out:
        for index, (kind, ids) in enumerate(prompts):
            best = dict.fromkeys(names, float("inf"))
            prefill(chosen, ids)  # warm-up
            for round_index in range(args.repeats):
                order = names[round_index % 3 :] + names[: round_index % 3]
                for name in order:
                    best[name] = min(best[name], prefill(dispatches[name], ids))
            record = {
                **env,
                "set": kind,
                "prompt": index,
                "prompt_tokens": ids.numel(),
                "seconds": best,
                "framework_over_chosen": best["framework"] / best["chosen"],
            }
            out.write(json.dumps(record) + "\n")
            print(
                f"{kind:10s} {ids.numel():5d} tokens: "
                + "  ".join(f"{n} {s * 1e3:7.1f} ms" for n, s in best.items())
            )
        engine._prefill_large = chosen


if __name__ == "__main__":
    main()
