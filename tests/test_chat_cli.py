"""``knapspec chat``: a scripted conversation through a pipe, and a terminal session
through a pseudo-terminal (stdlib ``pty``): streamed replies, per-turn stats, ``/stats``,
``/reset``, Ctrl-C mid-reply keeping the conversation, Ctrl-D quitting.

Both run ``python -m knapspec.cli chat`` in a subprocess on tiny random Llamas saved with a
word-level tokenizer and a chat template (their replies are random words).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "then", "it", "."]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
STATIC = ["--set", "planner.name=static", "--set", "planner.draft_length=2"]


def _save(path: Path, *, hidden: int, layers: int, context: int, eos: bool) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["[UNK]", "[EOS]", "user", "assistant", "system", *WORDS]
    vocab = {word: index for index, word in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"eos_token": "[EOS]"} if eos else {}
    # [UNK] is an ordinary token here, so that every generated id prints as a word.
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=1 if eos else None,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer random Llama with a 4,096-token context (long scripted chats fit)."""
    return _save(tmp_path_factory.mktemp("chat"), hidden=32, layers=4, context=4096, eos=True)


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "PYTHONPATH": path}


def _command(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "knapspec.cli", "chat", "--model", str(model), *STATIC, *extra]


TURN = re.compile(
    r"\[(\d+) tokens, [\d.]+ tokens/s, acceptance [\d.]+, mean accepted length [\d.]+, "
    r"time to first token [\d.]+ s, (\d+)/(\d+) prompt tokens cached\]"
)


def test_a_scripted_conversation_through_a_pipe(model_dir: Path) -> None:
    script = "the cat sat\n/stats\na dog ran far\n\n/reset\nthe mat\n/nonsense\n"
    result = subprocess.run(
        _command(model_dir, "--max-new-tokens", "12"),
        input=script,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    turns = [tuple(map(int, m.groups())) for m in TURN.finditer(result.stderr)]
    assert len(turns) == 3, result.stderr
    (new1, cached1, prompt1), (_, cached2, prompt2), (_, cached3, prompt3) = turns
    assert cached1 == 0 and 1 <= new1 <= 12
    # Turn 2 prefills only its new tokens: the first turn's prompt and reply are cached.
    assert cached2 >= prompt1 + new1 - 2 and prompt2 > cached2
    assert cached3 == 0 and prompt3 < prompt2  # after /reset: a fresh conversation
    assert "[1 turns, 2 messages" in result.stderr  # /stats after the first turn
    assert "[conversation reset]" in result.stderr
    assert "commands: /reset" in result.stderr  # the unknown command gets the help
    assert len(result.stdout.strip().splitlines()) == 3  # one streamed reply per turn


def test_chat_needs_a_chat_template(tmp_path: Path) -> None:
    model = _save(tmp_path / "m", hidden=32, layers=2, context=256, eos=True)
    config = (model / "tokenizer_config.json").read_text()
    (model / "tokenizer_config.json").write_text(config.replace('"chat_template"', '"x"'))
    for template in model.glob("chat_template.*"):
        template.unlink()
    result = subprocess.run(
        _command(model), input="hello\n", capture_output=True, text=True, env=_env(), timeout=300
    )
    assert result.returncode == 2, result.stderr
    assert "chat template" in result.stderr and "Traceback" not in result.stderr


# ------------------------------------------------------------------ terminal
class Terminal:
    """A child process on a pseudo-terminal, read with timeouts (what pexpect does)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the command
            os.execvpe(command[0], command, env)
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 120) -> str:
        """Everything read up to the first match of ``pattern`` after what was consumed."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.seen)
            if match:
                before, self.seen = self.seen[: match.end()], self.seen[match.end() :]
                return before
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; got {self.seen!r}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"EOF waiting for {pattern!r}; got {self.seen!r}")
                self.seen += chunk.decode(errors="replace").replace("\r\n", "\n")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining so that the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.1)[0]:
                    os.read(self.fd, 4096)
            except OSError:
                pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError("the chat did not exit")

    def close(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_a_terminal_session_streams_survives_ctrl_c_and_quits_on_ctrl_d(
    tmp_path: Path,
) -> None:
    # Wider, deeper and without EOS, so that a long reply takes seconds: Ctrl-C lands in
    # the middle of it.
    model = _save(tmp_path / "slow", hidden=128, layers=6, context=8192, eos=False)
    terminal = Terminal(_command(model, "--max-new-tokens", "8000"), _env())
    try:
        # A fresh machine measures the kernels for this model's shapes first (46 s on a
        # loaded 2-core Zen 4, past the 120 s default with the rest of the start-up).
        terminal.read_until(r"you> ", timeout=600)
        terminal.send("the cat sat\n")
        terminal.read_until(r"the cat sat\n")  # the terminal's echo
        terminal.read_until(r"(\S+ ){3}")  # the reply streams
        terminal.send("\x03")  # Ctrl-C
        terminal.read_until(r"\[interrupted: the reply so far stays in the conversation\]")
        terminal.read_until(r"you> ")
        terminal.send("/stats\n")
        stats = terminal.read_until(r"prompt tokens cached\]\n")
        assert "[0 turns, 2 messages" in stats  # the user turn and the partial reply
        tokens = int(re.search(r"(\d+) tokens in the conversation", stats).group(1))  # type: ignore[union-attr]
        assert 8 < tokens < 8000
        terminal.read_until(r"you> ")
        terminal.send("/reset\n")
        terminal.read_until(r"\[conversation reset\]")
        terminal.read_until(r"you> ")
        terminal.send("\x04")  # Ctrl-D
        assert terminal.wait() == 0
    finally:
        terminal.close()
