"""Bad input as users meet it (issue 22): every case of docs/troubleshooting.md's
"Bad input, tried" table is kept by a test here.

CLI cases run in-process through ``main(argv)`` where that is enough, and in a subprocess
where the shell's view matters (exit code, no traceback, Ctrl-C); both use the tiny random
Llama saved by ``tests/test_cli.py``'s fixture, so no real model is needed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.test_cli import STATIC, assert_user_error, model_dir, run_cli

from knapspec.cli import generate as cli_generate
from knapspec.cli import main
from knapspec.cli import plan as cli_plan

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

    monkeypatch.setattr(cli_generate, "load_model", no_model)
    monkeypatch.setattr(cli_plan, "load_model", no_model)
    for command in ("generate", "plan"):
        args = [command, "--prompt", "the cat", "--set", "planner.acceptance_smoothing=2"]
        assert main(args) == 2
        assert "planner.acceptance_smoothing: must be in (0, 1)" in one_error_line(capsys)
    assert main(["plan", "--prompt", "x", "--set", "planner.every_rounds=0"]) == 2
    assert "planner.every_rounds: must be an integer >= 1" in one_error_line(capsys)


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

# What pybind11 does when a Ctrl-C lands while an extension module initialises (seen in CI:
# scipy's HiGHS, imported by sklearn): the interrupt comes back as an ImportError from it.
_INTERRUPT_IN_AN_EXTENSION_INIT = """
import sys
class InterruptInit:
    def find_spec(self, name, path=None, target=None):
        if name == "sklearn":
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as interrupt:
                raise ImportError("initialization failed") from interrupt
