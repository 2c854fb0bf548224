"""``knapspec bench``: hand the arguments to the measurement wing, or say how to install it.

The harness (:mod:`knapspec.bench`) ships in the package but its plotting needs the
``bench`` extra (matplotlib), which ``pip install knapspec`` leaves out; without it the
command stops with one line that names the install command, before any work starts.
The harness parses its own arguments (``knapspec bench --help``).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence

from knapspec.commandline import RunError, load_decoder_config

#: What the ``bench`` extra adds to a core install (``pyproject.toml``).
BENCH_EXTRA_MODULES = ("matplotlib",)
INSTALL_HINT = "pip install 'knapspec[bench]'"


def missing_bench_modules() -> list[str]:
    """The ``bench`` extra's modules that this installation lacks (empty when installed)."""
    return [name for name in BENCH_EXTRA_MODULES if importlib.util.find_spec(name) is None]


def run_bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Run the harness with the arguments after ``bench``.

    Raises:
        RunError: the ``bench`` extra is not installed.
    """
    # Validate --config/--set here so that config errors look the same in every command;
    # the harness receives the original arguments and parses them itself.
    if args.config is not None or args.overrides:
        load_decoder_config(args.config, args.overrides)
    missing = missing_bench_modules()
    if missing:
        raise RunError(
            f"knapspec bench needs the bench extra ({', '.join(missing)} is not installed); "
            f"install it with: {INSTALL_HINT}"
        )
    from knapspec.bench.cli import cli_main  # the harness imports torch & co.: load on use

    return int(cli_main(list(args.bench_argv)) or 0)


__all__ = ["BENCH_EXTRA_MODULES", "INSTALL_HINT", "missing_bench_modules", "run_bench"]
