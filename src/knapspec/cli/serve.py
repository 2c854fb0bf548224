"""``knapspec serve``: the OpenAI-compatible server (:mod:`knapspec.serve`).

Like the rest of :mod:`knapspec.cli`, this module imports only the standard library at
the top; the server's packages (the ``serve`` extra) load when the command runs, and their
absence is one clear error line.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence

from knapspec.commandline import RunError, UsageError, load_decoder_config

#: What the ``serve`` extra installs (module names).
SERVE_MODULES = ("fastapi", "uvicorn", "sse_starlette", "prometheus_client")


def run_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``serve`` subcommand; returns the exit code."""
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise RunError(
            f"knapspec serve needs the serve extra ({', '.join(missing)} missing): "
            "pip install 'knapspec[serve]'"
        )
    import attrs

    config = load_decoder_config(args.config, args.overrides)
    if args.prefix_cache_mib < 0:
        raise UsageError(f"--prefix-cache-mib must be >= 0, got {args.prefix_cache_mib}")
    # A server sees shared prefixes (system prompts, documents) far more than one call.
    config = attrs.evolve(config, prefix_cache_mib=args.prefix_cache_mib)
    _check_model_path(args.model)  # fail here, not after the port has opened
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from knapspec.serve.server import api_key_from, loader, serve

    load = loader(
        args.model,
        args.dtype,
        config,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
    )
    return serve(
        load,
        host=args.host,
        port=args.port,
        api_key=api_key_from(args.api_key),
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
        log_level=args.log_level,
    )


def _check_model_path(model: str) -> None:
    """``--model`` names a known model (provisioned on first use) or a directory with a
    ``config.json`` (:func:`knapspec.model.loading.by_name.check_model_path`)."""
    from knapspec.model.loading.by_name import ModelPathError, check_model_path

    try:
        check_model_path(model)
    except ModelPathError as error:
        raise UsageError(f"--model {error}") from None


__all__ = ["run_serve"]
