"""Docstrings and comments in ``src/knapspec`` say what and why, not where or how fast.

A measurement belongs to a machine, a commit and a day; quoted in a docstring it goes stale
unseen, and a reader cannot tell the reason from the run. So docstrings and comments name
no machine as the context of a measurement (an instruction set a kernel *uses*, such as
AVX-512 or AMX, is fine) and quote no timing or speed-up; where a figure explains a design
choice, they say the reason in words and point at ``docs/`` or ``results/`` (figures that
docstrings once quoted: ``results/engine/HISTORY.md``, "Figures behind docstrings").

The checker reads docstrings (every bare string statement: module, class, function and
attribute docstrings) and ``#`` comments. Code is not read: a format string that prints
``tok/s`` to a user is output, not a claim.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import knapspec

PACKAGE_ROOT = Path(knapspec.__file__).resolve().parent

#: A named CPU or GPU, or a core count: the machine a measurement ran on.
MACHINE = re.compile(
    r"\b(?:zen ?[1-6]|epyc|xeon|ryzen|threadripper|(?:sapphire|emerald|granite) rapids"
    r"|ice ?lake|cascade ?lake|cooper ?lake|skylake|genoa|milan|family 25|graviton"
    r"|neoverse|apple m[1-4]|[ahbl]100|h200|rtx ?\d{4}|\d+[- ]cores?)\b",
    re.IGNORECASE,
)

#: A number with a unit of time, a speed, or a comparative ratio of a run.
TIMING = re.compile(
    r"(?<![\w.])\d(?:[\d.,]*\d)?\s?(?:ms|[µμ]s|us|ns|seconds?|secs?|minutes?|mins?)\b"
    r"|(?<![\w.])\d(?:[\d.,]*\d)? s\b"
    r"|\d[\d.,]*\s?(?:tok|tokens)/s\b"
    r"|(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?[x×] "
    r"(?:faster|slower|less|more|as fast|low|high)\b"
    r"|(?<![\w.])\d+(?:\.\d+)?(?:\s?[-–]\s?\d+(?:\.\d+)?)? ?% "
    r"(?:faster|slower|better|worse|fewer|more|higher|lower|high|low)\b",
    re.IGNORECASE,
)

#: Phrases allowed where they stand, with the reason: ``(module under src/knapspec, phrase)``.
#: Keep this short; a new entry needs a reason that is not "it was measured here".
ALLOWED: dict[tuple[str, str], str] = {
    ("bench/env.py", "2x faster"): "env capture says why it records the CPU",
    ("bench/timing.py", "0.01 ms"): "the rounding of the measurement wing's own *_ms fields",
}


def prose(source: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for every line of a docstring or comment in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for offset, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


#: An inline code span: a name in code (a nox session ``zen4``, a flag) is not a claim.
CODE_SPAN = re.compile(r"``[^`]*``")


def measurements(text: str) -> list[str]:
    """The machine names (outside ````code```` spans) and quoted timings in ``text``."""
    machines = MACHINE.finditer(CODE_SPAN.sub("``", text))
    return [match.group(0) for match in (*machines, *TIMING.finditer(text))]


def findings(module: str, source: str) -> list[str]:
    """``module:line: phrase`` for each measurement in ``source``'s docstrings and comments
    that :data:`ALLOWED` does not allow there."""
    found = []
    for line, text in prose(source):
        for phrase in measurements(text):
            if (module, phrase) not in ALLOWED:
                found.append(f"{module}:{line}: {phrase!r} in {text.strip()!r}")
    return sorted(found)


def _modules() -> dict[str, str]:
    return {
        path.relative_to(PACKAGE_ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE_ROOT.rglob("*.py"))
    }


def test_the_checker_flags_machines_and_timings() -> None:
    flagged = [
        "On a 2-core AMD EPYC Zen 4 a decode step took 23.2 ms.",
        "1.9 ms of a 16-row round's 46",
        "the first engine pays the measurement (took 54 s)",
        "torch's argmax takes 45-55 µs, numpy's 5 µs",
        "a whole decode step was 1.6x faster",
        "the same path made a step 1.2-1.5x faster",
        "one reduction costs ~60x less than a mask",
        "on an AMX Xeon the fused attention is kept",
        "Even a 2048-row prefill product is 10-18 % faster.",
        "Sapphire Rapids",
        "predicted 282 tok/s, ran ~317",
        "drafting looked 18 % better than plain where it ran 1 % worse",
        "a prefill of 4,096 tokens took 2.5 seconds",
    ]
    for text in flagged:
        assert measurements(text), text


def test_the_checker_leaves_reasons_and_instruction_sets_alone() -> None:
    kept = [
        "bf16 on ``VDPBF16PS`` where the CPU has AVX512-BF16; AMX tiles of 16 rows",
        "``(rows, width, vocab)`` logits; 49152 entries; a 4-gram index",
        "one reduction costs a small fraction of an element-wise mask (see docs/performance.md)",
        "stop serving 503s, exit 1",
        "``seconds``: wall time; ``median_ms`` and ``p10_ms`` per setting",
        "the first 16 rows; γ = 0 wins; 13 × 2 = 26 rows; x = 1",
        "keeps 64 candidates, growing fourfold (4x the last)",
        "a 5 % predicted-gain margin",
        "``$KNAPSPEC_CPU_FLAGS`` (``nox -s amx``, ``zen4``, ``avx2``)",
    ]
    for text in kept:
        assert not measurements(text), (text, measurements(text))


def test_only_docstrings_and_comments_are_read() -> None:
    source = (
        '"""Module: on a 2-core EPYC it took 3 ms."""\n'
        "X = 1\n"
        '"""Attribute docstring: 1.5x faster."""\n'
        "def f() -> str:\n"
        '    """Function: fine."""\n'
        "    # comment: 0.8 s at 30k tokens\n"
        '    return f"{x:.1f} tok/s, 3 ms"  # printed, not claimed\n'
    )
    assert findings("example.py", source) == [
        "example.py:1: '2-core' in 'Module: on a 2-core EPYC it took 3 ms.'",
        "example.py:1: '3 ms' in 'Module: on a 2-core EPYC it took 3 ms.'",
        "example.py:1: 'EPYC' in 'Module: on a 2-core EPYC it took 3 ms.'",
        "example.py:3: '1.5x faster' in 'Attribute docstring: 1.5x faster.'",
        "example.py:6: '0.8 s' in '# comment: 0.8 s at 30k tokens'",
    ]
    # An allowed phrase passes only in its own module.
    allowed = '"""rounded to 0.01 ms"""\n'
    assert findings("bench/timing.py", allowed) == []
    assert findings("bench/other.py", allowed) != []


def test_no_docstring_names_a_machine_or_quotes_a_timing() -> None:
    found = [
        finding for module, source in _modules().items() for finding in findings(module, source)
    ]
    assert not found, (
        "docstrings and comments that name a machine or quote a timing (say the reason in "
        "words and point at docs/ or results/; results/engine/HISTORY.md, 'Figures behind "
        "docstrings', keeps the figures):\n" + "\n".join(found)
    )


def test_the_allow_list_is_still_needed() -> None:
    sources = _modules()
    for module, phrase in ALLOWED:
        texts = [text for _, text in prose(sources.get(module, ""))]
        assert any(phrase in measurements(text) for text in texts), (module, phrase)
