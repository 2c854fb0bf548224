"""Text in and out: prompts to token ids, committed ids to text deltas with stop strings.

One tokenizer serves the routes (encoding) and the scheduler thread (decoding); Hugging
Face's fast tokenizers are not safe to call from two threads at once ("Already borrowed"),
so every call goes through :class:`SharedTokenizer`'s lock (calls take microseconds to a
few milliseconds).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SharedTokenizer:
    """A tokenizer behind a lock, with the few calls the server makes."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self.vocab_size = len(tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """``text``'s ids, with the tokenizer's special tokens (a BOS where it adds one)."""
        with self._lock:
            ids: list[int] = self.tokenizer(text).input_ids
        return ids

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """``messages`` rendered with the chat template, ready for the assistant's turn.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template: use /v1/completions with a "
                "prompt instead"
            )
        with self._lock:
            text: Any = self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=True, tokenize=False
            )
            # The template writes any BOS itself: add no special tokens a second time.
            ids: list[int] = self.tokenizer(str(text), add_special_tokens=False).input_ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return str(text)


class TextStream:
    """One request's committed ids as text deltas, cut at the first stop string.

    Each :meth:`push` decodes the whole output so far (outputs are short; this keeps
    multi-token characters and tokenizers' spacing rules right) and returns the text that
    is safe to send: it holds back an incomplete UTF-8 character (``"\\ufffd"`` at the
    end) and the last ``longest stop - 1`` characters, which a stop string may yet start
    in. When a stop string appears, the text before it is the rest of the answer.
    """

    def __init__(self, tokenizer: SharedTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already returned
        self.stopped = False  # a stop string was found
        self._text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Add committed ``ids``; the new text that may be sent now."""
        if self.stopped or not ids:
            return ""
        self.ids.extend(ids)
        self._text = self.tokenizer.decode(self.ids)
        if self.stop:
            # A stop string can only begin in the unsent text or the part held back.
            start = max(0, self.sent - self._hold)
            found = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
            if found:
                self.stopped = True
                return self._take(min(found))
        end = len(self._text) - self._hold
        while end > self.sent and self._text[end - 1] == "\ufffd":
            end -= 1
        return self._take(end)

    def finish(self) -> str:
        """The rest of the text once the row has stopped (what was held back)."""
        if self.stopped:
            return ""
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = self._text[self.sent : end]
        self.sent = end
        return delta


__all__ = ["SharedTokenizer", "TextStream"]
