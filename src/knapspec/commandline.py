"""What every part of the ``knapspec`` command shares, the ``bench`` harness's parsers too.

The program name, the two error classes the command reports as one line (see
:mod:`knapspec.cli`), the ``positive_int`` argument type and the ``--config`` / ``--set``
reading. It sits below both :mod:`knapspec.cli` (the command, the top layer) and
:mod:`knapspec.bench` (the measurement wing the command runs), so the harness parses its
own arguments without importing the command. Standard library only at the top: the
command imports this module before anything heavy.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from knapspec.config import DecoderConfig


PROG = "knapspec"


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class RunError(Exception):
    """The requested work failed for a reason the user can act on (exit code 1)."""


def positive_int(text: str) -> int:
    """argparse type: a positive integer (shared by every subcommand)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def load_decoder_config(config_path: Path | None, overrides: Sequence[str]) -> DecoderConfig:
    """The config file (or the defaults) with ``--set`` overrides applied.

    Raises:
        ConfigError: an unreadable or invalid file, or a bad override.
        UnknownComponentError: an unknown component name.
    """
    # Imported here: the config pulls in torch, and the command imports this module first.
    from knapspec.config import DecoderConfig, apply_overrides, load_config

    config = load_config(config_path) if config_path is not None else DecoderConfig()
    return apply_overrides(config, overrides) if overrides else config


__all__ = ["PROG", "RunError", "UsageError", "load_decoder_config", "positive_int"]
