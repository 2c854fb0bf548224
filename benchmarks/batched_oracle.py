"""How much can drafts gain over autoregressive decoding in a continuous batch of C rows here?

The serving goals of issue #47 ask ``knapspec serve`` for 1.3x its own autoregressive
server at 4 and 16 clients. This measures the ceiling with **hindsight oracles** run in the
engine itself, not modelled: every method decodes the same Spec-Bench chat turns in one
:class:`~knapspec.decoding.continuous.ContinuousBatch` of C lanes (a finished row's lane
takes the next request, as in a server), so the rounds, prefills, kernels and Python are
the real ones; only the drafts differ:

* ``ar`` -- plain rounds (the autoregressive server's policy); it also records each
  prompt's greedy answer, which every other method must reproduce token for token;
* ``knapspec`` -- the decoder's own batch policy (lookup drafts priced by the TPT search);
* ``lookup-oracle`` -- the lookup drafter's proposal (up to ``--cap`` tokens), cut in
  hindsight to the part the target accepts, every round: what perfect pricing of lookup
  drafts could reach (no rejected token is ever verified, no accepted one left out);
* ``perfect-k`` -- the next ``k`` tokens of the answer, every round: a drafter that is
  never wrong; the batch's verify capacity at draft length ``k``;
* ``lookup-fixed-k`` (``--fixed``) -- up to ``k`` lookup tokens whenever the suffix
  matches, unpriced (transformers' and vLLM's n-gram rule).

Per method and C it reports output tokens per second over the whole run (prefills
included, no prefix cache) and over its rounds alone (the decode phase), and the ratio to
``ar``; methods run interleaved per C, ``--repeats`` times, after one untimed run each
(the default policy's calibration of batched passes is the decoder's, kept across runs, as
in a running server). Where even ``lookup-oracle``
stays under a goal, no pricing of lookup drafts reaches it on this machine.

    python benchmarks/batched_oracle.py [--concurrency 1 4 16] [--requests 16] [--per-client 1]
        [--repeats 3] [--dtype bfloat16] [--threads 2] [--cap 16] [--perfect 4 8] [--fixed 2]

Writes ``results/serve/batched_oracle.jsonl`` (one line per method, C and repeat, with the
CPU, its flags, the dtype and the commit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from knapspec.bench.env import environment, kernel_record
from knapspec.bench.prompts import chat_prompt
from knapspec.bench.records import append_jsonl
from knapspec.bench.specbench.questions import load_questions, packaged_questions
from knapspec.decoding.continuous import ContinuousBatch, RowUpdate
from knapspec.decoding.decoder import SpeculativeDecoder
from knapspec.drafters import DraftRequest, LookupConfig, LookupDrafter
from knapspec.model.loading.provision import load_model_and_tokenizer
from knapspec.planners.batch.policy import (
    BatchDraftPolicy,
    FixedLookupBatchPolicy,
)
from knapspec.request import Request
from knapspec.types import Draft

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: Each prompt's greedy answer, keyed by the prompt's token ids (filled by the ``ar`` run).
ANSWERS: dict[tuple[int, ...], list[int]] = {}


class _HindsightDrafter(LookupDrafter):
    """A lookup drafter that knows its row's greedy answer (from :data:`ANSWERS`).

    ``reset`` receives the prompt and the first token; afterwards the index holds the
    prompt and every committed token, the pending one last, so the tokens a draft must
    match are ``answer[len(index) - prompt_length:]``.
    """

    def __init__(self, config: LookupConfig | None = None) -> None:
        super().__init__(config)
        self.prompt_length = 0
        self.answer: list[int] = []

    def reset(self, tokens: list[int]) -> None:
        super().reset(tokens)
        self.prompt_length = len(tokens) - 1
        self.answer = ANSWERS[tuple(tokens[:-1])]

    def upcoming(self) -> list[int]:
        return self.answer[len(self.index) - self.prompt_length :]


class LookupOracleDrafter(_HindsightDrafter):
    """The lookup proposal cut to its accepted prefix."""

    def propose(self, request: DraftRequest) -> Draft:
        draft = super().propose(request)
        upcoming = self.upcoming()
        kept = 0
        while (
            kept < len(draft.tokens)
            and kept < len(upcoming)
            and draft.tokens[kept] == upcoming[kept]
        ):
            kept += 1
        return attrs.evolve(
            draft, tokens=draft.tokens[:kept], support=draft.support[:kept], tree=None
        )


class PerfectDrafter(_HindsightDrafter):
    """The answer's next ``max_tokens`` tokens."""

    def propose(self, request: DraftRequest) -> Draft:
        tokens = tuple(self.upcoming()[: min(request.budget, self.config.max_tokens)])
        return Draft(tokens, "lookup", support=(1.0,) * len(tokens), match_length=len(tokens))


