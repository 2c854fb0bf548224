"""The documentation stays true: its examples run, every public name and error is documented.

Code-block convention for README.md and docs/*.md (write new docs this way):

* A fenced block whose info string is exactly ``python`` **runs**. The blocks of one file
  run in order in one namespace, so a later block may use names an earlier one defined.
  The namespace starts with ``model`` and ``tokenizer`` (see below), so a fragment such as
  ``decoder = SpeculativeDecoder(model)`` runs on its own.
* A block marked ``python skip`` (any word after ``python``) is shown but not run: use it
  for fragments that need the real model for minutes, a GPU, or a file the reader has, and
  say in the text around it why it cannot run. (``docs/api.md`` marks its signatures
  ``python signature``: highlighted, not run.)
* Other languages (``bash``, ``toml``, ``text``) are never run.

The real model is replaced by a tiny random Llama with SmolLM2's depth (30 layers, hidden
32) and an offline word-level tokenizer with a chat template: ``load_model_and_tokenizer``
is patched in ``knapspec`` and ``knapspec.model.loading.provision``, ``KNAPSPEC_CACHE`` points at a
temporary directory (profiles of the tiny model land there), and each file runs in a
temporary working directory holding a copy of ``examples/``. Components a document
registers are unregistered afterwards.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import knapspec
from knapspec.config import COMPONENT_REGISTRIES, load_builtin_components
from knapspec.drafters import DRAFTERS
from knapspec.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
TROUBLESHOOTING = DOCS / "troubleshooting.md"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)

WORDS = [
    "the",
    "capital",
    "of",
    "france",
    "is",
    "paris",
    "a",
    "an",
    "and",
    "to",
    "in",
    "it",
    "was",
    "that",
    "he",
    "she",
    "they",
    "you",
    "i",
    "we",
    "not",
    "for",
    "on",
    "with",
    "as",
    "his",
    "her",
    "at",
    "by",
    "be",
    "this",
    "had",
    "from",
    "or",
    "have",
    "but",
    "are",
    "were",
    "which",
    "all",
    "their",
    "one",
    "so",
    "if",
    "said",
    "no",
    "there",
    "what",
    "when",
    "who",
    "will",
    "more",
    "would",
    "been",
    "out",
    "up",
    "into",
    "my",
    "elizabeth",
    "darcy",
    "jane",
    "bennet",
    "bingley",
    "mr",
    "mrs",
    "miss",
    "pride",
    "prejudice",
    "plot",
    "summarize",
    "three",
    "sentences",
    "story",
    "novel",
    "love",
    "family",
    "sister",
    "marriage",
    "letter",
    "ball",
    "house",
    ".",
    ",",
    "!",
    "?",
    "'",
    "summary",
    "once",
    "upon",
    "time",
]


# ----------------------------------------------------------------------- tiny stand-ins
def tiny_tokenizer() -> Any:
    """An offline word-level tokenizer (unknown words map to [UNK]) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(["[UNK]", "[EOS]", *dict.fromkeys(WORDS)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} . {% endfor %}"
    return tokenizer


def tiny_model(vocab_size: int, num_layers: int = 30) -> Any:
    """A random Llama with SmolLM2's depth and a hidden size of 32 (milliseconds to build)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    tokenizer = tiny_tokenizer()
    return tiny_model(len(tokenizer)), tokenizer


@pytest.fixture
def offline_world(
    tiny: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, Any]]:
    """Patch the model loader, isolate the cache and the working directory, and undo any
    registration a document makes."""
    import knapspec.model.loading.provision as provision

    model, tokenizer = tiny

    def load_tiny(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return model, tokenizer

    monkeypatch.setattr(knapspec, "load_model_and_tokenizer", load_tiny)
    monkeypatch.setattr(provision, "load_model_and_tokenizer", load_tiny)
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KNAPSPEC_PROFILE", raising=False)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    load_builtin_components()
    registries: list[Registry[Any]] = [*COMPONENT_REGISTRIES.values(), DRAFTERS]
    before = [set(registry.names()) for registry in registries]
    try:
        yield model, tokenizer
    finally:
        for registry, names in zip(registries, before, strict=True):
            for name in set(registry.names()) - names:
                registry.unregister(name)


# ------------------------------------------------------------------ running the docs
def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, source, runs)`` of every python block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        info = match.group(1).strip().split()
        if not info or info[0] != "python":
            continue
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(2), len(info) == 1))
    return blocks


@pytest.mark.parametrize("path", MARKDOWN_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(path: Path, offline_world: tuple[Any, Any]) -> None:
    model, tokenizer = offline_world
    # A real (registered) module: the config layer resolves the type hints of a component
    # class through its module, so classes a document defines must live in one.
    module = ModuleType(f"docs_page_{path.stem.replace('-', '_')}")
    module.__dict__.update(model=model, tokenizer=tokenizer)
    sys.modules[module.__name__] = module
    try:
        for line, source, runs in python_blocks(path):
            if runs:
                _run_block(module, path, line, source)
    finally:
        del sys.modules[module.__name__]


def _run_block(module: ModuleType, path: Path, line: int, source: str) -> None:
    try:
        exec(compile(source, f"{path.name}:{line}", "exec"), module.__dict__)
    except Exception as error:
        pytest.fail(
            f"{path.relative_to(ROOT)}, the python block at line {line}, raised "
            f"{type(error).__name__}: {error}\n(mark it ```python skip if it is not meant "
            "to run; see the convention at the top of tests/test_docs.py)"
        )


def test_the_runner_sees_the_blocks_and_the_skip_marker(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n```python skip\ny = 2\n```\n\n```bash\nls\n```\n",
        encoding="utf-8",
    )
    assert python_blocks(page) == [(4, "x = 1\n", True), (8, "y = 2\n", False)]


def test_user_facing_docs_have_runnable_examples() -> None:
    """The pages whose examples must never rot do have running blocks."""
    for name in ("README.md", "docs/user-guide.md", "docs/extending.md", "docs/theory.md"):
        assert any(runs for _, _, runs in python_blocks(ROOT / name)), name


# ------------------------------------------------------------------ example scripts
def _load_example(name: str) -> ModuleType:
    return _load_example_script(DOCS / "examples" / name)


def test_custom_planner_example_runs_losslessly_via_config(
    offline_world: tuple[Any, Any],
) -> None:
    from knapspec import PLANNERS

    model, tokenizer = offline_world
    module = _load_example("custom_planner.py")
    assert "heuristic-early-exit" in PLANNERS
    result = module.demo(model, tokenizer, exit_layer=4, max_new_tokens=24)
    assert result.tokens.numel() == 24
    assert result.stats.drafted_tokens > 0  # it did speculate
    assert {plan.source for plan in result.stats.plans} == {"heuristic-early-exit"}


def test_custom_planner_example_adapts_gamma_like_its_docstring_says(
    offline_world: tuple[Any, Any],
) -> None:
    from knapspec import DraftPlan, StepOutcome, SublayerMask

    module = _load_example("custom_planner.py")
    planner = module.HeuristicEarlyExitPlanner(SublayerMask.early_exit(4, 2), 3)
    plan = DraftPlan(planner.mask, 3)
    planner.update(StepOutcome(plan, 10, drafted=3, accepted=3, draft_time_s=0, verify_time_s=0))
    assert planner.draft_length_ == 5
    planner.update(StepOutcome(plan, 14, drafted=5, accepted=1, draft_time_s=0, verify_time_s=0))
    assert planner.draft_length_ == 4
    planner.reset()
    assert planner.draft_length_ == 3


def test_custom_planner_by_dotted_path(
    offline_world: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extending guide's CLI recipe: an importable module named by path in a config."""
    from knapspec import DecoderConfig, SpeculativeDecoder

    model, _ = offline_world
    monkeypatch.syspath_prepend(str(DOCS / "examples"))
    monkeypatch.delitem(sys.modules, "custom_planner", raising=False)
    config = DecoderConfig.from_dict(
        {
            "allow_dotted_paths": True,
            "planner": {"name": "custom_planner:HeuristicEarlyExitPlanner", "exit_layer": 3},
        }
    )
    decoder = SpeculativeDecoder.from_config(model, config)
    assert type(decoder.planner).__name__ == "HeuristicEarlyExitPlanner"
    assert decoder.generate([5, 6, 7], max_new_tokens=8).tokens.numel() == 8


def test_quickstart_example_runs(offline_world: tuple[Any, Any]) -> None:
    module = _load_example("quickstart.py")
    model, tokenizer = offline_world
    result = module.main(model, tokenizer, max_new_tokens=12)
    assert result.tokens.numel() == 12


def test_architecture_picture_script_draws_the_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    module = _load_example_script(DOCS / "make_architecture_png.py")
    out = module.draw(tmp_path / "architecture.png")
    assert out.stat().st_size > 10_000
    assert (DOCS / "architecture.png").exists(), "run: python docs/make_architecture_png.py"


def _load_example_script(path: Path) -> ModuleType:
    """Import a file as a fresh module (registered in sys.modules, as an import would be:
    the config layer resolves a component's type hints through its module)."""
    name = f"docs_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ------------------------------------------------------------------------- reference
def test_every_public_name_has_its_own_docstring() -> None:
    missing = []
    for name in knapspec.__all__:
        obj = getattr(knapspec, name)
        if isinstance(obj, type):
            doc = vars(obj).get("__doc__")  # its own, not one inherited from a base class
        elif inspect.isroutine(obj):
            doc = obj.__doc__
        else:
            doc = type(obj).__doc__  # registries: the Registry class documents them
        if not (doc and doc.strip()):
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"


def test_api_reference_is_generated_and_up_to_date() -> None:
    module = _load_example_script(DOCS / "make_api.py")
    text = module.render()
    for name in knapspec.__all__:
        assert f"### `{name}`" in text, f"{name} is missing from docs/api.md"
    committed = (DOCS / "api.md").read_text(encoding="utf-8")
    assert committed == text, "docs/api.md is out of date; regenerate with: python docs/make_api.py"


# ------------------------------------------------------------------- troubleshooting
def raised_exception_names() -> dict[str, list[str]]:
    """Every exception class raised in src/knapspec (``raise X(...)`` / ``raise X``),
    with the places that raise it. Found with the AST, so comments and strings do not
    count and a new ``raise`` anywhere is picked up."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "src" / "knapspec").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Attribute):
                name = target.attr
            elif isinstance(target, ast.Name):
                name = target.id
            else:
                continue
            if name[:1].isupper():  # a class, not a re-raised variable (``raise error``)
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found.setdefault(name, []).append(where)
    return found


def defined_exception_names() -> set[str]:
    names = set()
    for path in (ROOT / "src" / "knapspec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(base, ast.Name) and base.id.endswith(("Error", "Exception"))
                for base in node.bases
            ):
                names.add(node.name)
    return names


def test_the_scan_finds_the_library_errors() -> None:
    raised = raised_exception_names()
    assert {"ConfigError", "ValueError", "ContextLengthError", "ProvisioningError"} <= set(raised)
    assert "SystemExit" in raised  # proves module-level raises count too


def test_every_raised_exception_is_in_the_troubleshooting_guide() -> None:
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    undocumented = {
        name: places
        for name, places in raised_exception_names().items()
        if f"`{name}`" not in text and name != "SystemExit"
    }
    assert not undocumented, (
        "exceptions raised by knapspec but not described (as `Name`) in "
        f"docs/troubleshooting.md: {undocumented}"
    )


def test_every_library_exception_class_is_in_the_troubleshooting_guide() -> None:
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    missing = sorted(name for name in defined_exception_names() if f"`{name}`" not in text)
    assert not missing, f"exception classes missing from docs/troubleshooting.md: {missing}"


# --------------------------------------------------------------------------- README
def test_readme_keeps_the_two_commands_first() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = re.search(r"TEST_COMMAND='([^']+)'", ci)
    assert command is not None
    blocks = [m.group(2).strip() for m in FENCE.finditer(text)]
    assert blocks[0].startswith("python3 -m venv .venv") and "knapspec generate" in blocks[0]
    assert blocks[1] == command.group(1)


def test_docs_links_point_at_files_that_exist() -> None:
    """Relative links in README and docs name files of this repository (no dead links)."""
    dead = []
    for path in MARKDOWN_FILES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text("utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                dead.append(f"{path.relative_to(ROOT)} -> {target}")
    # docs/benchmarks.md is written by `knapspec bench --docs docs/benchmarks.md`.
    dead = [d for d in dead if not d.endswith("benchmarks.md")]
    assert not dead, f"dead links: {dead}"


def test_commands_in_the_docs_exist() -> None:
    """Every ``knapspec SUBCOMMAND`` a page shows (in a bash block or inline code) is real."""
    import argparse

    from knapspec.cli import build_parser

    actions = build_parser()._subparsers._group_actions  # type: ignore[union-attr]
    known = {
        name
        for action in actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    }
    assert {"generate", "plan", "profile", "bench"} <= known
    for path in MARKDOWN_FILES:
        text = path.read_text("utf-8")
        shown = [
            sub
            for match in FENCE.finditer(text)
            if match.group(1).strip() in ("bash", "sh", "console")
            for sub in re.findall(
                r"^\s*(?:[A-Z_]+=\S+\s+)*knapspec (\w+)", match.group(2), re.MULTILINE
            )
        ]
        # Inline code that quotes an error message ("`knapspec cannot run ...`") is prose.
        shown += [s for s in re.findall(r"`knapspec (\w+)[ `]", text) if s != "cannot"]
        unknown = sorted(set(shown) - known)
        assert not unknown, f"{path.relative_to(ROOT)} shows unknown subcommands {unknown}"
