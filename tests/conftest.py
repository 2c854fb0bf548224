"""Shared fixtures: tiny random models of every supported family, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile(
    "dev", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-flags",
        default=None,
        help=(
            "run as a CPU with these flags would (space separated, e.g. 'amx_bf16 amx_tile "
            "avx512_bf16'): sets $KNAPSPEC_CPU_FLAGS, which the dtype choice and the cache "
            "keys read in place of /proc/cpuinfo (nox -s amx; docs/extending.md)"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    flags = config.getoption("--cpu-flags")
    if flags is not None:  # before any test; subprocesses (the CLI tests) inherit it
        os.environ["KNAPSPEC_CPU_FLAGS"] = flags


def pytest_report_header(config: pytest.Config) -> str | None:
    flags = os.environ.get("KNAPSPEC_CPU_FLAGS")
    return f"knapspec: claimed CPU flags {flags!r} ($KNAPSPEC_CPU_FLAGS)" if flags else None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line counting the tests skipped for a compiled unit this CPU (or the claimed
    one) lacks (tests/units.py), by unit, so a run says what it could not check here."""
    from units import NATIVE_SKIP

    units: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        if NATIVE_SKIP in reason:
            unit = reason.split(NATIVE_SKIP + ": ", 1)[-1].split(" (", 1)[0]
            units[unit] = units.get(unit, 0) + 1
    counts = ", ".join(f"{unit} {count}" for unit, count in sorted(units.items())) or "none"
    terminalreporter.write_line(
        f"knapspec: {sum(units.values())} tests skipped for units only a CPU with them runs "
        f"natively ({counts})"
    )


@pytest.fixture(autouse=True)
def _one_thread(request: pytest.FixtureRequest) -> None:
    # Tiny models run fastest on one thread (two threads contend on a 2-core CI machine).
    # Real-model tests use two, as the benchmarks do, unless pytest-xdist runs other
    # workers beside them: two OpenMP threads sharing their cores with another worker spin
    # and wait for each other (a 50-second test took 540 s that way).
    parallel = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
    real = request.node.get_closest_marker("real_model") is not None
    torch.set_num_threads(2 if real and not parallel else 1)
