"""Load a model by the name a user gives: the default alias or a local directory, in a dtype.

The command line (``knapspec generate``, ``chat``, ``plan``, ...) and the server
(``knapspec serve``) load their model through :func:`load_model`, so both read ``--model``
and ``--dtype`` the same way; each turns the two errors below into its own report (a
usage error or a failed run on the command line, a broken ``/health`` on the server).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from knapspec.model.loading.dtypes import DTYPES, choose_dtype
from knapspec.model.loading.provision import KNOWN_MODELS, is_known_model, load_model_and_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ModelPathError(ValueError):
    """The model name is neither a known model (or alias) nor a transformers model
    directory."""


class ModelLoadError(RuntimeError):
    """The directory's weights, tokenizer or config would not load; the message says why."""


def check_model_path(name_or_path: str) -> None:
    """Accept a known model's name or alias (``default``, ``gemma-3-270m``, ...) or a
    directory holding a ``config.json``.

    Raises:
        ModelPathError: no such directory, or one without a ``config.json``.
    """
    if is_known_model(name_or_path):
        return
    if not Path(name_or_path).is_dir():
        raise ModelPathError(
            f"{name_or_path!r}: no such directory; give a known model "
            f"('default', {', '.join(map(repr, KNOWN_MODELS))}) or the path of a local "
            "transformers model "
            "directory"
        )
    if not (Path(name_or_path) / "config.json").is_file():
        raise ModelPathError(
            f"{name_or_path!r}: not a transformers model directory (it has no "
            "config.json); give 'default' or a directory written by save_pretrained"
        )


def load_model(
    name_or_path: str, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A known model (provisioned on first use) or a local directory, in ``dtype``.

    ``dtype`` is ``float32``, ``bfloat16`` or ``auto``, resolved by
    :func:`knapspec.model.loading.dtypes.choose_dtype`: ``auto`` loads float32 and measures a
    bfloat16 copy only on CPUs with bf16 units; the choice and its reason go to stderr.

    Raises:
        ModelPathError: see :func:`check_model_path`.
        ProvisioningError: a known model could not be provisioned.
        ModelLoadError: the directory would not load.
    """
    check_model_path(name_or_path)
    try:
        model, tokenizer = load_model_and_tokenizer(
            name_or_path, dtype=DTYPES.get(dtype, torch.float32), progress=True
        )
        if dtype == "auto":
            choice = choose_dtype("auto", model)
            if choice.dtype != torch.float32:
                torch.nn.Module.to(model, choice.dtype)  # in place, parameters and buffers
            print(f"knapspec: dtype {choice.name} ({choice.reason})", file=sys.stderr)
        return model, tokenizer
    # A directory without loadable weights / tokenizer, or a config transformers rejects.
    except (OSError, ValueError, KeyError) as error:
        reason = " ".join(str(error).split())
        raise ModelLoadError(f"cannot load model from {name_or_path!r}: {reason}") from error


__all__ = ["ModelLoadError", "ModelPathError", "check_model_path", "load_model"]
