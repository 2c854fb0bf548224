"""The knapspec engine, plain (γ = 0 every round) and with the default decoder, vs
``model.generate``.

Side by side in one process, interleaved triples after a warm-up (generate, plain, default;
the order rotates each pair), prefill included, greedy, a real model and real text (the
long-input prompts of ``knapspec.bench.prompts``: a novel's passage to summarise). Each
prompt is decoded once before its timed calls and then once per pair by each system; no call
drafts from an earlier call's answer (the prefix cache is off and the lookup history empty,
as by default), while what the planner learned of acceptance carries over between calls, as
in ``knapspec bench``. The default decoder must equal plain decoding token for token (the
run stops if not); whether the engine's tokens equal ``model.generate``'s is recorded, not
required (another kernel sums in another order, and greedy decoding can turn on one ulp).
Every line records the CPU, its vector flags, the BLAS, both dtypes and the engine's kernel
table: a ratio holds for that machine only.

    python benchmarks/engine_vs_generate.py [--model gemma-3-270m] [--contexts 512 2048 4096]
        [--pairs 3] [--new-tokens 128] [--dtype bfloat16] [--generate-dtypes float32 bfloat16]

``--dtype`` is the engine's (plain and default); ``--generate-dtypes`` (default: the same)
``model.generate``'s, each timed in every pair on its own copy of the weights; a line per
pair and ``model.generate`` dtype. Lines are appended to
``results/engine/engine_vs_generate-<model>.jsonl``."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.methods import forget_earlier_calls
from knapspec.bench.prompts import long_input_prompt
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners import AutoregressivePlanner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first index where token lists ``a`` and ``b`` differ (a length counts), or None."""
    for index, (x, y) in enumerate(zip(a.tolist(), b.tolist(), strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument(
        "--first-pair",
        type=int,
        default=0,
        help="index of the first pair (its order's rotation): runs interleaved with another "
        "system's process each take one pair",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default="default", help="a known model (default, gemma-3-270m) or a directory"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="the engine's")
    parser.add_argument(
        "--generate-dtypes",
        choices=DTYPES,
        nargs="+",
        default=None,
        help="model.generate's (default: --dtype)",
    )
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    generate_dtypes = args.generate_dtypes or [args.dtype]
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=torch.float32)
    models = {
        dtype: model if dtype == "float32" else copy.deepcopy(model).to(DTYPES[dtype])
        for dtype in {*generate_dtypes, args.dtype}
    }
    engine_model = models[args.dtype]
    plain = SpeculativeDecoder(engine_model, planner=AutoregressivePlanner())
    default = SpeculativeDecoder(engine_model)
    name = getattr(model.config, "_name_or_path", "") or args.model
    env = {
        **environment(engine_model, args.threads),
        **kernel_record(plain.engine),
    }
    output = args.output or Path(
        f"results/engine/engine_vs_generate-{Path(str(name)).name or args.model}.jsonl"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    eos = model.generation_config.eos_token_id

    def hf(dtype: str) -> Callable[[torch.Tensor], tuple[float, torch.Tensor]]:
        def run(ids: torch.Tensor) -> tuple[float, torch.Tensor]:
            """``model.generate`` as users call it (greedy, stops at EOS)."""
            start = time.perf_counter()
            out = models[dtype].generate(
                ids.unsqueeze(0),
                attention_mask=torch.ones_like(ids).unsqueeze(0),
                max_new_tokens=args.new_tokens,
                do_sample=False,
            )
            return time.perf_counter() - start, out[0, ids.shape[0] :]

        return run

    def ours(decoder: SpeculativeDecoder) -> Callable[[torch.Tensor], tuple[float, torch.Tensor]]:
        def run(ids: torch.Tensor) -> tuple[float, torch.Tensor]:
            forget_earlier_calls(decoder)  # no call drafts from an earlier call's answer
            start = time.perf_counter()
            out = decoder.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=eos)
            return time.perf_counter() - start, out.tokens

        return run

    runners = {f"generate {d}": hf(d) for d in generate_dtypes}
    runners |= {"plain": ours(plain), "default": ours(default)}
    systems = tuple(runners)  # the first pair's order; later pairs rotate it
    with output.open("a") as handle:
        for context in args.contexts:
            prompt = long_input_prompt(tokenizer, context, seed=context)
            for run in runners.values():  # warm-up
                run(prompt)
            ratios: dict[str, list[float]] = {}
            for pair in range(args.first_pair, args.first_pair + args.pairs):
                turn = pair % len(systems)
                order = systems[turn:] + systems[:turn]
                seconds, tokens = {}, {}
                for system in order:
                    seconds[system], tokens[system] = runners[system](prompt)
                if not torch.equal(tokens["default"], tokens["plain"]):
                    raise SystemExit(
                        f"LOSSLESSNESS FAILURE at context {context}: the default decoder's "
                        f"tokens differ from plain decoding's at "
                        f"{_first_difference(tokens['default'], tokens['plain'])}"
                    )
                for dtype in generate_dtypes:
                    reference = f"generate {dtype}"
                    row = {
                        "context": context,
                        "prompt_tokens": int(prompt.numel()),
                        "pair": pair,
                        "order": list(order),
                        "generate_dtype": dtype,
                        "generate_s": seconds[reference],
                        "engine_s": seconds["plain"],
                        "default_s": seconds["default"],
                        "speedup": seconds[reference] / seconds["plain"],
                        "default_speedup": seconds[reference] / seconds["default"],
                        "new_tokens": len(tokens["plain"]),
                        "generate_new_tokens": len(tokens[reference]),
                        "engine_equals_generate": torch.equal(tokens["plain"], tokens[reference]),
                        "first_difference_from_generate": _first_difference(
                            tokens["plain"], tokens[reference]
                        ),
                        **env,
                    }
                    handle.write(json.dumps(row) + "\n")
                    handle.flush()
                    ratios.setdefault(f"plain / {reference}", []).append(row["speedup"])
                    ratios.setdefault(f"default / {reference}", []).append(row["default_speedup"])
                    keys = ("context", "pair", "generate_dtype", "generate_s", "engine_s")
                    print(json.dumps({k: row[k] for k in (*keys, "default_s")}), flush=True)
            for system, values in ratios.items():
                print(
                    f"context {context}: {system} median {statistics.median(values):.3f}"
                    f" (min {min(values):.3f}, max {max(values):.3f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
