"""Real-text prompts for the benchmark scenarios (bench-protocol.md).

Text comes from Jane Austen's novels in ``shared/data/austen`` (found via
``$KNAPSPEC_DATA`` or next to the working directory / repository) and falls back to
CPython's own ``pydoc_data.topics`` (Python's documentation, on every machine).
"""

from __future__ import annotations

import os
import random
from functools import cache
from pathlib import Path
from typing import Any

import torch

SUMMARISE = "Summarize the following passage in a few sentences."
COPY = "Copy the following passage exactly, word for word."


def _candidate_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("KNAPSPEC_DATA"):
        dirs.append(Path(os.environ["KNAPSPEC_DATA"]))
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *Path.cwd().parents, *here.parents]:
        dirs.append(base / "shared" / "data" / "austen")
        dirs.append(base.parent / "shared" / "data" / "austen")
    return dirs


@cache
def corpus() -> tuple[str, str]:
    """``(name, text)`` of the benchmark corpus: Austen if present, else pydoc topics."""
    for directory in _candidate_dirs():
        files = sorted(directory.glob("*.txt")) if directory.is_dir() else []
        if files:
            text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
            return f"austen:{directory}", text
    from pydoc_data.topics import topics

    return "pydoc_data.topics", "\n\n".join(topics[key] for key in sorted(topics))


def passage(tokenizer: Any, num_tokens: int, seed: int = 0) -> str:
    """A passage of about ``num_tokens`` tokens starting at a random paragraph."""
    _, text = corpus()
    rng = random.Random(seed)
    start = rng.randrange(0, max(1, len(text) - num_tokens * 8))
    start = text.find("\n\n", start) + 2 if text.find("\n\n", start) >= 0 else start
    chunk = text[start : start + num_tokens * 8]
    ids = tokenizer(chunk, add_special_tokens=False)["input_ids"][:num_tokens]
    return str(tokenizer.decode(ids))


def chat_prompt(tokenizer: Any, instruction: str, body: str) -> torch.Tensor:
    """Token ids ``(n,)`` of a user turn with the chat template (when the tokenizer has one)."""
    content = f"{instruction}\n\n{body}" if body else instruction
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(content)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def long_input_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """'Summarize the following passage' + about ``num_tokens`` tokens of text."""
    return chat_prompt(tokenizer, SUMMARISE, passage(tokenizer, num_tokens, seed))


#: Tokens of the passage's opening written into the assistant's new turn of a copy prompt.
COPY_PRIMER_TOKENS = 32
COPY_AGAIN = "Copy it once more, exactly as before."


def copy_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Copy-heavy: a second verbatim copy of a passage the conversation already copied once.

    The chat holds the user's request to copy a passage of about ``num_tokens / 2`` tokens,
    the assistant's exact copy, and the user's request for one more copy; the new assistant
    turn is opened with the passage's first ``COPY_PRIMER_TOKENS`` tokens. Asked only once,
    a 135M model paraphrases after a few words (measured: diverges after 1-7 tokens at
    N = 2048); with its own earlier copy in context it copies (128 of 128 tokens verbatim at
    N = 4096) — the copy-heavy regime where deep drafts still agree with the target.
    """
    text = passage(tokenizer, max(1, num_tokens // 2), seed)
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "user", "content": f"{COPY}\n\n{text}"},
            {"role": "assistant", "content": text},
            {"role": "user", "content": COPY_AGAIN},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(f"{COPY}\n\n{text}\n\n{text}\n\n{COPY_AGAIN}\n\n")["input_ids"]
    return torch.tensor(list(ids) + body[:COPY_PRIMER_TOKENS], dtype=torch.long)


LONG_GENERATION_TOPICS = (
    "Write a long, detailed story about a family moving to a new town.",
    "Explain in detail how a steam engine works, step by step.",
    "Write a long essay about the history of letter writing.",
    "Describe a week in the life of a lighthouse keeper, day by day.",
)


def long_generation_prompt(tokenizer: Any, seed: int = 0) -> torch.Tensor:
    """A short instruction asking for a long answer."""
    return chat_prompt(tokenizer, LONG_GENERATION_TOPICS[seed % len(LONG_GENERATION_TOPICS)], "")
