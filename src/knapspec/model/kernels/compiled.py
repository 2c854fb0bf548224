"""Small C kernels compiled on first use with the machine's C compiler, cached per user.

The row-invariant kernels (:mod:`knapspec.model.kernels.row_attention`,
:mod:`knapspec.model.kernels.row_linear`) are plain C (no torch headers: each compiles in about a
second) built with ``-march=native`` for the CPU at hand, loaded with :mod:`ctypes` (which
releases the GIL during a call). The headers they share (``csrc/bfloat16.h``,
``csrc/amx_tiles.h``) sit beside the sources, on the include path. A library is cached under
the knapspec cache, keyed by its source and every header beside it, the compiler, the flags
and the CPU's model name and
flags (a kernel built for one CPU may not run on another sharing the cache). Where no
compiler works, :meth:`load` returns None and says why once; callers fall back to pure
PyTorch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"

#: Every kernel's flags (a kernel may add its own, such as ``-ffp-contract=off``).
BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi")


def cpu_identity() -> str:
    """The CPU's model name and flags (part of every compiled kernel's cache key)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def compiler() -> str | None:
    """``$CC``, else ``cc`` or ``gcc`` on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


class CompiledLibrary:
    """One C source, compiled once per machine and loaded once per process.

    Args:
        source: the file's name under ``csrc/``.
        describe: what it is, for the log ("the row-invariant attention kernel").
        fallback: what runs where it cannot be built, for the log.
        declare: sets the ``restype``/``argtypes`` of the functions used (raises
            AttributeError for a missing symbol, which counts as unavailable).
        flags: extra compiler flags.
    """

    def __init__(
        self,
        source: str,
        describe: str,
        fallback: str,
        declare: Callable[[ctypes.CDLL], None],
        flags: tuple[str, ...] = (),
    ) -> None:
        self.source = CSRC / source
        self.describe = describe
        self.fallback = fallback
        self.declare = declare
        self.flags = (*BASE_FLAGS, *flags)
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._tried = False

    def path(self) -> Path:
        """Where the library for this source, compiler, flags and CPU is cached."""
        from knapspec.paths import cache_root

        digest = hashlib.sha256()
        digest.update(self.source.read_bytes())
        for header in sorted(self.source.parent.glob("*.h")):  # what the source includes
            digest.update(header.read_bytes())
        digest.update((compiler() or "none").encode())
        digest.update(" ".join(self.flags).encode())
        digest.update(cpu_identity().encode())
        return cache_root() / "compiled" / f"{self.source.stem}-{digest.hexdigest()[:16]}.so"

    def _build(self, target: Path) -> None:
        cc = compiler()
        if cc is None:
            raise OSError("no C compiler (cc or gcc) on PATH")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compile beside the target and rename: two processes building at once each write
        # their own file, and the rename is atomic, so nobody loads a half-written library.
        handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            # The shared headers (bfloat16.h, amx_tiles.h) sit beside the source.
            include = ["-I", str(self.source.parent)]
            subprocess.run(
                [cc, *self.flags, *include, "-o", temporary, str(self.source), "-lm"],
                check=True,
                capture_output=True,
                timeout=120,
            )
            os.replace(temporary, target)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    def load(self) -> ctypes.CDLL | None:
        """The library, built on first use; None where it cannot be built or loaded (the
        reason is logged once per process)."""
        if self._tried:  # the hot path: no lock once decided
            return self._library
        with self._lock:
            if self._tried:
                return self._library
            self._tried = True
            try:
                path = self.path()
                if not path.exists():
                    logger.info("compiling %s into %s", self.describe, path)
                    self._build(path)
                library = ctypes.CDLL(str(path))
                self.declare(library)
                self._library = library
            except (OSError, subprocess.SubprocessError, AttributeError) as error:
                detail = getattr(error, "stderr", b"") or b""
                logger.warning(
                    "%s is unavailable (%s%s); %s",
                    self.describe,
                    error,
                    f": {detail.decode(errors='replace')[:200]}" if detail else "",
                    self.fallback,
                )
                self._library = None
            return self._library


__all__ = ["BASE_FLAGS", "CSRC", "CompiledLibrary", "compiler", "cpu_identity"]
