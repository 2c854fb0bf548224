"""The library's own cache files: read defensively, written atomically, first runs serialised.

Kernel tables (:mod:`knapspec.model.tuning.autotune`) and latency profiles
(:mod:`knapspec.costmodels.store`) are measurements cached under
:func:`~knapspec.paths.cache_root`. A cache file only saves time, so nothing
about one may fail a call or change its result:

- a file that cannot be read, is not what it claims to be (truncated, garbage, another
  version's layout) or was measured for another key is reported in one line
  (:class:`CacheWarning`) and measured again;
- a file is written to a temporary name beside its place and moved there with
  :func:`os.replace`, so a reader sees the old file or the new one, never half of one (a
  full disk leaves the old file and a warning);
- where the cache directory cannot be written, the measurement is kept in memory for this
  process only (one warning), and the call goes on;
- two processes that find no file at once do not both measure: :func:`exclusive` holds an
  ``flock`` on a lock file beside the cache file, and the second process, once it has the
  lock, reads what the first one wrote.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

#: The library's logger: measurements announce themselves on it at INFO (the command line
#: prints them; a library user sees them with ``logging.basicConfig(level=logging.INFO)``).
_LOG = logging.getLogger("knapspec")

#: What a parser may raise on a file that is not what it should be.
PARSE_ERRORS: tuple[type[Exception], ...] = (
    ValueError,  # json.JSONDecodeError, UnicodeDecodeError, attrs validators
    KeyError,
    TypeError,
    AttributeError,
    IndexError,
)


class CacheWarning(RuntimeWarning):
    """A cache file was unusable or could not be written: knapspec measured again, or ran
    without caching. Never an error: the cache only saves time."""


def warn(message: str) -> None:
    """Emit ``message`` as one :class:`CacheWarning` line (newlines folded)."""
    warnings.warn(" ".join(message.split()), CacheWarning, stacklevel=3)


def read(path: Path, parse: Callable[[str], T], what: str, *, quiet: bool = False) -> T | None:
    """``parse`` of the text of ``path``, or None: no file, or (with a warning unless
    ``quiet``) a file that cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):  # no file (a parent may be a file)
        return None
    except (OSError, UnicodeDecodeError) as error:
        if not quiet:
            warn(f"{what} {path} is unreadable ({error}); measuring again")
        return None
    try:
        return parse(text)
    except PARSE_ERRORS as error:
        if not quiet:
            detail = "empty" if not text.strip() else f"unreadable ({_describe(error)})"
            warn(f"{what} {path} is {detail}; measuring again")
        return None


def _describe(error: Exception) -> str:
    """``Type: message``, cut to 200 characters (one line of a warning)."""
    return f"{type(error).__name__}: {error}"[:200]


def replace_atomically(path: Path, text: str, *, prefix: str = ".tmp-") -> None:
    """Write ``text`` to ``path`` through a temporary file and :func:`os.replace`.

    Raises:
        OSError: the directory cannot be created or written, or the disk is full (the
            temporary file is removed; an earlier ``path`` is left as it was).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; cache files are shared
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def store(path: Path, text: str, what: str) -> bool:
    """:func:`replace_atomically`, or a warning where it fails; whether it was written."""
    try:
        replace_atomically(path, text)
    except OSError as error:
        warn(f"cannot write {what} {path} ({error}); continuing without caching it")
        return False
    return True


@contextlib.contextmanager
def lock_file(lock_path: Path, *, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed) for the block;
    ``on_wait`` is called once if another process holds it. The kernel releases the lock
    when the process dies, so a crash never leaves it held.

    Raises:
        OSError: the lock file cannot be created.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if sys.platform != "win32":
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold :func:`lock_file` on ``.<name>.lock`` beside the cache file ``path`` for the
    block; where the lock file cannot be made (an unwritable directory: nothing will be
    cached anyway), the block runs unlocked."""
    with contextlib.ExitStack() as stack:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(lock_file(path.parent / f".{path.name}.lock"))
        except OSError:
            pass
        yield


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (inclusive) to disk."""
    for directory, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (makes renames durable); a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_or_measure(
    path: Path,
    *,
    parse: Callable[[str], T],
    valid: Callable[[T], str | None],
    measure: Callable[[], T],
    render: Callable[[T], str],
    what: str,
    measures: str = "",
) -> T:
    """The cached value at ``path``, or a fresh measurement that is then cached.

    ``valid(value)`` is None for a usable value, else why it is not (a one-line warning,
    then measuring). The file is re-read under :func:`exclusive`, so that of two processes
    starting on an empty cache one measures and the other reads its file. A measurement
    is never silent: it is logged at INFO on the ``knapspec`` logger before (what it
    measures, ``measures``, how long it takes, where it caches) and after (how long it took).
    """
    cached = read(path, parse, what)
    if cached is not None:
        reason = valid(cached)
        if reason is None:
            return cached
        warn(f"{what} {path} {reason}; measuring again")
    with exclusive(path):
        # Another process may have measured while this one waited for the lock.
        cached = read(path, parse, what, quiet=True)
        if cached is not None and valid(cached) is None:
            return cached
        _LOG.info(
            "measuring %s, once for this machine; caching the %s at %s",
            measures or f"the {what}",
            what,
            path,
        )
        started = time.perf_counter()
        value = measure()
        _LOG.info("measured the %s in %.1f s", what, time.perf_counter() - started)
        store(path, render(value), what)
    return value


__all__ = [
    "PARSE_ERRORS",
    "CacheWarning",
    "exclusive",
    "fsync_dir",
    "fsync_tree",
    "load_or_measure",
    "lock_file",
    "read",
    "replace_atomically",
    "store",
    "warn",
]
