"""Generate ``docs/api.md``, the API reference, from the docstrings of ``knapspec.__all__``.

Run from the repository root::

    python docs/make_api.py            # rewrite docs/api.md
    python docs/make_api.py --check    # exit 1 when docs/api.md is out of date

``tests/test_docs.py`` runs the same generator and fails when the committed file differs,
so the reference cannot drift from the code. Only ``inspect`` is used: the output is plain
Markdown that GitHub renders and that reads well offline.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import knapspec
from knapspec.components import Component
from knapspec.config import load_builtin_components
from knapspec.registry import Registry

API_PATH = Path(__file__).resolve().parent / "api.md"
REGENERATE = "python docs/make_api.py"

#: Reading order of the reference; every public name must land in exactly one section.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Decoding": (
        "SpeculativeDecoder",
        "Conversation",
        "ConversationTurn",
        "GenerationResult",
        "GenerationStats",
        "PlanRecord",
        "SamplingParams",
        "load_model_and_tokenizer",
    ),
    "Configuration": (
        "DecoderConfig",
        "ComponentConfig",
        "load_config",
        "save_config",
        "Registry",
        "Component",
        "PLANNERS",
        "COST_MODELS",
        "PROXIES",
    ),
    "Planners": (
        "Planner",
        "PlanningContext",
        "KnapsackPlanner",
        "BayesianPlanner",
        "CLaSpPlanner",
        "DELPlanner",
        "StaticPlanner",
        "EarlyExitPlanner",
        "AutoregressivePlanner",
    ),
    "Cost models": (
        "CostModel",
        "LatencyObservation",
        "FittedLinearCostModel",
        "OnlineCalibratedCostModel",
        "LatencyProfile",
        "profile_engine",
    ),
    "Value proxies": (
        "ValueProxy",
        "AcceptanceEstimate",
        "CosineProxy",
        "MonteCarloAcceptanceProxy",
    ),
    "Engine and records": (
        "SublayerEngine",
        "KVCache",
        "ReferenceWindow",
        "SublayerMask",
        "DraftPlan",
        "StepOutcome",
    ),
    "Errors": (
        "ConfigError",
        "UnknownComponentError",
        "UnsupportedModelError",
        "ContextLengthError",
        "ConversationError",
        "ConversationBusyError",
        "NonFiniteLogitsError",
        "ProvisioningError",
        "ProfileError",
        "ProfileMismatchError",
    ),
}

_SKIPPED_BASES = (object, BaseException, Exception)


_SECTION = re.compile(r"^(Args|Attributes|Returns|Raises|Yields|Example|Examples|Note):$")
_ENTRY = re.compile(r"^ {4}(\S[^:]*?):(\s.*|)$")
_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def _markdown(doc: str) -> str:
    """Google-style docstring -> Markdown: sections become bold labels with bullet lists,
    ``::`` literal blocks become fenced code, reST roles and double backticks become code."""
    doc = _ROLE.sub(_role, doc).replace("``", "`")
    out: list[str] = []
    lines = doc.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        section = _SECTION.match(line)
        if section:
            out += [f"**{section.group(1)}:**", ""]
            while index < len(lines) and (lines[index].startswith("    ") or not lines[index]):
                body = lines[index]
                index += 1
                if not body:
                    continue
                entry = _ENTRY.match(body)
                if entry and section.group(1) != "Returns":
                    out.append(f"- `{entry.group(1)}`:{entry.group(2)}")
                elif out and out[-1].startswith("- ") and body.startswith("        "):
                    out[-1] += " " + body.strip()
                else:
                    out.append(f"- {body.strip()}")
            out.append("")
        elif line.rstrip().endswith("::"):
            out += [line.rstrip()[:-1], "", "```"]
            while index < len(lines) and (lines[index].startswith("    ") or not lines[index]):
                out.append(lines[index][4:])
                index += 1
            while out[-1] == "":
                out.pop()
            out += ["```", ""]
        else:
            out.append(line)
    return "\n".join(out).strip()


def _doc(obj: Any) -> str:
    """The object's own docstring as Markdown (``""`` when it has none)."""
    return _markdown(inspect.cleandoc(obj.__doc__)) if obj.__doc__ else ""


class _Raw(str):
    """An annotation string that ``inspect`` prints without quotes."""

    def __repr__(self) -> str:
        return str(self)


_NO_DEFAULT_REPR = {"NOTHING": "<factory>"}


def _signature(obj: Callable[..., Any]) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # builtin-backed callables (exception classes)
        return "(...)"
    parameters = []
    for parameter in signature.parameters.values():
        annotation = parameter.annotation
        if isinstance(annotation, str):
            parameter = parameter.replace(annotation=_Raw(annotation))
        if repr(parameter.default) in _NO_DEFAULT_REPR:  # attrs factories
            parameter = parameter.replace(default=_Raw(_NO_DEFAULT_REPR[repr(parameter.default)]))
        parameters.append(parameter)
    returns = signature.return_annotation
    if isinstance(returns, str):
        returns = _Raw(returns)
    return str(signature.replace(parameters=parameters, return_annotation=returns))


