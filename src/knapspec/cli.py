"""The ``knapspec`` command: ``generate``, ``plan``, ``profile`` and ``bench``.

Every subcommand reads a decoder config (``--config FILE``, TOML or JSON; the built-in
defaults otherwise) and applies ``--set KEY=VALUE`` overrides in order. Exit codes: 0 on
success, 2 for a usage or config error (as argparse does), 1 when the work itself fails.
User errors are reported as one ``knapspec: error: ...`` line on stderr (on a line of its
own: open progress bars are closed first), never a traceback; anything else is a bug and
propagates. Ctrl-C at any point prints ``knapspec: error: interrupted`` and exits 130.

The module imports only the standard library at the top: torch, transformers and the
library load inside :func:`main`, so that a Ctrl-C during those imports is caught too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from knapspec.cli_common import load_decoder_config, positive_int

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from knapspec.config import DecoderConfig


PROG = "knapspec"


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class RunError(Exception):
    """The requested work failed for a reason the user can act on (exit code 1)."""


# ----------------------------------------------------------------------- arguments
def _add_config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="decoder config file (.toml or .json; see examples/ and docs/configuration.md). "
        "Without it the built-in defaults are used.",
    )
    group.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one config field, e.g. --set planner.name=static --set "
        "planner.draft_length=3 --set sampling.temperature=0.7. VALUE is read as TOML "
        '(numbers, true/false, [lists], "strings"; a bare word is a string). Repeatable; '
        "a component name change resets that component's other fields to its defaults.",
    )


def _add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH_OR_DEFAULT",
        default="default",
        help="'default' (SmolLM2-135M-Instruct, provisioned into the knapspec cache on first "
        "use) or the path of a local transformers model directory (config, weights, "
        "tokenizer). Default: %(default)s.",
    )


def _add_prompt_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    source.add_argument(
        "--prompt-file", metavar="FILE", type=Path, help="read the prompt from a UTF-8 file"
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt as a user message with the tokenizer's chat template. Default: "
        "on when the tokenizer has a chat template (instruct models), off otherwise.",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``knapspec`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Training-free self-speculative decoding: the draft is a subset of the "
        "model's own attention and MLP sublayers, chosen as a 0/1 knapsack.",
        epilog="Run 'knapspec COMMAND --help' for the options of a command.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    generate = commands.add_parser(
        "generate",
        help="generate a completion with speculative decoding",
        description="Generate a completion for a prompt with the configured speculative "
        "decoder. The completion goes to stdout, a one-line summary (tokens/s, acceptance "
        "rate, mean accepted length) to stderr. Without --prompt / --prompt-file the prompt "
        "asks for a summary of a chapter of Pride and Prejudice shipped with the package, "
        "an input where lookup drafts pay.",
    )
    _add_prompt_options(generate, required=False)
    _add_model_option(generate)
    generate.add_argument(
        "--compare",
        action="store_true",
        help="also decode the same prompt plainly (no speculation), then print the speed "
        "ratio, whether the tokens are identical, and what the planner chose (drafter, γ, "
        "predicted vs measured acceptance)",
    )
    generate.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=positive_int,
        default=128,
        help="generate at most N new tokens (stops earlier at end-of-sequence). "
        "Default: %(default)s.",
    )
    generate.add_argument(
        "--stream",
        action="store_true",
        help="print the completion token by token as it is committed",
    )
    generate.add_argument(
        "--prompts-file",
        metavar="FILE",
        type=Path,
        help="decode many prompts: a JSONL file, one prompt a line (a JSON string or "
        '{"prompt": ..., "id": ...}); writes one JSON line per prompt (completion, stop '
        "reason, token counts) in input order",
    )
    generate.add_argument(
        "--batch-size",
        metavar="B",
        type=positive_int,
        default=8,
        help="with --prompts-file, prompts decoded together in one batch. Default: %(default)s.",
    )
    generate.add_argument(
        "--output",
        metavar="FILE",
        type=Path,
        help="with --prompts-file, write the JSON lines to FILE instead of stdout",
    )
    generate.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object {completion, stats, config} on stdout instead of the "
        "plain completion and summary",
    )
    _add_config_options(generate)
    generate.set_defaults(handler=_cmd_generate)

    plan = commands.add_parser(
        "plan",
        help="show the draft the configured planner chooses for a prompt",
        description="Prefill the prompt, take the full model's hidden states on its last "
        "tokens as the reference window, and print the plan the configured planner chooses: "
        "the draft mask as an item map (one column per layer; A / M = attention / MLP "
        "runs, . = skipped), the draft length γ and the predicted acceptance and speed.",
    )
    _add_prompt_options(plan, required=True)
    _add_model_option(plan)
    plan.add_argument(
        "--window-tokens",
        metavar="N",
        type=positive_int,
        default=None,
        help="reference-window size in prompt tokens. Default: the config's "
        "window_max_tokens (capped by the prompt length).",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_config_options(plan)
    plan.set_defaults(handler=_cmd_plan)

    profile = commands.add_parser(
        "profile",
        help="measure this machine's sublayer latencies for the cost models",
        description="Micro-benchmark the model on this machine (every layer's attention "
        "over a ladder of context lengths, every MLP, the per-step overhead and full "
        "verification of 1..D+1 tokens) and write the latency profile as JSON.",
    )
    _add_model_option(profile)
    profile.add_argument(
        "--output",
        metavar="FILE",
        type=Path,
        default=None,
        help="where to write the profile JSON. Default: this model's and machine's cache "
        "file (the one the default online cost model loads; $KNAPSPEC_PROFILE overrides it).",
    )
    profile.add_argument(
        "--quick",
        action="store_true",
        help="a few-seconds profile (short ladders, 3 repeats) for smoke tests",
    )
    _add_config_options(profile)
    profile.set_defaults(handler=_cmd_profile)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark harness (its own options: knapspec bench --help)",
        description="Benchmark harness; every argument after 'bench' is passed to it.",
        add_help=False,
    )
    _add_config_options(bench)
    bench.set_defaults(handler=_cmd_bench)
    return parser


# ------------------------------------------------------------------------- helpers
#: The chapter ``knapspec generate`` summarises when given no prompt (package data).
DEFAULT_CHAPTER = "data/pride_and_prejudice_chapter3.txt"
DEFAULT_INSTRUCTION = "Summarize the following chapter in a few sentences."


def default_prompt() -> str:
    """The instruction and the shipped public-domain chapter (about 2,200 tokens)."""
    from importlib.resources import files

    chapter = files("knapspec").joinpath(DEFAULT_CHAPTER).read_text(encoding="utf-8")
    return f"{DEFAULT_INSTRUCTION}\n\n{chapter}"


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is None and getattr(args, "prompt_file", None) is None:
        return default_prompt()
    if args.prompt_file is not None:
        try:
            text: str = args.prompt_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"prompt file not found: {args.prompt_file}") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read prompt file {args.prompt_file}: {error}") from None
    else:
        text = args.prompt
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def _load_model(name_or_path: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from knapspec.model.provision import (
        DEFAULT_ALIASES,
        ProvisioningError,
        load_model_and_tokenizer,
    )

    if name_or_path.strip().lower() not in DEFAULT_ALIASES:
        if not Path(name_or_path).is_dir():
            raise UsageError(
                f"--model {name_or_path!r}: no such directory; give 'default' or the path of "
                "a local transformers model directory"
            )
        if not (Path(name_or_path) / "config.json").is_file():
            raise UsageError(
                f"--model {name_or_path!r}: not a transformers model directory (it has no "
                "config.json); give 'default' or a directory written by save_pretrained"
            )
    try:
        return load_model_and_tokenizer(name_or_path, progress=True)
    except ProvisioningError as error:
        raise RunError(str(error)) from error
    # A directory without loadable weights / tokenizer, or a config transformers rejects.
    except (OSError, ValueError, KeyError) as error:
        reason = " ".join(str(error).split())
        raise RunError(f"cannot load model from {name_or_path!r}: {reason}") from error


def _encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, chat: bool | None
) -> torch.Tensor:
    """``(n,)`` prompt token ids, wrapped in the chat template when asked (or by default)."""
    import torch

    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat = has_template if chat is None else chat
    if use_chat and not has_template:
        raise UsageError("--chat: this model's tokenizer has no chat template")
    if use_chat:
        messages = [{"role": "user", "content": text}]
        text = str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    if len(ids) == 0:
        raise UsageError("the prompt encodes to no tokens")
    return torch.tensor(ids, dtype=torch.long)


class _GenerationStreamer:
    """A transformers-style streamer: a tqdm bar of committed tokens, text when streaming.

    The decoder calls ``put`` with the prompt first, then with each batch of committed
    tokens, then ``end``.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, total: int, *, stream_text: bool
    ) -> None:
        from tqdm.auto import tqdm
        from transformers import TextStreamer

        self._seen_prompt = False
        # Streaming text and a bar on the same terminal garble each other; pick one.
        self._bar = None if stream_text else tqdm(total=total, unit="tok", leave=False)
        self._text = TextStreamer(tokenizer, skip_prompt=True) if stream_text else None

    def put(self, value: torch.Tensor) -> None:
        if self._text is not None:
            self._text.put(value)  # type: ignore[no-untyped-call]
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if self._bar is not None:
            self._bar.update(int(value.numel()))

    def end(self) -> None:
        if self._text is not None:
            self._text.end()  # type: ignore[no-untyped-call]
        if self._bar is not None:
            self._bar.close()


