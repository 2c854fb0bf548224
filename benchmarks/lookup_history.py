"""What the lookup drafter's history buys: a second question on a document asked before.

For each document (an Austen passage of about ``--tokens`` tokens), the default decoder with
``drafters.lookup.history_tokens`` set first answers "summarise it" (the first call, timed
too), then a second question on the same document. The same second question is asked of
the default decoder without history (a cold call). The two second calls are interleaved,
their order alternating per document, greedy with no stop token, on one engine; their
tokens must be identical. Reported per call: wall time, prefill, the decode phase (wall -
prefill), drafted and accepted tokens.

    python benchmarks/lookup_history.py [--tokens 2048] [--documents 3]
        [--new-tokens 128] [--history-tokens 16384] [--threads 2]

Each call is appended to ``--output`` as one JSON line; a summary line ends the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from knapspec import SpeculativeDecoder
from knapspec.bench.env import environment
from knapspec.bench.prompts import SUMMARISE, chat_prompt, passage
from knapspec.model.loading.provision import load_model_and_tokenizer

SECOND_QUESTION = (
    "Which characters appear in the following passage? For each, quote the sentence where "
    "they first appear."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--history-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path("results/drafters/history.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(progress=False)
    history = SpeculativeDecoder(
        model, {"drafters": {"lookup": {"history_tokens": args.history_tokens}}}
    )
    cold = SpeculativeDecoder(history.engine)
    env = environment(model, args.threads)
    command = "python " + " ".join(sys.argv)
    # No stop token: SmolLM2 ends some 2k-token summaries at once, which leaves no decode
    # phase to compare; every call writes --new-tokens tokens.
    eos = None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    warm = chat_prompt(tokenizer, SUMMARISE, passage(tokenizer, 128, seed=99))
    for decoder in (history, cold):
        decoder.generate(warm, max_new_tokens=16, eos_token_id=eos)
    ratios, first_ratios = [], []
    for index in range(args.documents):
        document = passage(tokenizer, args.tokens, seed=index)
        first_prompt = chat_prompt(tokenizer, SUMMARISE, document)
        second_prompt = chat_prompt(tokenizer, SECOND_QUESTION, document)
        history.drafters["lookup"].clear_history()  # type: ignore[attr-defined]
        rows: dict[str, dict[str, Any]] = {}
        rows["first call"] = _call(history, first_prompt, args.new_tokens, eos)
        arms = [("second call, history", history), ("second call, cold", cold)]
        if index % 2 == 1:
            arms.reverse()
        for name, decoder in arms:
            if decoder is cold:
                cold.drafters["lookup"].clear_history()  # type: ignore[attr-defined]
            rows[name] = _call(decoder, second_prompt, args.new_tokens, eos)
        same = rows["second call, history"]["tokens"] == rows["second call, cold"]["tokens"]
        ratios.append(
            rows["second call, cold"]["decode_s"] / rows["second call, history"]["decode_s"]
        )
        first_ratios.append(
            rows["first call"]["decode_s"] / rows["second call, history"]["decode_s"]
        )
        for name, row in rows.items():
            record = {
                "document": index,
                "call": name,
                "prompt_tokens": row.pop("prompt_tokens"),
                **{k: v for k, v in row.items() if k != "tokens"},
                "new_tokens": len(row["tokens"]),
                "second_calls_equal": same,
            }
            print(json.dumps(record), flush=True)
            with args.output.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({**record, **env, "command": command}) + "\n")
    summary = {
        "summary": True,
        "decode-phase speed-up of the second call, history vs cold (median)": statistics.median(
            ratios
        ),
        "per document": ratios,
        "first call's decode phase / second call's with history (median)": statistics.median(
            first_ratios
        ),
    }
    print(json.dumps(summary), flush=True)
    with args.output.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({**summary, **env, "command": command}) + "\n")


def _call(
    decoder: SpeculativeDecoder, prompt: torch.Tensor, new_tokens: int, eos: int | None
) -> dict[str, Any]:
    result = decoder.generate(prompt, max_new_tokens=new_tokens, eos_token_id=eos)
    stats = result.stats
    return {
        "prompt_tokens": prompt.numel(),
        "wall_time_s": stats.wall_time_s,
        "prefill_s": stats.prefill_time_s,
        "decode_s": stats.wall_time_s - stats.prefill_time_s,
        "drafted": stats.drafted_tokens,
        "accepted": stats.accepted_tokens,
        "tokens": result.tokens.tolist(),
    }


if __name__ == "__main__":
    main()