def _batch(
    decoder: SpeculativeDecoder,
    lanes: int,
    policy: BatchDraftPolicy,
    drafter: LookupDrafter,
    capacity: int,
) -> ContinuousBatch:
    """A continuous batch on ``decoder``'s engine with ``policy`` and one lookup drafter."""
    return ContinuousBatch(
        decoder.engine,
        decoder.engine.new_cache(256),
        lanes=lanes,
        capacity=capacity,
        policy=policy,
        max_draft_length=decoder.max_draft_length,
        drafters={"lookup": drafter},
        proposers=["lookup"],
        plan_subnetwork=None,
        capture_points=False,
        prefix_cache=None,
        lock=threading.Lock(),
    )


def build_methods(
    default: SpeculativeDecoder,
    *,
    cap: int,
    perfect: Sequence[int],
    fixed: Sequence[int],
    capacity: int = 4096,
) -> dict[str, Callable[[int], ContinuousBatch]]:
    """Per method (module docstring), a builder of a fresh batch of ``lanes`` rows on
    ``default``'s engine; ``ar`` first (it records :data:`ANSWERS`)."""
    plain = SpeculativeDecoder(default.engine, {"planner": {"name": "autoregressive"}})

    def lookup(k: int) -> LookupDrafter:
        return LookupDrafter(LookupConfig(max_tokens=k))

    methods: dict[str, Callable[[int], ContinuousBatch]] = {
        # What ``knapspec serve --set planner.name=autoregressive`` runs.
        "ar": lambda lanes: plain.continuous_batch(lanes, capacity),
        # The server's own policy and drafters (a fresh batch; no prefix cache by default).
        "knapspec": lambda lanes: default.continuous_batch(lanes, capacity),
        "lookup-oracle": lambda lanes: _batch(
            default,
            lanes,
            FixedLookupBatchPolicy(default.max_draft_length),
            LookupOracleDrafter(LookupConfig(max_tokens=cap)),
            capacity,
        ),
    }
    for k in fixed:
        methods[f"lookup-fixed-{k}"] = lambda lanes, k=k: _batch(
            default, lanes, FixedLookupBatchPolicy(k), lookup(k), capacity
        )
    for k in perfect:
        methods[f"perfect-{k}"] = lambda lanes, k=k: _batch(
            default,
            lanes,
            FixedLookupBatchPolicy(k),
            PerfectDrafter(LookupConfig(max_tokens=k)),
            capacity,
        )
    return methods


def run_batch(
    batch: ContinuousBatch,
    prompts: list[list[int]],
    clients: int,
    stop_ids: frozenset[int],
    max_new_tokens: int = 128,
) -> dict[str, Any]:
    """Decode ``prompts`` with at most ``clients`` rows at once, requests in order."""
    queue = list(enumerate(prompts))
    live: dict[int, int] = {}
    answers: dict[int, list[int]] = {}
    round_seconds = 0.0
    rounds = drafted = accepted = 0

    def admit() -> None:
        while queue and len(live) < clients:
            index, prompt = queue.pop(0)
            update = batch.add(Request(prompt, max_new_tokens, stop_ids=stop_ids))
            answers[index] = list(update.tokens)
            if not update.stop_reason:
                live[update.lane] = index

    def count(update: RowUpdate) -> None:
        nonlocal drafted, accepted
        drafted += update.stats.drafted_tokens
        accepted += update.stats.accepted_tokens

    started = time.perf_counter()
    admit()
    while live:
        before = time.perf_counter()
        updates = batch.step()
        round_seconds += time.perf_counter() - before
        rounds += 1
        for update in updates:
            answers[live[update.lane]].extend(update.tokens)
        for update in updates:
            if update.stop_reason:
                del live[update.lane]
                count(update)
        admit()
    wall = time.perf_counter() - started
    tokens = sum(len(answer) for answer in answers.values())
    # Tokens the rounds committed (each prefill commits a row's first token).
    decoded = tokens - len(prompts)
    return {
        "wall_s": wall,
        "round_s": round_seconds,
        "rounds": rounds,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "decode_tokens_per_s": decoded / round_seconds if round_seconds else None,
        "answers": [answers[i] for i in range(len(prompts))],
    }