sys.meta_path.insert(0, InterruptInit())
from knapspec.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def _run_script(script: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -c script args`` in a fresh interpreter, output captured."""
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )


def test_ctrl_c_during_the_heavy_imports_prints_one_line(model_dir: Path) -> None:
    """Deterministic: the Ctrl-C arrives exactly when torch starts to import."""
    for args in (["generate", "--model", str(model_dir), "--prompt", "x"], ["plan", "--help"]):
        result = _run_script(_INTERRUPT_AT_TORCH_IMPORT, args)
        if args[-1] == "--help":  # help needs no heavy import at all
            assert result.returncode == 0 and "usage: knapspec plan" in result.stdout
            continue
        assert result.returncode == 130, result.stderr
        assert result.stderr == "knapspec: error: interrupted\n", result.stderr


def test_ctrl_c_inside_an_extensions_initialisation_prints_one_line(model_dir: Path) -> None:
    """The interrupt surfaces as an ImportError caused by it; a real ImportError does not."""
    args = ["generate", "--model", str(model_dir), "--prompt", "x"]
    result = _run_script(_INTERRUPT_IN_AN_EXTENSION_INIT, args)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "knapspec: error: interrupted\n", result.stderr
    broken = _INTERRUPT_IN_AN_EXTENSION_INIT.replace(
        'raise ImportError("initialization failed") from interrupt',
        'raise ImportError("a broken install")',
    )
    result = _run_script(broken, args)
    assert result.returncode == 1 and "ImportError: a broken install" in result.stderr


# Not earlier than 1.5 s: before knapspec's main runs, the interpreter's own start-up
# (site, .pth files) answers Ctrl-C with its traceback, which no library can catch.
@pytest.mark.parametrize("delay_s", [1.5, 4.0, 8.0])
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
    lines = err.strip().splitlines()
    if process.returncode == 0 or (lines and "tokens/s" in lines[-1]):
        # Generation finished (its stats line was printed) before the signal, which then
        # reached the exiting interpreter: nothing left to interrupt, no traceback.
        return
    # 130, or death by the re-raised SIGINT (the shell shows 130 too) after the line.
    assert process.returncode in (130, -signal.SIGINT), err
    assert err.strip().splitlines()[-1] == "knapspec: error: interrupted", err


# ------------------------------------------------------------ Python entry points
def _decoder(num_layers: int = 3) -> Any:
    """A decoder over a tiny random Llama whose static draft always drafts 3 tokens."""
    from tests.tiny_models import tiny_model

    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.planners import StaticPlanner
    from knapspec.types import SublayerMask

    model = tiny_model("llama", num_layers=num_layers)
    plan = StaticPlanner(SublayerMask.from_skipped(num_layers, [1, 3]), 3)
    return SpeculativeDecoder(model, planner=plan, confidence_threshold=0.0)


PROMPT = [5, 17, 42, 8, 61]


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
        ({"max_new_tokens": "4"}, TypeError, "max_new_tokens"),
        ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
        ({"eos_token_id": "2"}, TypeError, "eos_token_id"),
        ({"eos_token_id": [2, 3.5]}, TypeError, "eos_token_id"),
        ({"sampling": 0.7}, TypeError, "sampling"),
        ({"sampling": {"tempreature": 0.7}}, TypeError, "sampling: unknown field"),
        ({"sampling": {"do_sample": True, "seed": 2**70}}, ValueError, "seed"),
        ({"sampling": {"top_k": 2.5}}, TypeError, "top_k"),
        ({"logits_processor": "repetition_penalty"}, TypeError, "logits_processor"),
    ],
)
def test_generate_checks_argument_types_and_names_them(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    decoder = _decoder()
    with pytest.raises(error, match=name):
        decoder.generate(PROMPT, **kwargs)
    assert decoder.generate(PROMPT, max_new_tokens=3).tokens.numel() == 3  # still usable


def test_generate_accepts_numpy_integers_and_a_sampling_dict() -> None:
    import numpy as np

    from knapspec.sampling import SamplingParams

    decoder = _decoder()
    greedy = decoder.generate(PROMPT, max_new_tokens=np.int64(10)).tokens
    eos = int(greedy[3])
    stopped = decoder.generate(PROMPT, max_new_tokens=10, eos_token_id=np.int64(eos)).tokens
    assert stopped.tolist() == greedy[: greedy.tolist().index(eos) + 1].tolist()
    as_dict = {"do_sample": True, "temperature": 0.8, "seed": 3}
    first = decoder.generate(PROMPT, max_new_tokens=8, sampling=as_dict).tokens
    second = decoder.generate(PROMPT, max_new_tokens=8, sampling=SamplingParams(**as_dict))
    assert torch.equal(first, second.tokens)


# ------------------------------------------------------------------- thread safety
def test_two_threads_on_one_decoder_never_get_a_wrong_token() -> None:
    """100 generate calls from two threads sharing one decoder (50 each), every result
    compared with that thread's single-threaded greedy output. Without the decoder's
    lock, interleaved rounds corrupt the shared cache (wrong tokens or a KV-cache gap)."""
    import threading

    decoder = _decoder()
    prompts = [PROMPT, [9, 3, 77, 21]]
    expected = [decoder.generate(p, max_new_tokens=12).tokens.tolist() for p in prompts]
    assert expected[0] != expected[1]
    failures: list[str] = []
    start = threading.Barrier(2)

    def worker(index: int) -> None:
        start.wait()
        for round_index in range(50):
            try:
                got = decoder.generate(prompts[index], max_new_tokens=12).tokens.tolist()
            except Exception as error:
                failures.append(f"thread {index} round {round_index}: {error!r}")
                return
            if got != expected[index]:
                failures.append(f"thread {index} round {round_index}: {got} != {expected[index]}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


# ------------------------------------------------------------------ custom_generate
def _hf_pair() -> tuple[Any, Any]:
    """The tiny model and a custom_generate over a decoder that drafts every round,
    with a spy counting drafted tokens."""
    from knapspec.integrations.hf import make_custom_generate

    decoder = _decoder()
    drafted: list[int] = []
    update = decoder.planner.update

    def spy(outcome: Any) -> None:
        drafted.append(outcome.drafted)
        update(outcome)

    decoder.planner.update = spy
    generate = make_custom_generate(decoder)
    generate.drafted = drafted  # type: ignore[attr-defined]
    return decoder.engine.model, generate


@pytest.mark.parametrize(
    "settings",
    [
        {"repetition_penalty": 2.0},
        {"repetition_penalty": 0.5},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 12, "eos_token_id": "SECOND"},
        {"min_length": 14, "eos_token_id": "SECOND"},
        {"bad_words_ids": [["FIRST"]]},
        {"repetition_penalty": 1.5, "min_new_tokens": 8, "eos_token_id": "SECOND"},
    ],
    ids=["rep2", "rep0.5", "no-repeat-2gram", "min_new_tokens", "min_length", "bad_words",
         "combined"],
)  # fmt: skip
def test_custom_generate_honours_processors_greedy(settings: dict[str, Any]) -> None:
    """Greedy output equals model.generate's own, token for token, with drafting on."""
    model, custom = _hf_pair()
    ids = torch.tensor([PROMPT])
    plain = model.generate(ids, max_new_tokens=16, do_sample=False)[0, len(PROMPT) :].tolist()
    names = {"FIRST": plain[0], "SECOND": plain[1]}  # an EOS that would stop after 2 tokens

    def resolve(value: Any) -> Any:
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return names.get(value, value)

    kwargs = {key: resolve(value) for key, value in settings.items()}
    reference = model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs)
    ours = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=custom, **kwargs)
    assert ours.tolist() == reference.tolist()
    assert sum(custom.drafted) > 0  # speculation ran
    if "min_new_tokens" in settings:
        assert ours.shape[1] - len(PROMPT) >= settings["min_new_tokens"]


