"""Mutation check: each bug a review injected must make at least one test fail.

For every mutant below, the script copies ``src/``, ``tests/`` and ``pyproject.toml`` to a
scratch directory, applies the mutant's text replacements (each must match exactly once,
so a refactor that moves the code makes the script fail loudly instead of checking
nothing), runs the named tests there with ``pytest -x`` under the ``ci`` hypothesis
profile, and records whether they failed. A mutant counts as *caught* only when pytest
exits with 1 (tests failed), not 2-5 (collection or usage errors).

    python benchmarks/mutation_check.py [--only NAME ...] [--baseline]

``--baseline`` first runs every mutant's tests on the unmutated tree (they must pass).
Writes ``results/mutants/mutation_check.json`` and ``results/mutants/summary.md``.
Not a timing measurement: run it through ``/work/coord/bin/cpu-shared`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]


@attrs.frozen
class Mutant:
    """A deliberate bug: ``(old, new)`` replacements in ``path``, and the tests that must fail."""

    name: str
    description: str
    path: str
    replacements: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


VERIFY = "src/knapspec/decoding/verify.py"
LEMMA = "src/knapspec/proxies/lemma.py"
SAMPLING_TESTS = (
    "tests/test_sampling_rounds.py::"
    "test_every_position_of_a_four_token_round_is_distributed_as_its_target_row",
    "tests/test_sampling.py::test_speculative_samples_are_distributed_as_the_target",
)

MUTANTS = (
    Mutant(
        "row-0-draft",
        "rejection sampling judges every position with the first draft row q_0",
        VERIFY,
        (
            ("q_x = draft_probs[index, tokens]", "q_x = draft_probs[0, tokens]"),
            (
                "residual_distribution(target_probs[j], draft_probs[j])",
                "residual_distribution(target_probs[j], draft_probs[0])",
            ),
        ),
        SAMPLING_TESTS,
    ),
    Mutant(
        "off-by-one-residual",
        "after a rejection at j, resample from norm(max(0, p_{j+1} - q_j))",
        VERIFY,
        (
            (
                "residual_distribution(target_probs[j], draft_probs[j])",
                "residual_distribution(target_probs[j + 1], draft_probs[j])",
            ),
        ),
        SAMPLING_TESTS,
    ),
    Mutant(
        "most-expensive-draft-shortcut",
        "the γ = 0 shortcut prices each budget by its most expensive draft",
        "src/knapspec/planners/knapsack.py",
        (("[-t for t in times]", "[t for t in times]"),),
        ("tests/test_planning_properties.py",),
    ),
    Mutant(
        "knapsack-never-drafts",
        "the knapsack planner always plans γ = 0",
        "src/knapspec/planners/knapsack.py",
        (
            (
                'round\'s lookup proposal cut at its TPT optimum, and γ = 0."""\n',
                'round\'s lookup proposal cut at its TPT optimum, and γ = 0."""\n'
                "        return DraftPlan.autoregressive(context.engine.num_layers)\n",
            ),
        ),
        ("tests/test_lossless_drafting.py",),
    ),
    Mutant(
        "drafting-disabled",
        "the decoder never drafts (every round is a plain step)",
        "src/knapspec/decoding/run.py",
        (
            (
                "draft = self._draft(plan, proposals, pending, n, budget)",
                "draft = self._draft(plan, proposals, pending, n, 0)",
            ),
        ),
        ("tests/test_lossless_drafting.py", *SAMPLING_TESTS),
    ),
    Mutant(
        "drafter-config-ignored",
        "the decoder builds each proposing drafter with its defaults, not its [drafters.NAME] "
        "section",
        "src/knapspec/config/factory.py",
        (
            (
                "drafters.append(cls.from_config(params, engine))",
                "drafters.append(cls.from_config(None, engine))",
            ),
        ),
        (
            "tests/test_drafters.py::test_the_lookup_section_sets_the_proposal_length",
            "tests/test_lossless_drafting.py",
        ),
    ),
    Mutant(
        "lookup-priors-ignored",
        "the knapsack planner prices lookup drafts with the default acceptance priors, not "
        "its lookup_* fields",
        "src/knapspec/planners/knapsack.py",
        (("LookupPricing(self.config.lookup_acceptance_config())", "LookupPricing()"),),
        ("tests/test_drafters.py::test_the_lookup_priors_of_the_config_price_the_drafts",),
    ),
    Mutant(
        "lemma-bound-twice-as-loose",
        "the cosine threshold 1 - ξ²/(2‖x‖²D²) loses its factor 1/2",
        LEMMA,
        (
            (
                "return torch.where(safe, 1 - ratio, torch.ones_like(ratio))",
                "return torch.where(safe, 1 - 2 * ratio, torch.ones_like(ratio))",
            ),
        ),
        ("tests/test_lemma_any_norm.py", "tests/test_lemma.py"),
    ),
    Mutant(
        "lemma-bound-uses-the-candidate-norm",
        "certify computes the cosine threshold with ‖x'‖ instead of ‖x‖",
        LEMMA,
        (
            (
                "bound = cosine_bound(margins.margin, x_norm, margins.max_distance)\n    positive",
                "bound = cosine_bound(margins.margin, candidate_norm, margins.max_distance)\n"
                "    positive",
            ),
        ),
        ("tests/test_lemma_any_norm.py", "tests/test_lemma.py"),
    ),
    Mutant(
        "lemma-cosine-only-for-equal-norms",
        "the over-cautious code this issue fixed: the cosine test is ignored unless "
        "‖x'‖ = ‖x‖ (must be caught as a non-vacuity failure, not a soundness one)",
        LEMMA,
        (
            (
                "certified_cosine = positive & nonzero & (cosine >= bound)",
                "certified_cosine = positive & nonzero & (cosine >= bound) & "
                "((candidate_norm - x_norm).abs() <= 1e-6 * x_norm)",
            ),
            ("nearest = torch.minimum(distance, rescaled)", "nearest = distance"),
        ),
        ("tests/test_lemma_any_norm.py",),
    ),
    Mutant(
        "layer-loop-plan-ignores-new-kernels",
        "the compiled layer loop keeps the pointers it planned after the engine's kernels "
        "change (how a substituted mutant kernel went unrun on a Zen 3)",
        "src/knapspec/model/kernels/layer_loop.py",
        (
            (
                "if engine.kernel_generation != self._generation:",
                "if False:",
            ),
        ),
        ("tests/test_exactness.py::test_a_mutant_kernel_in_an_exact_engine_is_caught",),
    ),
)


