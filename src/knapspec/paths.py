"""Where knapspec keeps what it caches on this machine: one function, below every layer.

The model files, the kernel and dtype choices, the cost profiles and the compiled C
kernels all live under :func:`cache_root`. It sits in a module of its own (standard
library only) so that the layers that cache something need not import the model
downloader to find the directory.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Return knapspec's cache directory (it is not created here).

    ``$KNAPSPEC_CACHE`` if set and non-empty, else ``$XDG_CACHE_HOME/knapspec``, else
    ``~/.cache/knapspec``.
    """
    explicit = os.environ.get("KNAPSPEC_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "knapspec"
    return Path.home() / ".cache" / "knapspec"


__all__ = ["cache_root"]
