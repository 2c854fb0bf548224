"""Bad input as users meet it (issue 22): every case of docs/troubleshooting.md's
"Bad input, tried" table is kept by a test here.

CLI cases run in-process through ``main(argv)`` where that is enough, and in a subprocess
where the shell's view matters (exit code, no traceback, Ctrl-C); both use the tiny random
Llama saved by ``tests/test_cli.py``'s fixture, so no real model is needed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.test_cli import STATIC, assert_user_error, model_dir, run_cli

from knapspec import cli
from knapspec.cli import main

__all__ = ["model_dir"]  # the fixture, imported for its use below

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The captured stderr's error line, checked to be its last line, on a line of its own
    (progress bars of model loading may come before it) and the only one."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("knapspec: error:") == 1, err
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("knapspec: error: "), err
    return last


# ------------------------------------------------------------------------- CLI: config
@pytest.mark.parametrize("command", ["generate", "plan", "profile", "bench"])
def test_config_file_with_invalid_utf8(
    command: str, tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes(b"max_draft_length = 3\n# caf\xe9\n")
    args = [command, "--config", str(config)]
    if command != "bench":
        args += ["--model", str(model_dir)]
    if command in ("generate", "plan"):
        args += ["--prompt", "the cat"]
    assert main(args) == 2
    assert "not a UTF-8 text file" in one_error_line(capsys)


def test_seed_beyond_64_bits(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(model_dir), "--prompt", "the cat"]
    assert main([*args, "--set", f"sampling.seed={2**70}"]) == 2
    assert "sampling.seed: must be in [0, 2**64 - 1]" in one_error_line(capsys)


@pytest.mark.parametrize(
    "order",
    [["allow_dotted_paths=true", "planner.name=X"], ["planner.name=X", "allow_dotted_paths=true"]],
)
def test_dotted_component_name_from_the_command_line(
    order: list[str], model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The switch is applied before the name is checked, whatever the order given."""
    dotted = "knapspec.planners.static:StaticPlanner"
    sets = [arg for item in order for arg in ("--set", item.replace("X", dotted))]
    args = ["generate", "--model", str(model_dir), "--prompt", "the cat", "--no-chat"]
    assert main([*args, "--max-new-tokens", "4", *sets, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    # The dotted path names a registered class, which the config records by its name.
    assert payload["config"]["planner"]["name"] in (dotted, "static")
    assert payload["config"]["allow_dotted_paths"] is True


def test_invalid_replanning_field_is_refused_before_the_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_model(name: str) -> Any:
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(cli, "_load_model", no_model)
    for command in ("generate", "plan"):
        args = [command, "--prompt", "the cat", "--set", "planner.acceptance_smoothing=2"]
        assert main(args) == 2
        assert "planner.acceptance_smoothing: must be in (0, 1)" in one_error_line(capsys)
    assert main(["plan", "--prompt", "x", "--set", "planner.every_rounds=0"]) == 2
    assert "planner.every_rounds: must be >= 1" in one_error_line(capsys)


# -------------------------------------------------------------------------- CLI: model
def test_model_directory_that_is_not_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "the cat"]) == 2
    assert "not a transformers model directory (it has no config.json)" in one_error_line(capsys)


def test_model_directory_with_a_config_transformers_rejects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert main(["plan", "--model", str(tmp_path), "--prompt", "the cat"]) == 1
    line = one_error_line(capsys)
    assert f"cannot load model from {str(tmp_path)!r}" in line and "model_type" in line


def test_model_directory_that_is_not_a_model_in_a_subprocess(tmp_path: Path) -> None:
    result = run_cli("generate", "--model", tmp_path, "--prompt", "x")
    assert_user_error(result, 2, "not a transformers model directory")


# ----------------------------------------------------------------- CLI: plan, profile
def test_plan_context_error_advises_only_what_plan_has(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = " ".join(["the cat sat"] * 120)  # 360 tokens > the tiny model's 256
    assert main(["plan", "--model", str(model_dir), "--prompt", prompt, "--no-chat"]) == 2
    line = one_error_line(capsys)
    assert "360 tokens" in line and "shorten the prompt" in line
    assert "max_new_tokens" not in line and "--max-new-tokens" not in line


@pytest.mark.parametrize("where", ["missing-root", "directory"])
def test_profile_output_is_checked_before_profiling(
    where: str,
    tmp_path: Path,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import knapspec.costmodels.profiler as profiler

    def no_profiling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("profiled before checking --output")

    monkeypatch.setattr(profiler, "profile_engine", no_profiling)
    output = Path("/proc/knapspec-nope/profile.json") if where == "missing-root" else tmp_path
    assert main(["profile", "--model", str(model_dir), "--output", str(output)]) == 2
    line = one_error_line(capsys)
    assert f"--output {str(output)!r}" in line
    assert ("is a directory" if where == "directory" else "cannot write there") in line


# --------------------------------------------------------------- CLI: progress, Ctrl-C
def test_error_line_is_not_glued_to_a_progress_bar(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failure while the token bar is drawn: the error starts a line of its own."""
    import torch

    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.model.engine import ContextLengthError

    def fail_midway(self: Any, input_ids: Any, **kwargs: Any) -> Any:
        streamer = kwargs["streamer"]
        streamer.put(torch.tensor([[1, 2]]))
        streamer.put(torch.tensor([3, 4]))  # the bar now shows 2 tokens
        raise ContextLengthError("sequence of 999 tokens exceeds the model's context")

    monkeypatch.setattr(SpeculativeDecoder, "generate", fail_midway)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    args = ["generate", "--model", str(model_dir), "--prompt", "the cat", *STATIC]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "tok" in err  # the bar was drawn
    segments = [part.strip() for line in err.split("\n") for part in line.split("\r")]
    assert "knapspec: error: sequence of 999 tokens exceeds the model's context" in segments, err


_INTERRUPT_AT_TORCH_IMPORT = """
import sys
class InterruptTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, InterruptTorch())
from knapspec.cli import main  # must not import torch
raise SystemExit(main(sys.argv[1:]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def test_ctrl_c_during_the_heavy_imports_prints_one_line(model_dir: Path) -> None:
    """Deterministic: the Ctrl-C arrives exactly when torch starts to import."""
    for args in (["generate", "--model", str(model_dir), "--prompt", "x"], ["plan", "--help"]):
        result = subprocess.run(
            [sys.executable, "-c", _INTERRUPT_AT_TORCH_IMPORT, *args],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=120,
        )
        if args[-1] == "--help":  # help needs no heavy import at all
            assert result.returncode == 0 and "usage: knapspec plan" in result.stdout
            continue
        assert result.returncode == 130, result.stderr
        assert result.stderr == "knapspec: error: interrupted\n", result.stderr


@pytest.mark.parametrize("delay_s", [0.5, 2.0, 5.0])
def test_ctrl_c_at_any_moment_prints_one_line(delay_s: float, model_dir: Path) -> None:
    """A real SIGINT during start-up, model loading or generation."""
    process = subprocess.Popen(
        [sys.executable, "-m", "knapspec.cli", "generate", "--model", str(model_dir),
         "--prompt", "the cat", "--max-new-tokens", "200", "--no-chat", *STATIC],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )  # fmt: skip
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err
    if process.returncode == 0:  # finished before the signal: nothing to check
        return
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "knapspec: error: interrupted", err