def _summary_line(stats: Any) -> str:
    reason = stats.no_draft_reason()
    return (
        f"{stats.new_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, acceptance rate "
        f"{stats.acceptance_rate:.2f}{f' ({reason})' if reason else ''}, mean accepted length "
        f"{stats.mean_accepted_length:.2f} ({stats.rounds} rounds; plan {stats.plan_time_s:.2f} "
        f"s, lookup {stats.lookup_time_s:.3f} s, draft {stats.draft_time_s:.2f} s, verify "
        f"{stats.verify_time_s:.2f} s)"
    )


def _compare(
    model: Any, config: DecoderConfig, input_ids: torch.Tensor, result: Any, eos: Any
) -> dict[str, Any]:
    """Plain decoding of the same prompt: speeds, identical tokens, the plan's choices."""
    from knapspec.planners import AutoregressivePlanner

    plain = _import_decoder()(model, planner=AutoregressivePlanner(), sampling=config.sampling)
    baseline = plain.generate(input_ids, max_new_tokens=result.stats.new_tokens, eos_token_id=eos)
    speed = result.stats.tokens_per_second
    plain_speed = baseline.stats.tokens_per_second
    identical = (
        None
        if config.sampling.do_sample
        else bool(baseline.tokens.tolist() == result.tokens.tolist())
    )
    return {
        "plain_tokens_per_second": plain_speed,
        "tokens_per_second": speed,
        "speedup": speed / plain_speed if plain_speed > 0 else None,
        "identical_tokens": identical,
        "choices": result.stats.drafter_summary(),
    }