def _apply(tree: Path, mutant: Mutant) -> None:
    path = tree / mutant.path
    text = path.read_text()
    for old, new in mutant.replacements:
        count = text.count(old)
        if count != 1:
            raise SystemExit(
                f"mutant {mutant.name}: {old!r} occurs {count} times in {mutant.path} "
                "(the code moved: update the mutant)"
            )
        text = text.replace(old, new)
    path.write_text(text)


def _run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), HYPOTHESIS_PROFILE="ci")
    env["HF_HUB_OFFLINE"] = "1"
    started = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in process.stdout.splitlines() if line.strip()]
    return process.returncode, time.perf_counter() - started, lines[-1] if lines else ""


def _scratch_tree(base: Path) -> Path:
    tree = Path(tempfile.mkdtemp(dir=base))
    shutil.copytree(ROOT / "src", tree / "src")
    shutil.copytree(ROOT / "tests", tree / "tests")
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="run only these mutants")
    parser.add_argument("--baseline", action="store_true", help="check the clean tree first")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "mutants")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    records = []
    with tempfile.TemporaryDirectory(prefix="knapspec-mutants-") as scratch:
        base = Path(scratch)
        if args.baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            code, seconds, last = _run_tests(_scratch_tree(base), tests)
            print(f"baseline: exit {code} in {seconds:.0f} s: {last}", flush=True)
            if code != 0:
                raise SystemExit("the unmutated tree fails its tests; fix that first")
        for mutant in mutants:
            tree = _scratch_tree(base)
            _apply(tree, mutant)
            code, seconds, last = _run_tests(tree, mutant.tests)
            caught = code == 1
            print(
                f"{mutant.name}: {'caught' if caught else 'MISSED'} (exit {code}, "
                f"{seconds:.0f} s): {last}",
                flush=True,
            )
            records.append(
                {
                    "name": mutant.name,
                    "description": mutant.description,
                    "path": mutant.path,
                    "tests": list(mutant.tests),
                    "exit_code": code,
                    "caught": caught,
                    "seconds": round(seconds, 1),
                    "pytest_summary": last,
                }
            )
            shutil.rmtree(tree)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    (args.out / "mutation_check.json").write_text(
        json.dumps({"commit": commit, "mutants": records}, indent=2) + "\n"
    )
    rows = "\n".join(
        f"| {r['name']} | {r['description']} | {'caught' if r['caught'] else '**missed**'} | "
        f"{r['pytest_summary']} |"
        for r in records
    )
    (args.out / "summary.md").write_text(
        "# Mutation check\n\n"
        f"Command: `python benchmarks/mutation_check.py` at commit {commit}; each mutant "
        "applied to a scratch copy of the tree, its tests run with `pytest -x` "
        "(hypothesis profile `ci`). Caught = pytest exit code 1.\n\n"
        "| mutant | bug | result | pytest |\n|---|---|---|---|\n" + rows + "\n"
    )
    missed = [r["name"] for r in records if not r["caught"]]
    if missed:
        raise SystemExit(f"missed mutants: {', '.join(missed)}")


if __name__ == "__main__":
    main()
