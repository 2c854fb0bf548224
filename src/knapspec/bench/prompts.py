"""Real-text prompts for the benchmark scenarios (the protocol: :mod:`knapspec.bench.runner`).

Text comes from Jane Austen's novels in ``shared/data/austen`` (found via
``$KNAPSPEC_DATA`` or next to the working directory / repository) and falls back to
CPython's own ``pydoc_data.topics`` (Python's documentation, on every machine).
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter
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


def corpus_file(name: str) -> Path:
    """The corpus file ``name`` (e.g. ``"prideprejudice.txt"``) from the first data
    directory holding it (``$KNAPSPEC_DATA``, or ``shared/data/austen`` next to the working
    directory or the repository).

    Raises:
        FileNotFoundError: no data directory holds it (the message says where to put it).
    """
    for directory in _candidate_dirs():
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(
        f"{name} not found; set KNAPSPEC_DATA to the directory holding it, or put it in "
        "shared/data/austen next to the repository"
    )


@cache
def corpus() -> tuple[str, str]:
    """``(name, text)`` of the benchmark corpus: Austen if present, else pydoc topics."""
    for directory in _candidate_dirs():
        files = sorted(directory.glob("*.txt")) if directory.is_dir() else []
        if files:
            text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
            return f"austen:{directory}", text
    return "pydoc_data.topics", pydoc_corpus()


@cache
def pydoc_corpus() -> str:
    """CPython's documentation topics (``pydoc_data.topics``): technical text on every machine."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def passage(tokenizer: Any, num_tokens: int, seed: int = 0, text: str | None = None) -> str:
    """A passage of about ``num_tokens`` tokens of ``text`` (default: the benchmark corpus)
    starting at a random paragraph."""
    text = corpus()[1] if text is None else text
    rng = random.Random(seed)
    start = rng.randrange(0, max(1, len(text) - num_tokens * 8))
    start = text.find("\n\n", start) + 2 if text.find("\n\n", start) >= 0 else start
    chunk = text[start : start + num_tokens * 8]
    ids = tokenizer(chunk, add_special_tokens=False)["input_ids"][:num_tokens]
    return str(tokenizer.decode(ids))


def chat_prompt(
    tokenizer: Any, instruction: str, body: str, *, assistant_primer: str = ""
) -> torch.Tensor:
    """Token ids ``(n,)`` of a user turn with the chat template (when the tokenizer has one).

    Args:
        assistant_primer: text that opens the assistant's new turn (appended after the
            template's generation prompt), so that the model continues it.
    """
    content = f"{instruction}\n\n{body}" if body else instruction
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = list(ids)
    else:
        ids = list(tokenizer(content)["input_ids"])
    if assistant_primer:
        ids += tokenizer(assistant_primer, add_special_tokens=False)["input_ids"]
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


QUOTE_PARAGRAPH = (
    'Which paragraph of the passage begins with the words "{cue}"? Quote the whole '
    "paragraph exactly, word for word."
)
QUOTE_ABOUT = (
    "What does the passage say about {name}? Answer with quotes from the text: quote every "
    "sentence that mentions {name}, word for word."
)
#: Words of the quoted paragraph's opening given as the question's cue (and primer).
QUOTE_CUE_WORDS = 8
_NAME = re.compile(r"(?<=[a-z,;] )([A-Z][a-z]{2,})\b")


def _opening(text: str, words: int) -> str:
    """The first ``words`` words of ``text``, its own whitespace (line breaks) kept."""
    match = re.match(rf"\s*((?:\S+\s+){{{max(0, words - 1)}}}\S+)", text)
    return match.group(1) if match else text.strip()


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if len(p.split()) >= 2 * QUOTE_CUE_WORDS]


def quote_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Question answering that quotes a document: a passage of about ``num_tokens`` tokens
    and a question answered by quoting it.

    Even seeds ask for the paragraph that begins with given words (the assistant's turn is
    opened with them, inside a quotation mark); odd seeds ask what the passage says about
    its most mentioned name, answered with quotes (opened with the name's first sentence's
    start). Without the opening a 135M model answers in its own words after a few tokens;
    with it, it quotes. Falls back to the paragraph question when no sentence of the passage
    opens with a name (e.g. Python's documentation, the corpus without Austen).
    """
    text = passage(tokenizer, num_tokens, seed)
    paragraphs = _paragraphs(text)
    rng = random.Random(seed)
    names = Counter(_NAME.findall(text))
    if seed % 2 == 1 and names:
        name = names.most_common(1)[0][0]
        sentence_start = next(
            (s for s in re.split(r"(?<=[.!?])\s+", text) if name in s.split()[:QUOTE_CUE_WORDS]),
            "",
        )
        opening = _opening(sentence_start, QUOTE_CUE_WORDS)
        if opening:
            primer = f'The passage says about {name}:\n\n"{opening}'
            return chat_prompt(
                tokenizer, QUOTE_ABOUT.format(name=name), text, assistant_primer=primer
            )
    # A paragraph from the middle third: the question is not about the passage's opening.
    third = len(paragraphs) // 3
    middle = paragraphs[third : max(third + 1, 2 * third)]
    chosen = rng.choice(middle or paragraphs or [text])
    cue = _opening(chosen, QUOTE_CUE_WORDS)
    return chat_prompt(
        tokenizer,
        QUOTE_PARAGRAPH.format(cue=cue),
        text,
        assistant_primer=f'The paragraph is:\n\n"{cue}',
    )


#: (word, replacement) pairs for the edit scenario; each prompt uses the pair whose word
#: occurs most often in its passage.
EDIT_REPLACEMENTS = (
    ("list", "array"),
    ("object", "value"),
    ("function", "procedure"),
    ("statement", "command"),
    ("class", "type"),
    ("module", "package"),
    ("string", "text"),
    ("method", "operation"),
)
EDIT = (
    "Rewrite the following text, replacing every '{word}' by '{replacement}', otherwise unchanged."
)
#: Words of the edited passage's opening written into the assistant's new turn.
EDIT_PRIMER_WORDS = 12


def edit_prompt(tokenizer: Any, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Editing a passage: rewrite about ``num_tokens`` tokens of Python's documentation
    (``pydoc_data.topics``) with one word replaced, otherwise unchanged.

    The assistant's turn is opened with the edited passage's first ``EDIT_PRIMER_WORDS``
    words (the replacement applied), as copy prompts are primed: a 135M model then copies
    the text and makes (some of) the edits.
    """
    text = passage(tokenizer, num_tokens, seed, text=pydoc_corpus())
    counts = {word: len(re.findall(rf"\b{word}\b", text)) for word, _ in EDIT_REPLACEMENTS}
    word, replacement = max(EDIT_REPLACEMENTS, key=lambda pair: counts[pair[0]])
    edited = re.sub(rf"\b{word}\b", replacement, text)
    opening = _opening(edited, EDIT_PRIMER_WORDS)
    return chat_prompt(
        tokenizer,
        EDIT.format(word=word, replacement=replacement),
        text,
        assistant_primer=opening,
    )


LONG_GENERATION_TOPICS = (
    "Write a long, detailed story about a family moving to a new town.",
    "Explain in detail how a steam engine works, step by step.",
    "Write a long essay about the history of letter writing.",
    "Describe a week in the life of a lighthouse keeper, day by day.",
)


def long_generation_prompt(tokenizer: Any, seed: int = 0) -> torch.Tensor:
    """A short instruction asking for a long answer."""
    return chat_prompt(tokenizer, LONG_GENERATION_TOPICS[seed % len(LONG_GENERATION_TOPICS)], "")
