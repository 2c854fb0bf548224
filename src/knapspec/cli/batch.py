"""``knapspec generate --prompts-file FILE --batch-size B``: many prompts, JSONL out.

The prompts file holds one JSON value per line: a string (the prompt) or an object with a
``"prompt"`` string and an optional ``"id"`` (any JSON value, copied to the output). Blank
lines are skipped. Prompts are decoded ``B`` at a time with continuous batching
(:meth:`SpeculativeDecoder.generate_batch` with ``max_batch_rows=B``: a finished row's
slot goes to the next prompt at once), in waves of :data:`WAVE_BATCHES` ``× B`` prompts so
that results appear as the file is worked through. Each result is one JSON line
``{"index", "id", "completion", "stop_reason", "prompt_tokens", "new_tokens",
"drafted_tokens", "accepted_tokens"}`` on stdout (or ``--output``), in input order, and a
summary per wave goes to stderr.

Like the rest of :mod:`knapspec.cli`, it imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from knapspec.cli.inputs import encode_prompt, import_decoder, load_model
from knapspec.commandline import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from knapspec.config import DecoderConfig
    from knapspec.decoding.decoder import SpeculativeDecoder


#: Prompts per ``generate_batch`` call, in units of the batch size: more keeps every slot
#: busy for longer (a wave still ends with its slowest rows), fewer writes results sooner.
WAVE_BATCHES = 8


def generate_prompts_file(args: argparse.Namespace, config: DecoderConfig) -> int:
    """``--prompts-file``: decode every prompt of a JSONL file in batches, JSONL out."""
    for option in ("prompt", "prompt_file", "compare", "stream", "json"):
        if getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} cannot be combined with --prompts-file")
    prompts = read_prompts(args.prompts_file)
    model, tokenizer = load_model(args.model, getattr(args, "dtype", "float32"))
    decoder = import_decoder().from_config(model, config)
    generate_file(
        decoder,
        tokenizer,
        prompts,
        lambda text: encode_prompt(tokenizer, text, args.chat),
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        output=args.output,
    )
    return 0


def read_prompts(path: Path) -> list[tuple[Any, str]]:
    """``(id, prompt)`` per non-blank line of the JSONL file ``path``.

    Raises:
        UsageError: a missing or unreadable file, a line that is not JSON, not a
        string nor an object with a ``"prompt"`` string, an empty prompt, no prompts.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as reason:
        raise UsageError(f"cannot read prompts file {path}: {reason}") from None
    prompts: list[tuple[Any, str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as reason:
            raise UsageError(f"{path}, line {number}: not JSON ({reason.msg})") from None
        key: Any = None
        if isinstance(value, dict):
            key, value = value.get("id"), value.get("prompt")
        if not isinstance(value, str):
            raise UsageError(
                f'{path}, line {number}: expected a string or an object with a "prompt" string'
            )
        if not value.strip():
            raise UsageError(f"{path}, line {number}: the prompt is empty")
        prompts.append((key, value))
    if not prompts:
        raise UsageError(f"{path} holds no prompts")
    return prompts


def generate_file(
    decoder: SpeculativeDecoder,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[tuple[Any, str]],
    encode: Callable[[str], Any],
    *,
    batch_size: int,
    max_new_tokens: int,
    output: Path | None,
) -> None:
    """Decode ``prompts`` ``batch_size`` rows at a time (continuously batched, in waves of
    :data:`WAVE_BATCHES` batches) and write one JSON line per prompt, in input order."""
    stream = output.open("w", encoding="utf-8") if output is not None else sys.stdout
    wave = batch_size * WAVE_BATCHES
    try:
        for first in range(0, len(prompts), wave):
            chunk = prompts[first : first + wave]
            ids = [encode(text) for _, text in chunk]
            started = time.perf_counter()
            result = decoder.generate_batch(
                ids,
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                max_batch_rows=batch_size,
            )
            seconds = time.perf_counter() - started
            for offset, ((key, _), stats) in enumerate(zip(chunk, result.stats, strict=True)):
                record = {
                    "index": first + offset,
                    "id": key,
                    "completion": tokenizer.decode(
                        result.tokens[offset].tolist(), skip_special_tokens=True
                    ),
                    "stop_reason": stats.stop_reason,
                    "prompt_tokens": stats.prompt_tokens,
                    "new_tokens": stats.new_tokens,
                    "drafted_tokens": stats.drafted_tokens,
                    "accepted_tokens": stats.accepted_tokens,
                }
                stream.write(json.dumps(record) + "\n")
            stream.flush()
            print(
                f"prompts {first}-{first + len(chunk) - 1}: {result.new_tokens} new tokens in "
                f"{seconds:.2f} s ({result.new_tokens / seconds:.1f} tokens/s over the batch, "
                f"{min(batch_size, len(chunk))} rows at a time)",
                file=sys.stderr,
            )
    finally:
        if output is not None:
            stream.close()


__all__ = ["WAVE_BATCHES", "generate_file", "generate_prompts_file", "read_prompts"]
