"""The argument parser of the ``knapspec`` command: its subcommands and their options.

Each subcommand's handler lives with its work (:mod:`knapspec.cli.generate`,
:mod:`knapspec.cli.plan`); ``bench``'s (:mod:`knapspec.cli.bench`) only forwards its
arguments to the harness (:mod:`knapspec.bench.cli`), which parses them itself. Like the rest of
:mod:`knapspec.cli`, this module imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from knapspec.cli.bench import run_bench
from knapspec.cli.chat import run_chat
from knapspec.cli.generate import run_generate
from knapspec.cli.plan import run_plan, run_profile
from knapspec.cli.serve import run_serve
from knapspec.cli.tune import run_tune
from knapspec.commandline import PROG, positive_int


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
        help="'default' (SmolLM2-135M-Instruct), another known model ('gemma-3-270m': "
        "Gemma 3 270M, a base model under the Gemma Terms of Use), each provisioned into the "
        "knapspec cache on first use, or the path of a local transformers model directory "
        "(config, weights, tokenizer). Default: %(default)s.",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the dtype to load and decode in; 'auto' keeps float32 on a CPU without bf16 "
        "units (AMX, AVX512-BF16) and otherwise measures both and takes the faster. "
        "Output is exact in either (row-invariant kernels). Default: %(default)s.",
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
    generate.set_defaults(handler=run_generate)

    chat = commands.add_parser(
        "chat",
        help="chat with the model; each turn reuses the KV cache of the earlier ones",
        description="An interactive conversation: each line is a user turn, rendered with "
        "the tokenizer's chat template; only its new tokens are prefilled (the KV cache is "
        "kept across turns, outputs equal a fresh call on the whole conversation). The reply "
        "streams to stdout; a line on stderr gives tokens/s, acceptance and time to first "
        "token. Commands: /reset, /stats, /exit. Ctrl-C stops the reply and keeps the "
        "conversation. When stdin is not a terminal, it is read as a scripted conversation, "
        "one user turn per line.",
    )
    _add_model_option(chat)
    chat.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=positive_int,
        default=256,
        help="the longest reply, in tokens. Default: %(default)s.",
    )
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the chat")
    _add_config_options(chat)
    chat.set_defaults(handler=run_chat)

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
    plan.set_defaults(handler=run_plan)

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
    profile.set_defaults(handler=run_profile)

    tune = commands.add_parser(
        "tune",
        help="measure this machine once, ahead of time (kernel table, latency profile)",
        description="Measure what SpeculativeDecoder(model) would measure on first use on "
        "this machine, and cache it: the engine's matrix-product kernel table and, for the "
        "configured cost model, a quick latency profile. Each measurement is announced on "
        "stderr (what, how long, where it is cached); what is cached already is read.",
    )
    _add_model_option(tune)
    _add_config_options(tune)
    tune.set_defaults(handler=run_tune)

    _add_serve_options(
        commands.add_parser(
            "serve",
            help="serve the model over an OpenAI-compatible HTTP API (needs knapspec[serve])",
            description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health, /metrics) over one speculative decoder: requests are "
            "batched continuously, each its own speculative row, and every answer equals the "
            "same request sent alone (greedy, or sampled with a seed). See docs/serving.md.",
        )
    )

    bench = commands.add_parser(
        "bench",
        help="run the benchmark harness or Spec-Bench (knapspec bench --help, knapspec bench "
        "spec-bench --help)",
        description="Benchmark harness; every argument after 'bench' is passed to it.",
        add_help=False,
    )
    _add_config_options(bench)
    bench.set_defaults(handler=run_bench)
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    _add_model_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind. Default: %(default)s.")
    serve.add_argument("--port", type=int, default=8000, help="port to bind. Default: %(default)s.")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KNAPSPEC_API_KEY if "
        "set, else no key)",
    )
    serve.add_argument(
        "--max-batch",
        metavar="B",
        type=positive_int,
        default=8,
        help="requests decoded at once (rows of the batch). Default: %(default)s.",
    )
    serve.add_argument(
        "--max-queue",
        metavar="Q",
        type=positive_int,
        default=64,
        help="requests that may wait for a row; more get 429 with Retry-After. "
        "Default: %(default)s.",
    )
    serve.add_argument(
        "--max-model-len",
        metavar="N",
        type=positive_int,
        default=None,
        help="tokens per row (prompt + completion + draft room); longer requests get 400. "
        "The K/V cache for max-batch rows of N tokens is allocated up front. Default: 4096 "
        "or the model's context if shorter.",
    )
    serve.add_argument(
        "--prefix-cache-mib",
        metavar="MIB",
        type=float,
        default=256.0,
        help="memory for the K/V of earlier prompts, so that a prompt sharing their prefix "
        "(a system prompt, a document) prefills only the rest; replaces the config's "
        "prefix_cache_mib; 0 turns it off. Default: %(default)s.",
    )
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send. Default: SmolLM2-135M-Instruct for the default "
        "model, else the model directory's name.",
    )
    serve.add_argument(
        "--drain-timeout",
        metavar="S",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before cancelling them. "
        "Default: %(default)s.",
    )
    serve.add_argument(
        "--threads", metavar="T", type=positive_int, default=None, help="torch threads"
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level. Default: %(default)s.",
    )
    _add_config_options(serve)
    serve.set_defaults(handler=run_serve)


__all__ = ["build_parser"]