def _kind(obj: Any) -> str:
    if isinstance(obj, type):
        if issubclass(obj, BaseException):
            bases = ", ".join(base.__name__ for base in obj.__bases__)
            return f"exception ({bases})"
        return "abstract class" if inspect.isabstract(obj) else "class"
    if isinstance(obj, Registry):
        return "registry"
    return "function"


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties defined by knapspec classes in ``cls``'s MRO.

    What every component inherits from :class:`Component` is listed once, under it.
    """
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass in _SKIPPED_BASES or not klass.__module__.startswith("knapspec"):
            continue
        if klass is Component and cls is not Component:
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member) or isinstance(member, property):
                seen.add(name)
                yield name, member


def _member_block(name: str, member: Any, owner: type) -> list[str]:
    if isinstance(member, property):
        header = f"- **`{name}`** (property)"
        doc = _doc(member.fget) if member.fget is not None else ""
    else:
        raw = inspect.getattr_static(owner, name)
        prefix = "classmethod " if isinstance(raw, classmethod) else ""
        prefix = "staticmethod " if isinstance(raw, staticmethod) else prefix
        header = f"- {prefix}**`{name}{_signature(member)}`**"
        doc = _doc(member)
    if not doc:
        return [header]
    indented = "\n".join(f"  {line}" if line else "" for line in doc.splitlines())
    return [header, "", indented]


def _registry_block(registry: Registry[Any]) -> list[str]:
    lines = [f"Registered {registry.kind}s (name: class):", ""]
    for name in registry.names():
        cls = registry.get(name)
        summary = _doc(cls).split("\n\n")[0].replace("\n", " ")
        lines.append(f"- `{name}`: `{cls.__name__}` — {summary}")
    return lines


def render_entry(name: str) -> list[str]:
    """Markdown for one public name: heading, kind, signature, docstring, members."""
    obj = getattr(knapspec, name)
    lines = [f"### `{name}`", ""]
    kind = _kind(obj)
    if isinstance(obj, Registry):
        lines += [f"*registry* `knapspec.{name}` — `Registry({obj.kind!r})`", ""]
        lines += _registry_block(obj)
        return [*lines, ""]
    where = f"{obj.__module__}.{obj.__qualname__}"
    lines += [f"*{kind}* `{where}`", ""]
    is_exception = isinstance(obj, type) and issubclass(obj, BaseException)
    if not is_exception:  # exception classes take a message; their signature says nothing
        lines += ["```python signature", f"{name}{_signature(obj)}", "```", ""]
    doc = _doc(obj)
    if doc:
        lines += [doc, ""]
    if isinstance(obj, type) and not is_exception:
        members = sorted(_members(obj), key=lambda item: item[0])
        if members:
            lines += ["Members:", ""]
            for member_name, member in members:
                lines += _member_block(member_name, member, obj)
            lines.append("")
    return lines


def render() -> str:
    """The whole of ``docs/api.md``."""
    load_builtin_components()  # so the registries list every built-in
    listed = [name for names in SECTIONS.values() for name in names]
    missing = sorted(set(knapspec.__all__) - set(listed))
    sections = dict(SECTIONS)
    if missing:
        sections["Other"] = tuple(missing)
    lines = [
        "# API reference",
        "",
        "<!-- Generated by docs/make_api.py from the docstrings of knapspec.__all__; do not",
        f"     edit by hand. Regenerate with: {REGENERATE} -->",
        "",
        "Everything below is importable from the top-level package, e.g.",
        "`from knapspec import SpeculativeDecoder`. Tensor shapes are given in the",
        "docstrings; item `2i` is the attention sublayer of layer `i` and item `2i + 1` its",
        "MLP. The transformers integration lives in `knapspec.integrations.hf`",
        "(`knapspec_generate`, `make_custom_generate`), see the",
        "[user guide](user-guide.md#modelgenerate-with-custom_generate).",
        "",
        "## Contents",
        "",
    ]
    for title, names in sections.items():
        anchors = ", ".join(f"[`{n}`](#{n.lower()})" for n in names)
        lines.append(f"- **{title}**: {anchors}")
    lines.append("")
    for title, names in sections.items():
        lines += [f"## {title}", ""]
        for name in names:
            if name in knapspec.__all__:
                lines += render_entry(name)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if docs/api.md is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = API_PATH.read_text(encoding="utf-8") if API_PATH.exists() else ""
        if current != text:
            print(f"{API_PATH} is out of date; regenerate with: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    API_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {API_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
