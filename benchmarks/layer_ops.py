"""A layer-loop option on and off: one batched decode round at 1, 4 and 16 rows.

``--compare layer-ops`` (the default): an exact CPU engine runs each layer's RMSNorms and
rotary as one compiled call each and writes a batch's K/V with one compiled copy per
buffer (:mod:`knapspec.model.kernels.layer_ops`); off, the model's modules and PyTorch's indexed
writes (``compiled_layer_ops=False``). ``--compare lean-pass``: exact batched passes run
their layer items through :class:`~knapspec.model.passes.exact_pass.ExactLayerPass` (the same
kernels, per-pass work done once); off, the engine's general layer methods
(``engine.use_paths(lean_passes=False)``). ``--compare layer-loop``: a lean pass that runs every
sublayer runs its layer loop as one compiled call (:mod:`knapspec.model.kernels.layer_loop`); off,
its items one by one from Python (``engine.use_paths(compiled_loop=False)``). This times plain
batched rounds (the autoregressive planner: every row one token a round) of Spec-Bench
first turns on the real SmolLM2, both settings on one engine, interleaved in blocks (on,
off, on, off, ...), and reports the median round per setting and rows; then one
sequence's steps through
``SublayerEngine.forward`` (``--sequence-widths``: a decode step, a 5-token verification),
the same way; then one-token layer-skipping draft steps under seeded random sublayer masks
(``--draft-keeps``: about half and three quarters of the items).

Writes ``results/engine/<compare>-<cpu>.jsonl``: one line per rows and setting (median,
p10, p90 round in ms over every timed round of its blocks) and a summary line per rows.

    python benchmarks/layer_ops.py [--compare layer-ops|lean-pass|layer-loop] [--rows 1 4 16]
        [--sequence-widths 1 5] [--draft-keeps 0.5 0.75] [--blocks 4] [--rounds 30]
        [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from knapspec.bench.env import environment
from knapspec.bench.prompts import chat_prompt
from knapspec.bench.records import append_jsonl
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.bench.timing import (
    batched_round_seconds,
    engine_step_seconds,
    filled_cache,
    spread_ms,
)
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.model.cache import KVCache
from knapspec.model.engine import SublayerEngine
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.model.machine import host_cpu_model
from knapspec.planners import AutoregressivePlanner
from knapspec.types import SublayerMask

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@contextlib.contextmanager
def _setting(
    engine: SublayerEngine, compare: str, on: bool, built: tuple[bool, bool, bool]
) -> Iterator[None]:
    """The compared option on (as the engine built it) or off, for the block."""
    if compare in ("lean-pass", "layer-loop"):
        field = "lean_passes" if compare == "lean-pass" else "compiled_loop"
        with engine.use_paths(**{field: on}):
            yield
        return
    engine.compiled_norms, engine.compiled_rotary, engine.compiled_writes = (
        built if on else (False, False, False)
    )
    try:
        yield
    finally:
        engine.compiled_norms, engine.compiled_rotary, engine.compiled_writes = built


def _sequence_steps(
    engine: SublayerEngine,
    cache: KVCache,
    context: int,
    width: int,
    steps: int,
    mask: SublayerMask | None = None,
) -> list[float]:
    """Seconds of ``steps`` engine steps of ``width`` tokens after ``context`` cached ones
    (under ``mask``: a layer-skipping draft step)."""
    return [
        engine_step_seconds(engine, cache, context, width, mask, repeats=1) for _ in range(steps)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compare", choices=("layer-ops", "lean-pass", "layer-loop"), default="layer-ops"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--blocks", type=int, default=4, help="blocks per setting")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per block")
    parser.add_argument(
        "--sequence-widths",
        type=int,
        nargs="*",
        default=[1, 5],
        help="also time one sequence's steps of these many tokens (none: batched rounds only)",
    )
    parser.add_argument(
        "--draft-keeps",
        type=float,
        nargs="*",
        default=[0.5, 0.75],
        help="also time one-token draft steps under seeded random sublayer masks keeping "
        "about these fractions of the items",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(dtype=DTYPES[args.dtype])
    engine = SublayerEngine(model)
    built = (engine.compiled_norms, engine.compiled_rotary, engine.compiled_writes)
    if not any(built):
        raise SystemExit("the compiled layer operations do not run here: nothing to compare")
    decoder = SpeculativeDecoder(engine, planner=AutoregressivePlanner())
    questions = [q.turns[0] for q in load_questions(packaged_questions())]
    slug = re.sub(r"[^a-z0-9]+", "-", host_cpu_model().lower()).strip("-")
    output = args.output or Path(f"results/engine/{args.compare}-{slug}.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **environment(model, args.threads),
        "dtype": args.dtype,
        "built": built,
        "compare": args.compare,
    }
    lines: list[dict[str, object]] = []

    def compare(what: dict[str, object], measure: Callable[[], list[float]]) -> None:
        """Blocks of ``measure`` on and off, interleaved; a line per setting, a summary."""
        timings: dict[bool, list[float]] = {True: [], False: []}
        for block in range(2 * args.blocks):
            on = block % 2 == 0
            with _setting(engine, args.compare, on, built):
                timings[on] += measure()
        medians = {}
        for on, seconds in timings.items():
            medians[on] = statistics.median(seconds) * 1e3
            lines.append(
                {
                    **env,
                    **what,
                    "on": on,
                    **({"compiled_layer_ops": on} if args.compare == "layer-ops" else {}),
                    "rounds": len(seconds),
                    **spread_ms(seconds),
                }
            )
        ratio = round(medians[False] / medians[True], 3)
        lines.append({**env, **what, "kind": "summary", "off_over_on": ratio})
        print(
            f"{what}: on {medians[True]:6.1f} ms, off {medians[False]:6.1f} ms ({ratio}x)",
            flush=True,
        )

    for rows in args.rows:
        prompts = [chat_prompt(tokenizer, question, "").tolist() for question in questions[:rows]]
        compare(
            {"kind": "round", "rows": rows},
            functools.partial(batched_round_seconds, decoder, prompts, warm=5, timed=args.rounds),
        )
    prompt = chat_prompt(tokenizer, questions[0], "")
    for width in args.sequence_widths:
        # One sequence's step through SublayerEngine.forward (what a library call runs):
        # a decode step (1 token) or a verification (k tokens) after the chat prompt.
        cache = filled_cache(engine, prompt, width + 8)
        compare(
            {"kind": "sequence-step", "tokens": width, "context": prompt.numel()},
            functools.partial(_sequence_steps, engine, cache, prompt.numel(), width, args.rounds),
        )
    draws = random.Random(0)
    for keep in args.draft_keeps:
        # A layer-skipping draft step (SublayerEngine.forward under a mask), one token.
        flags = tuple(draws.random() < keep for _ in range(engine.num_items))
        cache = filled_cache(engine, prompt, 9)
        compare(
            {"kind": "draft-step", "keep": keep, "items": sum(flags), "context": prompt.numel()},
            functools.partial(
                _sequence_steps, engine, cache, prompt.numel(), 1, args.rounds, SublayerMask(flags)
            ),
        )
    for line in lines:
        append_jsonl(output, json.dumps(line))
    print(f"wrote {len(lines)} lines to {output}")


if __name__ == "__main__":
    main()
