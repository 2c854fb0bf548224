"""The ``knapspec`` command: ``generate``, ``plan``, ``profile``, ``tune`` and ``bench``.

Every subcommand reads a decoder config (``--config FILE``, TOML or JSON; the built-in
defaults otherwise) and applies ``--set KEY=VALUE`` overrides in order. Exit codes: 0 on
success, 2 for a usage or config error (as argparse does), 1 when the work itself fails.
User errors are reported as one ``knapspec: error: ...`` line on stderr (on a line of its
own: open progress bars are closed first), never a traceback; anything else is a bug and
propagates. Ctrl-C at any point prints ``knapspec: error: interrupted`` and exits 130.

Every module of the package imports only the standard library (and its sibling modules)
at the top: torch, transformers and the library load inside :func:`main`, so that a Ctrl-C
during those imports is caught too.

The package: this module runs the command and turns errors into exit codes;
:mod:`~knapspec.cli.parser` builds the parser; :mod:`~knapspec.cli.generate` (one prompt),
:mod:`~knapspec.cli.batch` (``--prompts-file``), :mod:`~knapspec.cli.plan` (``plan``,
``profile``) and :mod:`~knapspec.cli.tune` (``tune``) do the work, reading their input
through :mod:`~knapspec.cli.inputs`; :mod:`~knapspec.commandline` holds what they and the
``bench`` harness share.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Sequence

from knapspec.cli.inputs import DEFAULT_CHAPTER, DEFAULT_INSTRUCTION, default_prompt
from knapspec.cli.parser import build_parser
from knapspec.commandline import PROG, RunError, UsageError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``knapspec`` command line; returns the process exit code."""
    _one_line_cache_warnings()
    _announce_measurements()
    lost: list[BaseException] = []
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _lost_interrupts_into(lost, previous_hook)
    try:
        code = _main(argv)
        if lost:  # Ctrl-C was swallowed where Python cannot raise it (a finalizer)
            raise KeyboardInterrupt
        return code
    except KeyboardInterrupt:  # anywhere, the heavy imports included
        _error("interrupted")
        return 130
    except ImportError as error:
        # A Ctrl-C while a compiled extension initialises (scipy's HiGHS under sklearn,
        # say) comes back from pybind11 as ``ImportError("initialization failed")`` raised
        # from the KeyboardInterrupt: still the user's Ctrl-C, not a broken install.
        if not _caused_by_interrupt(error):
            raise
        _error("interrupted")
        return 130
    finally:
        sys.unraisablehook = previous_hook


def _lost_interrupts_into(
    lost: list[BaseException], previous: Callable[[sys.UnraisableHookArgs], object]
) -> Callable[[sys.UnraisableHookArgs], None]:
    """An unraisable-exception hook that records a KeyboardInterrupt Python can only print
    and drop (Ctrl-C landing in an object's ``__del__`` or a C library's callback) into
    ``lost`` instead of printing its traceback; :func:`main` answers it as the interrupt
    it was. Anything else goes to ``previous``."""

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            lost.append(unraisable.exc_value)
        else:
            previous(unraisable)

    return hook


def _caused_by_interrupt(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is among ``error``'s explicit causes (``raise ... from``)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command == "bench":
            args.bench_argv = argv[argv.index("bench") + 1 :]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    usage_errors, run_errors = _error_classes()
    try:
        code: int = args.handler(args, extra)
        return code
    except usage_errors as error:
        _error(str(error))
        return 2
    except run_errors as error:
        _error(str(error))
        return 1


def _error_classes() -> tuple[tuple[type[Exception], ...], tuple[type[Exception], ...]]:
    """The exceptions reported as one line: usage errors (exit 2) and run errors (exit 1).

    Imported here, not at the top, because they pull in torch (see the module docstring).
    """
    from knapspec.config import ConfigError
    from knapspec.costmodels.profile import ProfileError
    from knapspec.model.engine import ContextLengthError, UnsupportedModelError
    from knapspec.registry import UnknownComponentError

    usage: tuple[type[Exception], ...] = (UsageError, ConfigError, UnknownComponentError)
    run: tuple[type[Exception], ...] = (
        RunError,
        UnsupportedModelError,
        ContextLengthError,
        ProfileError,
    )
    return usage, run


def _announce_measurements() -> None:
    """Print the library's INFO lines (a kernel table or latency profile being measured:
    what, how long, where it is cached) on stderr as ``knapspec: ...``: nothing the
    command does measures this machine silently."""
    logger = logging.getLogger("knapspec")
    if any(getattr(handler, "knapspec", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.knapspec = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _one_line_cache_warnings() -> None:
    """Print the library's cache warnings (a bad cache file, measured again) as one
    ``knapspec: warning: ...`` line instead of Python's two (place, then source line)."""
    default = warnings.formatwarning
    if getattr(default, "knapspec", False):
        return

    def one_line(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        line: str | None = None,
    ) -> str:
        # By module name: importing the class here would import torch (module docstring).
        if category.__module__ == "knapspec.model.cachefiles":
            return f"{PROG}: warning: {message}\n"
        return default(message, category, filename, lineno, line)

    one_line.knapspec = True  # type: ignore[attr-defined]
    warnings.formatwarning = one_line


def _error(message: str) -> None:
    """Print the one error line, on a line of its own even while a progress bar is shown."""
    tqdm_module = sys.modules.get("tqdm")
    bar_class = getattr(tqdm_module, "tqdm", None)
    # A bar left open by the failure (generation's token bar) would be redrawn after the
    # line, or have the line appended to it; closing it clears its line first.
    for bar in list(getattr(bar_class, "_instances", ())):
        bar.close()
    line = f"{PROG}: error: {message}"
    if bar_class is not None:
        bar_class.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr)


__all__ = [
    "DEFAULT_CHAPTER",
    "DEFAULT_INSTRUCTION",
    "PROG",
    "RunError",
    "UsageError",
    "build_parser",
    "default_prompt",
    "main",
]
