"""``knapspec plan`` (the draft the planner chooses for a prompt) and ``knapspec profile``
(this machine's sublayer latencies, written for the cost models).

Both look at the configured components without decoding. Like the rest of
:mod:`knapspec.cli`, this module imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from knapspec.cli.inputs import encode_prompt, load_model, read_prompt
from knapspec.commandline import RunError, UsageError, load_decoder_config


def run_plan(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``plan`` subcommand: prefill, take the reference window, print one plan."""
    import torch

    from knapspec.config import build_components
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import PlanningContext
    from knapspec.window import ReferenceWindow

    config = load_decoder_config(args.config, args.overrides)
    prompt = read_prompt(args)
    model, tokenizer = load_model(args.model)
    input_ids = encode_prompt(tokenizer, prompt, args.chat)
    engine = SublayerEngine(model)
    n = int(input_ids.numel())
    if n > engine.max_context:
        raise UsageError(
            f"the prompt has {n} tokens, more than the model's context of "
            f"{engine.max_context} tokens; shorten the prompt"
        )
    planner, cost_model, proxy = build_components(config, engine)
    r = min(args.window_tokens or config.window_max_tokens, n)
    with torch.inference_mode():
        cache = engine.new_cache(n + config.max_draft_length + 1)
        out = engine.forward(
            input_ids, 0, cache, all_logits=False, capture_points=True, capture_last=r
        )
        assert out.points is not None  # capture_points=True
        # The window's targets: the full model's greedy next token after each token.
        target_tokens = engine.logits(out.points[-1]).argmax(dim=-1)
        window = ReferenceWindow(
            points=out.points,
            token_ids=input_ids[-r:].to(engine.device),
            target_tokens=target_tokens,
            start=n - r,
        )
        planner.reset()
        plan = planner.plan(
            PlanningContext(
                engine=engine,
                cache=cache,
                context_length=n,
                window=window,
                cost_model=cost_model,
                proxy=proxy,
                max_draft_length=config.max_draft_length,
                sampling=config.sampling,
            )
        )
    mask = plan.mask
    if args.json:
        payload = {
            "planner": config.planner.name,
            "source": plan.source,
            "draft_length": plan.draft_length,
            "skipped_items": list(mask.skipped),
            "num_items": mask.num_items,
            "predicted_acceptance": plan.predicted_acceptance,
            "predicted_tokens_per_second": plan.predicted_tokens_per_second,
            "prompt_tokens": n,
            "window_tokens": r,
        }
        print(json.dumps(payload))
        return 0
    skipped_attn = mask.num_layers - mask.num_attention_executed
    skipped_mlp = mask.num_layers - mask.num_mlp_executed
    print(f"planner {config.planner.name!r} (source {plan.source!r}), {n} prompt tokens")
    print(
        f"γ = {plan.draft_length}; skips {mask.num_skipped} of {mask.num_items} items "
        f"({skipped_attn} attention, {skipped_mlp} MLP)"
    )
    print(mask.item_map())
    print(f"predicted acceptance: {_maybe(plan.predicted_acceptance, '.3f')}")
    print(f"predicted speed: {_maybe(plan.predicted_tokens_per_second, '.1f')} tokens/s")
    return 0


def _maybe(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run_profile(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """The ``profile`` subcommand: measure the latencies, write the profile JSON."""
    from knapspec.costmodels.profiler import profile_engine
    from knapspec.costmodels.store import default_profile_path
    from knapspec.model.engine import SublayerEngine

    config = load_decoder_config(args.config, args.overrides)
    if args.output is not None:
        _check_writable(args.output, "--output")
    model, _ = load_model(args.model)
    engine = SublayerEngine(model)
    output = args.output if args.output is not None else default_profile_path(engine)
    _check_writable(output, "the profile cache file")
    profile = profile_engine(
        engine, max_tokens=config.max_draft_length + 1, quick=args.quick, progress=True
    )
    try:
        written = profile.save(output)
    except OSError as error:
        raise RunError(f"cannot write {output}: {error}") from error
    print(f"wrote latency profile to {written}", file=sys.stderr)
    return 0


def _check_writable(path: Path, what: str) -> None:
    """Fail before a long measurement when ``path`` cannot be written (as ``save`` will:
    a temporary file in its folder, then a rename)."""
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise UsageError(f"{what} {str(path)!r}: cannot write there ({reason})") from None


__all__ = ["run_plan", "run_profile"]
