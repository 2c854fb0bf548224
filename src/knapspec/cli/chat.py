"""``knapspec chat``: an interactive conversation whose turns reuse the KV cache.

Each line typed is a user turn; the reply streams to stdout as it is committed, and a
line on stderr gives the turn's speed, acceptance, time to first token and how many of
its prompt tokens came from the cache. ``/reset`` starts over, ``/stats`` totals the
conversation, ``/exit`` (or end of input) quits. Ctrl-C stops the reply being generated
and keeps the conversation (the reply so far stays in it). When stdin is not a terminal
the lines are read from it as a scripted conversation, one user turn per line.
Like the rest of :mod:`knapspec.cli`, this module imports only the standard library at
the top.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from knapspec.cli.inputs import import_decoder, load_model
from knapspec.commandline import UsageError, load_decoder_config

PROMPT = "you> "
HELP = "commands: /reset (start over), /stats (totals), /help, /exit (or Ctrl-D)"


class ChatTotals:
    """Counters over a conversation's turns, for ``/stats``."""

    def __init__(self) -> None:
        self.turns = 0
        self.new_tokens = 0
        self.seconds = 0.0
        self.prefill_seconds = 0.0
        self.drafted = 0
        self.accepted = 0
        self.cached_prompt_tokens = 0
        self.prompt_tokens = 0

    def add(self, stats: Any) -> None:
        self.turns += 1
        self.new_tokens += stats.new_tokens
        self.seconds += stats.wall_time_s
        self.prefill_seconds += stats.prefill_time_s
        self.drafted += stats.drafted_tokens
        self.accepted += stats.accepted_tokens
        self.cached_prompt_tokens += stats.cached_prompt_tokens
        self.prompt_tokens += stats.prompt_tokens


def turn_line(stats: Any) -> str:
    """The stderr line after a reply."""
    return (
        f"[{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, acceptance "
        f"{stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}, "
        f"time to first token {stats.prefill_time_s:.2f} s, {stats.cached_prompt_tokens}/"
        f"{stats.prompt_tokens} prompt tokens cached]"
    )


def stats_lines(totals: ChatTotals, conversation: Any) -> str:
    """``/stats``: the conversation's totals."""
    speed = totals.new_tokens / totals.seconds if totals.seconds > 0 else 0.0
    acceptance = totals.accepted / totals.drafted if totals.drafted else 0.0
    ttft = totals.prefill_seconds / totals.turns if totals.turns else 0.0
    return (
        f"[{totals.turns} turns, {len(conversation.messages)} messages, "
        f"{conversation.tokens.numel()} tokens in the conversation, "
        f"{conversation.cached_tokens} of them cached "
        f"({conversation.cache_bytes() / (1 << 20):.1f} MiB of KV cache)]\n"
        f"[{totals.new_tokens} tokens generated, {speed:.1f} tokens/s, acceptance "
        f"{acceptance:.2f}, mean time to first token {ttft:.2f} s, "
        f"{totals.cached_prompt_tokens}/{totals.prompt_tokens} prompt tokens cached]"
    )


class ReplyStreamer:
    """Prints committed tokens as text as soon as they decode to whole characters (a
    transformers ``TextStreamer`` that skips the prompt and special tokens)."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        from transformers import TextStreamer

        self.out = out
        self._text = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._text.on_finalized_text = self._print  # type: ignore[method-assign]

    def _print(self, text: str, stream_end: bool = False) -> None:
        self.out.write(text + ("\n" if stream_end else ""))
        self.out.flush()

    def put(self, value: Any) -> None:
        self._text.put(value)  # type: ignore[no-untyped-call]

    def end(self) -> None:
        self._text.end()  # type: ignore[no-untyped-call]


def _lines(interactive: bool, stdin: TextIO) -> Any:
    """The user's lines: typed at a prompt on a terminal, else read from stdin."""
    while True:
        if interactive:
            try:
                line = input(PROMPT)
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line, not an exit
                print(f"\n({HELP})", file=sys.stderr)
                continue
            except EOFError:
                print(file=sys.stderr)
                return
        else:
            line = stdin.readline()
            if not line:
                return
        yield line.rstrip("\n")


def _interruptible() -> None:
    """Make Ctrl-C raise ``KeyboardInterrupt`` even when SIGINT came in ignored.

    A process started in the background by a non-interactive shell (``cmd &`` in a script)
    inherits SIGINT as ignored, and Python then installs no handler; a chat on a terminal
    promises that Ctrl-C stops the reply, so it takes the signal back.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_chat(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``chat`` subcommand; returns the exit code."""
    config = load_decoder_config(args.config, args.overrides)
    model, tokenizer = load_model(args.model, getattr(args, "dtype", "float32"))
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(
            "knapspec chat needs a model whose tokenizer has a chat template; this one has "
            "none (a base model such as gemma-3-270m): use knapspec generate to continue text"
        )
    decoder = import_decoder().from_config(model, config)
    conversation = decoder.conversation(tokenizer, system=args.system)
    from knapspec.model.engine import ContextLengthError

    interactive = sys.stdin.isatty()
    if interactive:
        _interruptible()
        print(f"knapspec chat ({HELP})", file=sys.stderr)
    totals = ChatTotals()
    for line in _lines(interactive, sys.stdin):
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                conversation.reset()
                totals = ChatTotals()
                print("[conversation reset]", file=sys.stderr)
            elif command == "/stats":
                print(stats_lines(totals, conversation), file=sys.stderr)
            else:
                print(f"[{HELP}]", file=sys.stderr)
            continue
        streamer = ReplyStreamer(tokenizer, sys.stdout)
        try:
            turn = conversation.send(text, max_new_tokens=args.max_new_tokens, streamer=streamer)
        except KeyboardInterrupt:
            print("\n[interrupted: the reply so far stays in the conversation]", file=sys.stderr)
            continue
        except ContextLengthError as error:
            print(f"[{error}; /reset to start over]", file=sys.stderr)
            continue
        totals.add(turn.result.stats)
        print(turn_line(turn.result.stats), file=sys.stderr, flush=True)
    return 0


__all__ = ["ChatTotals", "ReplyStreamer", "run_chat", "stats_lines", "turn_line"]