def _warm_up(model: Any, config: DecoderConfig, decoder: Any, input_ids: torch.Tensor) -> None:
    """One short call of each decoder, so neither timed call pays the first-call costs."""
    from knapspec.planners import AutoregressivePlanner

    head = input_ids[:64]
    decoder.generate(head, max_new_tokens=4)
    plain = _import_decoder()(model, planner=AutoregressivePlanner(), sampling=config.sampling)
    plain.generate(head, max_new_tokens=4)


def _import_decoder() -> Any:
    try:
        module = importlib.import_module("knapspec.decoding.decoder")
    except ModuleNotFoundError as error:
        if error.name != "knapspec.decoding.decoder":
            raise
        raise RunError("the speculative decoder is not available in this installation") from None
    return module.SpeculativeDecoder


# ------------------------------------------------------------------------ commands
def _cmd_generate(args: argparse.Namespace, extra: Sequence[str]) -> int:
    config = load_decoder_config(args.config, args.overrides)
    if args.prompts_file is not None:
        return _generate_prompts_file(args, config)
    if args.output is not None:
        raise UsageError("--output is for --prompts-file; the completion goes to stdout")
    prompt = _read_prompt(args)
    model, tokenizer = _load_model(args.model)
    input_ids = _encode_prompt(tokenizer, prompt, args.chat)
    decoder = _import_decoder().from_config(model, config)
    if args.prompt is None and args.prompt_file is None:
        print(
            f"no --prompt given: summarising {DEFAULT_CHAPTER.rsplit('/', 1)[-1]} "
            f"({input_ids.numel()} prompt tokens)",
            file=sys.stderr,
        )
    if args.compare:
        _warm_up(model, config, decoder, input_ids)
    streamer = _GenerationStreamer(tokenizer, args.max_new_tokens, stream_text=args.stream)
    result = decoder.generate(
        input_ids,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        streamer=streamer,
    )
    completion = tokenizer.decode(result.tokens.tolist(), skip_special_tokens=True)
    comparison = (
        _compare(model, config, input_ids, result, tokenizer.eos_token_id) if args.compare else None
    )
    if args.json:
        payload = {
            "completion": completion,
            "stats": result.stats.to_dict(),
            "config": config.to_dict(),
        }
        if comparison is not None:
            payload["compare"] = comparison
        print(json.dumps(payload, default=str))
    else:
        if not args.stream:
            print(completion)
        print(_summary_line(result.stats), file=sys.stderr)
        if comparison is not None:
            print(_comparison_lines(comparison), file=sys.stderr)
    return 0


