"""``knapspec generate``: one prompt decoded, with a progress bar or streamed text.

The completion goes to stdout and a one-line summary to stderr (or one JSON object with
``--json``); ``--compare`` also decodes the prompt plainly and reports the speed ratio and
whether the tokens are identical. ``--prompts-file`` hands over to
:mod:`knapspec.cli.batch`. Like the rest of :mod:`knapspec.cli`, this module imports only
the standard library at the top.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from knapspec.cli.batch import generate_prompts_file
from knapspec.cli.inputs import (
    DEFAULT_CHAPTER,
    encode_prompt,
    import_decoder,
    load_model,
    read_prompt,
)
from knapspec.commandline import UsageError, load_decoder_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from knapspec.config import DecoderConfig


class GenerationStreamer:
    """A transformers-style streamer: a tqdm bar of committed tokens, text when streaming.

    The decoder calls ``put`` with the prompt first, then with each batch of committed
    tokens, then ``end``.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, total: int, *, stream_text: bool
    ) -> None:
        from tqdm.auto import tqdm
        from transformers import TextStreamer

        self._seen_prompt = False
        # Streaming text and a bar on the same terminal garble each other; pick one.
        self._bar = None if stream_text else tqdm(total=total, unit="tok", leave=False)
        self._text = TextStreamer(tokenizer, skip_prompt=True) if stream_text else None

    def put(self, value: torch.Tensor) -> None:
        if self._text is not None:
            self._text.put(value)  # type: ignore[no-untyped-call]
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if self._bar is not None:
            self._bar.update(int(value.numel()))

    def end(self) -> None:
        if self._text is not None:
            self._text.end()  # type: ignore[no-untyped-call]
        if self._bar is not None:
            self._bar.close()


def run_generate(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``generate`` subcommand; returns the exit code."""
    config = load_decoder_config(args.config, args.overrides)
    if args.prompts_file is not None:
        return generate_prompts_file(args, config)
    if args.output is not None:
        raise UsageError("--output is for --prompts-file; the completion goes to stdout")
    prompt = read_prompt(args)
    model, tokenizer = load_model(args.model, getattr(args, "dtype", "float32"))
    input_ids = encode_prompt(tokenizer, prompt, args.chat)
    decoder = import_decoder().from_config(model, config)
    if args.prompt is None and args.prompt_file is None:
        print(
            f"no --prompt given: summarising {DEFAULT_CHAPTER.rsplit('/', 1)[-1]} "
            f"({input_ids.numel()} prompt tokens)",
            file=sys.stderr,
        )
    if args.compare:
        _warm_up(model, config, decoder, input_ids)
    streamer = GenerationStreamer(tokenizer, args.max_new_tokens, stream_text=args.stream)
    result = decoder.generate(
        input_ids,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        streamer=streamer,
    )
    completion = tokenizer.decode(result.tokens.tolist(), skip_special_tokens=True)
    comparison = (
        _compare(model, config, input_ids, result, tokenizer.eos_token_id) if args.compare else None
    )
    if args.json:
        payload = {
            "completion": completion,
            "stats": result.stats.to_dict(),
            "config": config.to_dict(),
        }
        if comparison is not None:
            payload["compare"] = comparison
        print(json.dumps(payload, default=str))
    else:
        if not args.stream:
            print(completion)
        print(summary_line(result.stats), file=sys.stderr)
        if comparison is not None:
            print(comparison_lines(comparison), file=sys.stderr)
    return 0


def summary_line(stats: Any) -> str:
    """The one stderr line after a completion: speed, acceptance, time per stage."""
    reason = stats.no_draft_reason()
    return (
        f"{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, acceptance rate "
        f"{stats.acceptance_rate:.2f}{f' ({reason})' if reason else ''}, mean accepted length "
        f"{stats.mean_accepted_length:.2f} ({stats.rounds} rounds; plan {stats.plan_time_s:.2f} "
        f"s, lookup {stats.lookup_time_s:.3f} s, draft {stats.draft_time_s:.2f} s, verify "
        f"{stats.verify_time_s:.2f} s)"
    )


def comparison_lines(comparison: dict[str, Any]) -> str:
    """``--compare``'s two stderr lines: the speeds and ratio, then the planner's choices."""
    identical = comparison["identical_tokens"]
    same = (
        "sampled, so not compared token for token"
        if identical is None
        else ("identical tokens" if identical else "DIFFERENT TOKENS (please report a bug)")
    )
    speedup = comparison["speedup"]
    ratio = f"{speedup:.2f}x" if speedup is not None else "n/a"
    return (
        f"plain decoding: {comparison['plain_tokens_per_second']:.1f} tokens/s; speculative: "
        f"{comparison['tokens_per_second']:.1f} tokens/s = {ratio} the plain speed, {same}\n"
        f"the planner chose: {comparison['choices']}"
    )


def _compare(
    model: Any, config: DecoderConfig, input_ids: torch.Tensor, result: Any, eos: Any
) -> dict[str, Any]:
    """Plain decoding of the same prompt: speeds, identical tokens, the plan's choices."""
    from knapspec.planners import AutoregressivePlanner

    plain = import_decoder()(model, planner=AutoregressivePlanner(), sampling=config.sampling)
    baseline = plain.generate(input_ids, max_new_tokens=result.stats.new_tokens, eos_token_id=eos)
    speed = result.stats.tokens_per_second
    plain_speed = baseline.stats.tokens_per_second
    identical = (
        None
        if config.sampling.do_sample
        else bool(baseline.tokens.tolist() == result.tokens.tolist())
    )
    return {
        "plain_tokens_per_second": plain_speed,
        "tokens_per_second": speed,
        "speedup": speed / plain_speed if plain_speed > 0 else None,
        "identical_tokens": identical,
        "choices": result.stats.drafter_summary(),
    }


def _warm_up(model: Any, config: DecoderConfig, decoder: Any, input_ids: torch.Tensor) -> None:
    """One short call of each decoder, so neither timed call pays the first-call costs."""
    from knapspec.planners import AutoregressivePlanner

    head = input_ids[:64]
    decoder.generate(head, max_new_tokens=4)
    plain = import_decoder()(model, planner=AutoregressivePlanner(), sampling=config.sampling)
    plain.generate(head, max_new_tokens=4)


__all__ = ["GenerationStreamer", "comparison_lines", "run_generate", "summary_line"]