def test_custom_generate_sampling_follows_torch_global_seed() -> None:
    model, custom = _hf_pair()
    ids = torch.tensor([PROMPT])
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(
            model.generate(ids, max_new_tokens=16, do_sample=True, temperature=1.5, top_k=0,
                           repetition_penalty=1.3, custom_generate=custom).tolist()
        )  # fmt: skip
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert sum(custom.drafted) > 0


def test_custom_generate_sampling_with_a_processor_is_distributed_as_the_target() -> None:
    """The first two tokens of 400 sampled runs against the exact joint distribution
    under the repetition penalty (computed from the model with transformers' processor):
    a chi-square test, with a power check that ignoring the penalty is detected."""
    from scipy.stats import chisquare
    from tests.test_sampling import _small_vocab_model
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.planners import StaticPlanner
    from knapspec.types import SublayerMask

    model = _small_vocab_model()
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(SublayerMask.from_skipped(3, [1, 2, 3]), 2),
        confidence_threshold=0.0,
    )  # fmt: skip
    prompt = [1, 2, 1]
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0)])

    def joint(processor: Any) -> torch.Tensor:
        """``(V, V)`` exact P(first, second) under ``processor`` (or none)."""
        with torch.no_grad():
            first_logits = model(torch.tensor([prompt])).logits[0, -1:]
            if processor is not None:
                first_logits = processor(torch.tensor([prompt]), first_logits)
            p_first = first_logits.softmax(-1)[0]
            rows = []
            for token in range(p_first.numel()):
                prefix = torch.tensor([[*prompt, token]])
                logits = model(prefix).logits[0, -1:]
                if processor is not None:
                    logits = processor(prefix, logits)
                rows.append(p_first[token] * logits.softmax(-1)[0])
        return torch.stack(rows).double()

    truth, unpenalised = joint(penalty), joint(None)
    assert float((truth - unpenalised).abs().sum()) > 0.2  # the penalty matters
    counts = torch.zeros_like(truth)
    for seed in range(400):
        sampling = {"do_sample": True, "seed": seed}
        tokens = decoder.generate(
            prompt, max_new_tokens=2, sampling=sampling, logits_processor=penalty
        ).tokens.tolist()
        counts[tokens[0], tokens[1]] += 1

    def pvalue(expected: torch.Tensor) -> float:
        flat, seen = expected.flatten() * 400, counts.flatten()
        keep = flat >= 1  # cells too rare to test are pooled into one
        observed = [*seen[keep].tolist(), float(seen[~keep].sum())]
        wanted = [*flat[keep].tolist(), float(flat[~keep].sum())]
        if wanted[-1] == 0:
            observed, wanted = observed[:-1], wanted[:-1]
        scale = sum(observed) / sum(wanted)
        return float(chisquare(observed, [w * scale for w in wanted]).pvalue)

    assert pvalue(truth) > 1e-3
    assert pvalue(unpenalised) < 1e-6  # power: the test sees a sampler without the penalty


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        ({"num_beams": 2}, "num_beams=2 (beam search)"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha=0.6"),
        ({"guidance_scale": 1.5}, "guidance_scale=1.5"),
        ({"return_dict_in_generate": True}, "return_dict_in_generate=True"),
        ({"max_time": 5.0}, "max_time=5.0"),
    ],
)
def test_custom_generate_refuses_by_name_what_it_cannot_honour(
    settings: dict[str, Any], name: str
) -> None:
    model, custom = _hf_pair()
    with pytest.raises(ValueError, match=re.escape(name)):
        model.generate(torch.tensor([PROMPT]), max_new_tokens=4, custom_generate=custom, **settings)


def test_ctrl_c_dropped_in_a_finalizer_is_still_an_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C landing in an object's ``__del__`` (seen in a tokenizer's regex cache) is one
    Python prints and drops: the command records it instead, prints its one line and
    exits 130, with no traceback; the previous unraisable hook comes back afterwards."""
    import knapspec.cli as cli

    class Finalised:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    def command(argv: object) -> int:
        Finalised()  # collected at once: its KeyboardInterrupt is unraisable
        return 0

    hook = sys.unraisablehook
    monkeypatch.setattr(cli, "_main", command)
    assert cli.main([]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "knapspec: error: interrupted"
    assert sys.unraisablehook is hook
