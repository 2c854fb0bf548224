"""The ``knapspec`` command: each subcommand's happy path and bad input, run as a user would.

Happy paths run ``python -m knapspec.cli`` in a subprocess on a tiny random Llama saved to
a temporary directory with a word-level tokenizer built offline, so no real model is
needed. The full matrix of bad inputs runs in-process through ``main(argv)`` (same code,
no interpreter start-up), with one subprocess check per subcommand that the exit code and
the ``knapspec: error:`` line reach the shell without a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from knapspec.cli import build_parser, main
from knapspec.config import load_builtin_components
from knapspec.costmodels.base import COST_MODELS

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "and", "then", "it", ".", ","]
STATIC = ["--set", "planner.name=static", "--set", "planner.draft_length=2"]

load_builtin_components()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved 4-layer random Llama with a word-level tokenizer (and a chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["[UNK]", "[EOS]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=1,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def run_cli(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "knapspec.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def assert_user_error(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"knapspec: error: {text}" in result.stderr or (
        "knapspec: error:" in result.stderr and text in result.stderr
    ), result.stderr


# ---------------------------------------------------------------------- happy paths
def test_generate_prints_completion_and_summary(model_dir: Path) -> None:
    result = run_cli(
        "generate", "--model", model_dir, "--prompt", "the cat sat on", "--max-new-tokens", "6",
        "--no-chat", *STATIC,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # the completion (random model: any words)
    summary = result.stderr.strip().splitlines()[-1]
    assert "tokens/s" in summary and "acceptance rate" in summary
    assert "mean accepted length" in summary


def test_generate_with_dtype_auto_on_a_cpu_claiming_amx(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (AMX Xeon): ``--dtype auto`` timed a 512-token context on this 256-token
    model and failed, blaming the prompt. It now times within the model's context."""
    monkeypatch.setenv("KNAPSPEC_CPU_FLAGS", "avx512f avx512_bf16 amx_tile amx_bf16")
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    result = run_cli(
        "generate", "--model", model_dir, "--prompt", "the cat sat on", "--max-new-tokens", "4",
        "--no-chat", "--dtype", "auto", *STATIC,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "after a 244-token context" in result.stderr, result.stderr


def test_generate_json_with_config_file_and_chat(model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "static.toml"
    config.write_text('[planner]\nname = "early-exit"\nexit_layer = 2\ndraft_length = 3\n')
    result = run_cli(
        "generate", "--model", model_dir, "--config", config, "--prompt", "a dog ran",
        "--max-new-tokens", "5", "--json", "--chat",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["stats"]["new_tokens"] <= 5
    assert payload["config"]["planner"] == {
        "name": "early-exit",
        "exit_layer": 2,
        "draft_length": 3,
    }
    assert isinstance(payload["completion"], str)


def test_plan_prints_the_item_map(model_dir: Path) -> None:
    result = run_cli(
        "plan", "--model", model_dir, "--prompt", "the dog sat on the mat",
        "--set", "planner.name=static", "--set", "planner.skipped_items=[1, 6]",
        "--set", "planner.draft_length=3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "γ = 3" in result.stdout
    assert "attn AAA." in result.stdout  # item 6 = attention of layer 3
    assert "mlp  .MMM" in result.stdout  # item 1 = MLP of layer 0


def test_profile_writes_a_profile(model_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "profile.json"
    result = run_cli("profile", "--model", model_dir, "--quick", "--output", output)
    assert result.returncode == 0, result.stderr
    data = json.loads(output.read_text())
    assert data  # the profiler owns the schema; it must at least be JSON
    assert str(output) in result.stderr


def test_bench_delegates(tmp_path: Path) -> None:
    # Without the bench extra it explains instead: tests/test_bench_extra.py.
    result = run_cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("generate", "plan", "profile", "bench"):
        assert command in out
    # Every option of every subcommand has help text.
    subparsers = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name, subparser in subparsers.items():
        for action in subparser._actions:
            if action.option_strings:
                assert action.help, f"{name} {action.option_strings} has no help"


# ---------------------------------------------------------------- bad input (shell)
def test_generate_unknown_planner_in_a_subprocess(model_dir: Path) -> None:
    result = run_cli(
        "generate", "--model", model_dir, "--prompt", "x", "--set", "planner.name=statc"
    )
    assert_user_error(result, 2, "unknown planner 'statc'")
    assert "did you mean 'static'?" in result.stderr


def test_plan_bad_toml_in_a_subprocess(model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[planner\nname = 'static'\n")
    result = run_cli("plan", "--model", model_dir, "--prompt", "x", "--config", config)
    assert_user_error(result, 2, "invalid TOML")


def test_profile_missing_config_in_a_subprocess(model_dir: Path, tmp_path: Path) -> None:
    result = run_cli("profile", "--model", model_dir, "--config", tmp_path / "nope.toml")
    assert_user_error(result, 2, "config file not found")


def test_bench_bad_set_in_a_subprocess() -> None:
    result = run_cli("bench", "--set", "planner.tau")
    assert_user_error(result, 2, "expected KEY=VALUE")


# ------------------------------------------------------------- bad input (in-process)
def bad_config(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["generate", "plan", "profile", "bench"])
@pytest.mark.parametrize(
    ("make_args", "expected"),
    [
        (lambda tmp: ["--set", "planner.name=knapsak"], "unknown planner 'knapsak'"),
        (lambda tmp: ["--config", bad_config(tmp, "max_draft_length = [")], "invalid TOML"),
        (lambda tmp: ["--config", tmp / "missing.toml"], "config file not found"),
        (lambda tmp: ["--set", "planner.tau"], "expected KEY=VALUE"),
        (lambda tmp: ["--set", "max_draft_length=0"], "max_draft_length: must be"),
        (lambda tmp: ["--set", "sampling.tmperature=1"], "did you mean 'temperature'"),
        (
            lambda tmp: ["--config", bad_config(tmp, "confidence_threshold = 3.0")],
            "confidence_threshold: must be in [0, 1], got 3.0",
        ),
        (lambda tmp: ["--config", bad_config(tmp, "{}", "c.yaml")], "unsupported config format"),
    ],
)
def test_bad_config_input_exits_2_with_one_error_line(
    command: str,
    make_args: Any,
    expected: str,
    tmp_path: Path,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = [command, *map(str, make_args(tmp_path))]
    if command in ("generate", "plan"):
        args += ["--prompt", "the cat"]
    if command != "bench":
        args += ["--model", str(model_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("knapspec: error: "), err
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["plan", "--prompt", "x", "--model", "/nonexistent/model"], "no such directory"),
    ],
)
def test_bad_prompt_or_model_exits_2(
    args: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, *STATIC]) == 2
    err = capsys.readouterr().err
    assert err.startswith("knapspec: error: ") and expected in err, err


def test_chat_without_a_template_is_a_usage_error(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    code = main(["generate", "--model", str(plain), "--prompt", "a", "--chat", *STATIC])
    assert code == 2
    assert "no chat template" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["generate", "--prompt", "a", "--prompt-file", "b"],
        ["generate", "--prompt", "a", "--max-new-tokens", "0"],
        ["plan", "--prompt", "a", "--bogus"],
    ],
)
def test_argparse_usage_errors_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    assert "usage: knapspec" in capsys.readouterr().err


def test_generate_compare_runs_plain_decoding_and_explains_the_plan(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["generate", "--model", str(model_dir), "--prompt", "a b c a b c a b c a b",
         "--max-new-tokens", "8", "--no-chat", "--compare", "--json",
         "--set", "planner.name=lookup", "--set", "planner.draft_length=3"]
    )  # fmt: skip
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    compare = payload["compare"]
    assert compare["identical_tokens"] is True  # greedy: speculation is lossless
    assert compare["speedup"] > 0 and compare["plain_tokens_per_second"] > 0
    assert any(
        phrase in compare["choices"] for phrase in ("per-token acceptance", "γ = 0", "no rounds")
    )


def test_generate_without_a_prompt_uses_the_shipped_chapter() -> None:
    from knapspec.cli import DEFAULT_INSTRUCTION, default_prompt

    prompt = default_prompt()
    assert prompt.startswith(DEFAULT_INSTRUCTION)
    assert "Mr. Darcy" in prompt and len(prompt.split()) > 1500


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--prompt", "--prompt-file", "--model", "--max-new-tokens", "--chat",
                   "--stream", "--json", "--config", "--set"):  # fmt: skip
        assert option in out


@pytest.mark.skipif("online" not in COST_MODELS, reason="the online cost model is not registered")
def test_generate_in_process_streams(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["generate", "--model", str(model_dir), "--prompt", "the cat", "--max-new-tokens", "4",
         "--stream", "--no-chat", *STATIC]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.strip()  # streamed text
    assert "tokens/s" in captured.err


def test_tune_measures_once_says_so_and_then_reads_the_cache(
    model_dir: Path, tmp_path: Path
) -> None:
    """`knapspec tune` measures the kernel table and the latency profile ahead of time,
    announcing what it measures and where it caches; a second run measures nothing."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env["KNAPSPEC_CACHE"] = str(tmp_path / "cache")
    env.pop("KNAPSPEC_PROFILE", None)
    env.pop("KNAPSPEC_KERNELS", None)

    def tune() -> subprocess.CompletedProcess[str]:
        # float32: on a CPU with bf16 units `auto` may pick bf16 by timing, which has no
        # kernel table to tune (the framework's own products); auto is tested on its own.
        command = [
            sys.executable, "-m", "knapspec.cli", "tune", "--model", str(model_dir),
            "--dtype", "float32",
        ]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)

    first = tune()
    assert first.returncode == 0, first.stderr
    announced = [line for line in first.stderr.splitlines() if "measuring" in line]
    assert any("kernel table at" in line for line in announced), first.stderr
    assert any("latency profile at" in line for line in announced), first.stderr
    paths = {}
    for line in first.stderr.splitlines():
        name, _, value = line.partition(": ")
        if name in ("kernel table", "latency profile"):
            paths[name] = Path(value)
    assert set(paths) == {"kernel table", "latency profile"}, first.stderr
    assert all(path.is_file() and tmp_path in path.parents for path in paths.values())
    second = tune()
    assert second.returncode == 0, second.stderr
    assert "measuring" not in second.stderr
