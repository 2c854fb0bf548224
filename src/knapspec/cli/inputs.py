"""What ``generate`` and ``plan`` read: the prompt, the model and tokenizer, the decoder class.

Each failure the user can act on becomes a :class:`~knapspec.commandline.UsageError` (bad
input) or a :class:`~knapspec.commandline.RunError` (the model would not load). Torch,
transformers and the library are imported inside the functions (see :mod:`knapspec.cli`).
"""

from __future__ import annotations

import argparse
import importlib
from typing import TYPE_CHECKING, Any

from knapspec.commandline import RunError, UsageError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


#: The chapter ``knapspec generate`` summarises when given no prompt (package data).
DEFAULT_CHAPTER = "data/pride_and_prejudice_chapter3.txt"
DEFAULT_INSTRUCTION = "Summarize the following chapter in a few sentences."


def default_prompt() -> str:
    """The instruction and the shipped public-domain chapter (about 2,200 tokens)."""
    from importlib.resources import files

    chapter = files("knapspec").joinpath(DEFAULT_CHAPTER).read_text(encoding="utf-8")
    return f"{DEFAULT_INSTRUCTION}\n\n{chapter}"


def read_prompt(args: argparse.Namespace) -> str:
    """``--prompt`` or ``--prompt-file``'s text, or :func:`default_prompt` without either."""
    if args.prompt is None and getattr(args, "prompt_file", None) is None:
        return default_prompt()
    if args.prompt_file is not None:
        try:
            text: str = args.prompt_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"prompt file not found: {args.prompt_file}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read prompt file {args.prompt_file}: {error}") from None
    else:
        text = args.prompt
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def load_model(
    name_or_path: str, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``--model`` and ``--dtype``: :func:`knapspec.model.loading.by_name.load_model` (which the
    server calls too), its errors turned into the command's two kinds."""
    from knapspec.model.loading.by_name import ModelLoadError, ModelPathError
    from knapspec.model.loading.by_name import load_model as load
    from knapspec.model.loading.provision import ProvisioningError

    try:
        return load(name_or_path, dtype)
    except ModelPathError as error:
        raise UsageError(f"--model {error}") from None
    except (ProvisioningError, ModelLoadError) as error:
        raise RunError(str(error)) from error


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool | None) -> torch.Tensor:
    """``(n,)`` prompt token ids, wrapped in the chat template when asked (or by default)."""
    import torch

    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise UsageError(
            "--chat: this model's tokenizer has no chat template (a base model such as "
            "gemma-3-270m continues text: drop --chat)"
        )
    if use_chat:
        messages = [{"role": "user", "content": text}]
        text = str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if len(ids) == 0:
        raise UsageError("the prompt encodes to no tokens")
    return torch.tensor(ids, dtype=torch.long)


def import_decoder() -> Any:
    """The ``SpeculativeDecoder`` class, imported on use (it pulls in torch)."""
    try:
        module = importlib.import_module("knapspec.decoding.decoder")
    except ModuleNotFoundError as error:
        if error.name != "knapspec.decoding.decoder":
            raise
        raise RunError("the speculative decoder is not available in this installation") from None
    return module.SpeculativeDecoder


__all__ = [
    "DEFAULT_CHAPTER",
    "DEFAULT_INSTRUCTION",
    "default_prompt",
    "encode_prompt",
    "import_decoder",
    "load_model",
    "read_prompt",
]