def _generate_prompts_file(args: argparse.Namespace, config: DecoderConfig) -> int:
    """``--prompts-file``: decode every prompt of a JSONL file in batches, JSONL out."""
    from knapspec.cli_batch import generate_file, read_prompts

    for option in ("prompt", "prompt_file", "compare", "stream", "json"):
        if getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"{flag} cannot be combined with --prompts-file")
    prompts = read_prompts(args.prompts_file, UsageError)
    model, tokenizer = _load_model(args.model)
    decoder = _import_decoder().from_config(model, config)
    generate_file(
        decoder,
        tokenizer,
        prompts,
        lambda text: _encode_prompt(tokenizer, text, args.chat),
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        output=args.output,
    )
    return 0


def _comparison_lines(comparison: dict[str, Any]) -> str:
    identical = comparison["identical_tokens"]
    same = (
        "sampled, so not compared token for token"
        if identical is None
        else ("identical tokens" if identical else "DIFFERENT TOKENS (please report a bug)")
    )
    speedup = comparison["speedup"]
    ratio = f"{speedup:.2f}x" if speedup is not None else "n/a"
    return (
        f"plain decoding: {comparison['plain_tokens_per_second']:.1f} tokens/s; speculative: "
        f"{comparison['tokens_per_second']:.1f} tokens/s = {ratio} the plain speed, {same}\n"
        f"the planner chose: {comparison['choices']}"
    )


def _cmd_plan(args: argparse.Namespace, extra: Sequence[str]) -> int:
    import torch

    from knapspec.config import build_components
    from knapspec.model.engine import SublayerEngine
    from knapspec.planners.base import PlanningContext
    from knapspec.window import ReferenceWindow

    config = load_decoder_config(args.config, args.overrides)
    prompt = _read_prompt(args)
    model, tokenizer = _load_model(args.model)
    input_ids = _encode_prompt(tokenizer, prompt, args.chat)
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


def _cmd_profile(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from knapspec.costmodels.profiler import profile_engine
    from knapspec.costmodels.store import default_profile_path
    from knapspec.model.engine import SublayerEngine

    config = load_decoder_config(args.config, args.overrides)
    if args.output is not None:
        _check_writable(args.output, "--output")
    model, _ = _load_model(args.model)
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


def _cmd_bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    # Validate --config/--set here so that config errors look the same in every command;
    # the harness receives the original arguments and parses them itself.
    if args.config is not None or args.overrides:
        load_decoder_config(args.config, args.overrides)
    from knapspec.bench.cli import cli_main  # the harness imports torch & co.: load on use

    return int(cli_main(list(args.bench_argv)) or 0)


# ----------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``knapspec`` command line; returns the process exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # anywhere, the heavy imports included
        _error("interrupted")
        return 130


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


if __name__ == "__main__":
    raise SystemExit(main())
