"""Helpers of the serve tests: a tiny model directory and a real server process.

The model is a random 4-layer Llama with a word-level tokenizer and a chat template, saved
with ``save_pretrained`` so that ``knapspec serve --model DIR`` loads it as it would a real
one. It never generates ``[EOS]``, ``[UNK]`` or ``poison`` (greedy or sampled: their logits
are about -1000), so answers run to ``max_tokens`` and are words; ``poison``'s embedding
can be NaN (``poison=True``), so that a prompt containing it fails with non-finite logits
while the other requests go on.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "then", "it", "."]
WORDS += ["red", "blue", "big", "small", "saw", "bird", "tree", "sun", "moon", "day", "night"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
ROOT = Path(__file__).resolve().parents[1]


def save_tiny_model(path: Path, *, poison: bool = False, context: int = 1024) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    names = ["[UNK]", "[EOS]", "poison", "user", "assistant", "system", *WORDS]
    vocab = {word: index for index, word in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[EOS]")
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # Hidden dimension 0 holds a positive constant: every embedding starts with it and
        # no layer writes there, so after the final norm it is > 0 at every position, and
        # an output row of -1000 there (zeros elsewhere) gives a logit nobody samples.
        model.model.embed_tokens.weight[:, 0] = 0.05
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        head = model.lm_head.weight
        head.mul_(4)  # sharp logits: greedy near-ties are rare
        for never in ("[EOS]", "poison", "[UNK]"):
            head[vocab[never]] = 0
            head[vocab[never], 0] = -1000
        if poison:
            model.model.embed_tokens.weight[vocab["poison"]] = float("nan")
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", "PYTHONPATH": path}


class Server:
    """``knapspec serve`` in a subprocess on 127.0.0.1 and a free port."""

    def __init__(self, model: Path | str, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "knapspec.cli", "serve", "--model", str(model)]
        command += ["--port", str(self.port), "--threads", "1", "--log-level", "warning", *args]
        self.process = subprocess.Popen(
            command,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"the server did not get ready in {timeout} s")

    def output(self) -> str:
        if self.process.poll() is None:
            return ""
        assert self.process.stdout is not None
        return self.process.stdout.read()

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout=timeout)


@contextlib.contextmanager
def running(model: Path | str, *args: str, ready_timeout: float = 120) -> Iterator[Server]:
    server = Server(model, *args)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
