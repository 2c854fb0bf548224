"""``knapspec tune``: measure this machine once, ahead of time, for a model.

``SpeculativeDecoder(model)`` needs two measurements of the machine it runs on: the
engine's matrix-product kernel table (:mod:`knapspec.model.tuning.autotune`) and, for the default
online cost model, a quick latency profile (:mod:`knapspec.costmodels.store`). Each is
measured on first use and cached; this command does both now (announcing each on stderr,
with how long it takes and where it caches), so the first generation starts at once.
Like the rest of :mod:`knapspec.cli`, this module imports only the standard library at the
top.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from knapspec.cli.inputs import load_model
from knapspec.commandline import load_decoder_config


def run_tune(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``tune`` subcommand: build the engine and the configured cost model, which
    measure what is not cached yet; print where each measurement lives."""
    from knapspec.config import build_components
    from knapspec.costmodels.store import default_profile_path
    from knapspec.model.engine import SublayerEngine
    from knapspec.model.tuning.autotune import (
        KERNELS_ENV,
        KernelKey,
        framework_only,
        kernel_table_path,
    )

    config = load_decoder_config(args.config, args.overrides)
    model, _ = load_model(args.model, getattr(args, "dtype", "float32"))
    started = time.perf_counter()
    engine = SublayerEngine(model, progress=True)  # the kernel table: cached or measured
    _, cost_model, _ = build_components(config, engine)  # its latency profile, likewise
    seconds = time.perf_counter() - started
    if framework_only(engine):
        kernels = f"none to tune ({engine.device.type}, {engine.dtype}: the framework's own)"
    elif KERNELS_ENV in os.environ:
        kernels = f"as ${KERNELS_ENV} says ({os.environ[KERNELS_ENV]!r}); nothing measured"
    else:
        kernels = str(kernel_table_path(KernelKey.for_engine(engine)))
    profile = default_profile_path(engine)
    if cost_model is None:
        latency = "none (the configured planner reads no cost model)"
    elif profile.exists():
        latency = str(profile)
    else:
        latency = f"none cached (the {cost_model.registered_name!r} cost model needs none)"
    print(f"kernel table: {kernels}", file=sys.stderr)
    print(f"latency profile: {latency}", file=sys.stderr)
    print(f"ready in {seconds:.1f} s; SpeculativeDecoder(model) here reads these", file=sys.stderr)
    return 0


__all__ = ["run_tune"]
