"""``knapspec generate --prompts-file FILE --batch-size B``: many prompts, JSONL out.

The prompts file holds one JSON value per line: a string (the prompt) or an object with a
``"prompt"`` string and an optional ``"id"`` (any JSON value, copied to the output). Blank
lines are skipped. Prompts are decoded ``B`` at a time (:meth:`SpeculativeDecoder.generate`
with a list of sequences); each result is one JSON line ``{"index", "id", "completion",
"stop_reason", "prompt_tokens", "new_tokens", "drafted_tokens", "accepted_tokens"}`` on
stdout (or ``--output``), in input order, and a summary per batch goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from knapspec.decoding.decoder import SpeculativeDecoder


def read_prompts(path: Path, error: Callable[[str], Exception]) -> list[tuple[Any, str]]:
    """``(id, prompt)`` per non-blank line of the JSONL file ``path``.

    Raises:
        ``error(message)``: a missing or unreadable file, a line that is not JSON, not a
        string nor an object with a ``"prompt"`` string, an empty prompt, no prompts.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise error(f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as reason:
        raise error(f"cannot read prompts file {path}: {reason}") from None
    prompts: list[tuple[Any, str]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as reason:
            raise error(f"{path}, line {number}: not JSON ({reason.msg})") from None
        key: Any = None
        if isinstance(value, dict):
            key, value = value.get("id"), value.get("prompt")
        if not isinstance(value, str):
            raise error(
                f'{path}, line {number}: expected a string or an object with a "prompt" string'
            )
        if not value.strip():
            raise error(f"{path}, line {number}: the prompt is empty")
        prompts.append((key, value))
    if not prompts:
        raise error(f"{path} holds no prompts")
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
    """Decode ``prompts`` ``batch_size`` at a time and write one JSON line per prompt."""
    stream = output.open("w", encoding="utf-8") if output is not None else sys.stdout
    try:
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            ids = [encode(text) for _, text in chunk]
            started = time.perf_counter()
            result = decoder.generate(
                ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id
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
                f"{seconds:.2f} s ({result.new_tokens / seconds:.1f} tokens/s over the batch)",
                file=sys.stderr,
            )
    finally:
        if output is not None:
            stream.close()


__all__ = ["generate_file", "read_prompts"]
