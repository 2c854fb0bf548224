"""The profile store: where latency profiles live, and loading one or measuring it.

Resolution order for "the profile of this model on this machine":

1. an explicit path (a config's ``profile`` field), checked against the engine;
2. ``$KNAPSPEC_PROFILE``, checked against the engine;
3. ``cache_root()/profiles/<model>-<key digest>.json``: the file name hashes every key
   field that must match, so a cached profile is always for this model, machine, thread
   count and library versions. A full profile written there by ``knapspec profile`` wins;
   otherwise a quick profile (a few seconds) is measured and cached on first use. A bad
   cache file (truncated, garbage, another version or key) or an unwritable cache costs one
   warning and a quick profile, never an error (:mod:`knapspec.model.cachefiles`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from knapspec.costmodels.profile import LatencyProfile, ProfileError, ProfileKey
from knapspec.costmodels.profiler import profile_engine
from knapspec.model import cachefiles
from knapspec.paths import cache_root

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine

PROFILE_ENV = "KNAPSPEC_PROFILE"
"""Environment variable naming a profile file to use instead of the cached one."""


def default_profile_path(engine: SublayerEngine) -> Path:
    """The cache file for ``engine``'s model on this machine (``$KNAPSPEC_PROFILE`` wins)."""
    explicit = os.environ.get(PROFILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    key = ProfileKey.for_engine(engine)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(key.model_name).name or "model")
    return cache_root() / "profiles" / f"{name}-{key.digest()}.json"


def load_or_measure_profile(
    engine: SublayerEngine,
    path: str | os.PathLike[str] | None = None,
    *,
    force: bool = False,
    progress: bool = False,
) -> LatencyProfile:
    """The profile for ``engine`` on this machine, measured (a quick profile, a few
    seconds) and cached when there is none (see the module docstring for the order).

    Raises:
        ProfileError: an explicitly named profile (argument or ``$KNAPSPEC_PROFILE``) is
            unreadable, corrupt, or (subclass ``ProfileMismatchError``) for another model
            or machine and ``force`` is off.
    """
    if path is not None or os.environ.get(PROFILE_ENV):
        explicit = Path(path) if path is not None else default_profile_path(engine)
        profile = LatencyProfile.load(explicit)
        profile.check_compatible(engine, force=force)
        return profile
    cached = default_profile_path(engine)

    def mismatch(profile: LatencyProfile) -> str | None:
        try:
            profile.check_compatible(engine)
        except ProfileError:
            return "was measured for another model, machine or version"
        return None

    # Our own cache file: a bad one is replaced rather than failing the user's call.
    return cachefiles.load_or_measure(
        cached,
        parse=lambda text: LatencyProfile.from_dict(json.loads(text), source=str(cached)),
        valid=mismatch,
        measure=lambda: profile_engine(engine, quick=True, progress=progress),
        render=LatencyProfile.to_json,
        what="latency profile",
        measures="each sublayer's latency for the cost model (a quick profile, a few seconds)",
    )


__all__ = ["PROFILE_ENV", "default_profile_path", "load_or_measure_profile"]