def pass_questions(questions: list[str], base: int, total: int) -> list[str]:
    """The ``base`` questions benchmarks/serve_load.py asks (spread over the file's
    categories), then others spread likewise, up to ``total``."""

    def spread(pool: list[str], count: int) -> list[str]:
        return pool[:: max(1, len(pool) // count)][:count]

    chosen = spread(questions, base)
    if total > base:
        others = [q for q in questions if q not in set(chosen)]
        chosen += spread(others, total - base)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument(
        "--per-client",
        type=int,
        default=1,
        help="at C clients ask at least this many times C questions (a steady state in which "
        "a finished row's lane takes the next request, not one burst bound by its slowest row)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap", type=int, default=16, help="lookup proposal cap (oracle)")
    parser.add_argument("--perfect", type=int, nargs="*", default=[4, 8])
    parser.add_argument(
        "--fixed", type=int, nargs="*", default=[2], help="lookup drafts of fixed k, unpriced"
    )
    parser.add_argument("--output", type=Path, default=Path("results/serve/batched_oracle.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(dtype=DTYPES[args.dtype])
    questions = [q.turns[0] for q in load_questions(packaged_questions())]
    stop_ids = frozenset([tokenizer.eos_token_id])
    default = SpeculativeDecoder(model)
    methods = build_methods(default, cap=args.cap, perfect=args.perfect, fixed=args.fixed)
    env = {**environment(model, args.threads), **kernel_record(default.engine)}
    asked = {
        c: pass_questions(questions, args.requests, args.per_client * c) for c in args.concurrency
    }
    everything = sorted({q for chosen in asked.values() for q in chosen}, key=questions.index)
    prompt_of = {q: chat_prompt(tokenizer, q, "").tolist() for q in everything}
    # Record the answers (and warm every path) once, untimed.
    recorded = run_batch(methods["ar"](16), list(prompt_of.values()), 16, stop_ids)["answers"]
    ANSWERS.update({tuple(p): a for p, a in zip(prompt_of.values(), recorded, strict=True)})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for clients in args.concurrency:
        lanes = max(clients, 1)
        prompts = [prompt_of[q] for q in asked[clients]]
        reference = [ANSWERS[tuple(p)] for p in prompts]
        seen: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
        for name in methods:
            # Untimed: the default policy learns how batched passes of this width stray
            # from its cost model (a running server has); the others only warm up.
            run_batch(methods[name](lanes), prompts, clients, stop_ids)
        for repeat in range(args.repeats):
            order = list(methods) if repeat % 2 == 0 else list(reversed(methods))
            for name in order:
                result = run_batch(methods[name](lanes), prompts, clients, stop_ids)
                equal = sum(a == r for a, r in zip(result.pop("answers"), reference, strict=True))
                line = {
                    **env,
                    "method": name,
                    "concurrency": clients,
                    "requests": len(prompts),
                    "repeat": repeat,
                    "answers_equal_to_ar": equal,
                    **result,
                }
                append_jsonl(args.output, json.dumps(line))
                seen[name].append(line)
                print(
                    f"C={clients:<2d} {name:14s} {result['output_tokens_per_s']:6.1f} tok/s "
                    f"(decode {result['decode_tokens_per_s']:6.1f}), {result['rounds']} rounds, "
                    f"{result['accepted_tokens']}/{result['drafted_tokens']} accepted, "
                    f"equal {equal}/{len(prompts)}",
                    flush=True,
                )
        base = statistics.median(line["output_tokens_per_s"] for line in seen["ar"])
        base_decode = statistics.median(line["decode_tokens_per_s"] for line in seen["ar"])
        for name, lines in seen.items():
            overall = statistics.median(line["output_tokens_per_s"] for line in lines) / base
            decode = statistics.median(line["decode_tokens_per_s"] for line in lines) / base_decode
            print(f"C={clients:<2d} {name:14s} x ar: {overall:.2f} overall, {decode:.2f} decode")


if __name__ == "__main__":
    main()
