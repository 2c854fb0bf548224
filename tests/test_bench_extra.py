"""The measurement wing is an optional extra: the core installs and imports no matplotlib.

``pyproject.toml`` keeps matplotlib out of the core dependencies and in the ``bench``
extra (which ``test`` pulls, so CI runs the harness's tests); importing the package and
its core paths loads no matplotlib; ``knapspec bench`` without the extra names the install
command instead of failing in the middle of a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The core paths a user without the extra takes: the package's names, the decoder, the
#: config, the command's parser, the server and the Hugging Face integration.
CORE_IMPORTS = """
import sys
import knapspec
from knapspec import SpeculativeDecoder, DecoderConfig, load_model_and_tokenizer
import knapspec.cli, knapspec.cli.parser, knapspec.integrations.hf, knapspec.model.loading.by_name
import knapspec.decoding.continuous, knapspec.planners.batch
knapspec.cli.parser.build_parser()
print(sorted(name for name in sys.modules if name.split('.')[0] == 'matplotlib'))
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )


def _requirement_names(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        name = requirement.split(";")[0].split("[")[0]
        for stop in "<>=!~ ":
            name = name.split(stop)[0]
        names.add(name.strip().lower())
    return names


def test_matplotlib_is_in_the_bench_extra_only() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    assert "matplotlib" not in _requirement_names(project["dependencies"])
    assert "matplotlib" in _requirement_names(extras["bench"])
    # CI installs .[dev] -> .[test]: it must pull the bench extra, or the harness's tests
    # would run without their plotting library.
    assert any(r.startswith("knapspec[") and "bench" in r for r in extras["test"])


def test_the_core_imports_no_matplotlib() -> None:
    result = _python(CORE_IMPORTS)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
    # The check has power: the same probe sees matplotlib once something imports it.
    seen = _python(CORE_IMPORTS.replace("import sys\n", "import sys, matplotlib\n", 1))
    assert seen.returncode == 0, seen.stderr
    assert "'matplotlib'" in seen.stdout


def test_bench_without_the_extra_names_the_install_command() -> None:
    # None in sys.modules makes `import matplotlib` fail and find_spec report it missing,
    # as in an installation without the extra.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from knapspec.cli import main\n"
        "sys.exit(main(['bench', '--quick']))\n"
    )
    result = _python(code)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "knapspec: error: knapspec bench needs the bench extra (matplotlib" in result.stderr
    assert "pip install 'knapspec[bench]'" in result.stderr
