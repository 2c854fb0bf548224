"""DecoderConfig: round trips, validation naming the field, files, ``--set`` overrides, docs.

Configs are generated generically from the registries: every registered planner, cost model
and proxy is a candidate, and its params are drawn field by field from the type hints,
keeping only values the field's own validator accepts. A component added later is covered
without editing this file.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from knapspec.config import (
    COMPONENT_REGISTRIES,
    ComponentConfig,
    ConfigError,
    DecoderConfig,
    apply_overrides,
    load_builtin_components,
    load_config,
    parse_override,
    save_config,
)
from knapspec.drafters import LookupAcceptanceConfig, LookupConfig
from knapspec.introspection import (
    attribute_docs,
    component_fields,
    describe_fields,
    drafter_fields,
)
from knapspec.planners.static import EarlyExitPlannerConfig, StaticPlannerConfig
from knapspec.registry import UnknownComponentError
from knapspec.sampling import SamplingParams

load_builtin_components()

ROOT = Path(__file__).resolve().parents[1]

#: The components the default DecoderConfig names; tests that need DecoderConfig() need them.
DEFAULTS_REGISTERED = all(
    getattr(attrs.fields(DecoderConfig), kind).default.factory().name in registry
    for kind, registry in COMPONENT_REGISTRIES.items()
)
needs_defaults = pytest.mark.skipif(
    not DEFAULTS_REGISTERED, reason="a default component (knapsack/online/cosine) is not registered"
)


def explicit(**kwargs: Any) -> DecoderConfig:
    """A config naming registered components only (works before the defaults exist)."""
    components: dict[str, Any] = {
        kind: registry.names()[0] for kind, registry in COMPONENT_REGISTRIES.items()
    }
    components["planner"] = "static"
    components.update(kwargs)
    return DecoderConfig(**components)


def _registries_populated() -> bool:
    return all(registry.names() for registry in COMPONENT_REGISTRIES.values())


needs_components = pytest.mark.skipif(
    not _registries_populated(), reason="some component registry is still empty"
)


# ----------------------------------------------------------------------- strategies
def _field_accepts(cls: type, field: attrs.Attribute[Any], value: Any) -> bool:
    try:
        converted = field.converter(value) if field.converter is not None else value  # type: ignore[operator]
        if field.validator is not None:
            field.validator(None, field, converted)
    except (ValueError, TypeError):
        return False
    except Exception:  # a validator that needs the instance: let construction decide
        return True
    return True


def _values_for(hint: Any, default: Any) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_values_for(arg, default) for arg in args])
    if hint is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(_values_for(args[0], None), max_size=6).map(tuple)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-2, 70)
    if hint is float:
        return st.one_of(
            st.floats(0.0, 1.0), st.floats(-2.0, 50.0, allow_nan=False, allow_infinity=False)
        )
    if hint is str and isinstance(default, str):
        return st.just(default)
    return st.just(default)


def params_strategy(cls: type) -> st.SearchStrategy[Any]:
    """Valid instances of an attrs config class, drawn field by field."""
    hints = typing.get_type_hints(cls, globalns=vars(__import__(cls.__module__, fromlist=["_"])))
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in attrs.fields(cls):
        if not field.init:
            continue
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        values = st.one_of(st.just(default), _values_for(hints.get(field.name, Any), default))
        fields[field.name] = values.filter(
            lambda value, f=field: _field_accepts(cls, f, value)  # type: ignore[misc]
        )

    def build(kwargs: dict[str, Any]) -> Any:
        try:
            return cls(**kwargs)
        except (ValueError, TypeError):  # a cross-field constraint
            return None

    return st.fixed_dictionaries(fields).map(build).filter(lambda params: params is not None)


def component_strategy(kind: str) -> st.SearchStrategy[ComponentConfig]:
    registry = COMPONENT_REGISTRIES[kind]  # type: ignore[index]
    return st.sampled_from(registry.names()).flatmap(
        lambda name: params_strategy(registry.get(name).config_class).map(
            lambda params: ComponentConfig(name, params)
        )
    )


decoder_configs = st.builds(
    DecoderConfig,
    planner=component_strategy("planner"),
    cost_model=component_strategy("cost_model"),
    proxy=component_strategy("proxy"),
    sampling=params_strategy(SamplingParams),
    max_draft_length=st.integers(1, 32),
    window_rounds=st.integers(1, 16),
    window_max_tokens=st.integers(1, 512),
    confidence_threshold=st.floats(0.0, 1.0),
    allow_dotted_paths=st.booleans(),
)

SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow]
)


# ---------------------------------------------------------------------- round trips
@needs_components
@SETTINGS
@given(decoder_configs)
def test_dict_round_trip(config: DecoderConfig) -> None:
    data = config.to_dict()
    json.dumps(data)  # the dict form is plain data
    assert DecoderConfig.from_dict(data) == config


@needs_components
@SETTINGS
@given(decoder_configs)
def test_json_and_toml_round_trip(config: DecoderConfig) -> None:
    assert DecoderConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    import tomllib

    assert DecoderConfig.from_dict(tomllib.loads(config.to_toml())) == config


@needs_components
def test_save_and_load_files(tmp_path: Path) -> None:
    config = explicit(
        planner=ComponentConfig("static", StaticPlannerConfig((1, 4), 3)),
        sampling=SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=7),
        confidence_threshold=0.25,
    )
    for suffix in (".toml", ".json"):
        path = tmp_path / f"config{suffix}"
        save_config(config, path)
        assert load_config(path) == config


@needs_components
def test_the_component_can_be_given_by_name_or_dict() -> None:
    by_name = explicit(planner="early-exit")
    by_dict = explicit(planner={"name": "early-exit"})
    by_component = explicit(planner=ComponentConfig("early-exit", EarlyExitPlannerConfig()))
    assert by_name == by_dict == by_component
    assert by_name.planner.params == EarlyExitPlannerConfig()
    assert explicit(planner="Early-Exit").planner.name == "early-exit"  # canonical name


# ------------------------------------------------------------------------ rejection
@needs_components
@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"max_draft_length": 0}, "max_draft_length", ">= 1"),
        ({"max_draft_length": 2.5}, "max_draft_length", "expected an integer"),
        ({"window_rounds": -1}, "window_rounds", ">= 1"),
        ({"window_max_tokens": 0}, "window_max_tokens", ">= 1"),
        ({"confidence_threshold": 1.5}, "confidence_threshold", "must be in [0, 1], got 1.5"),
        ({"confidence_threshold": "high"}, "confidence_threshold", "expected a number"),
        ({"allow_dotted_paths": "yes"}, "allow_dotted_paths", "expected true or false"),
        ({"sampling": {"temperature": 0.0}}, "sampling.temperature", "> 0"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p", "(0, 1]"),
        ({"sampling": {"top_k": -1}}, "sampling.top_k", ">= 0"),
        ({"sampling": {"do_sample": 1}}, "sampling.do_sample", "expected true or false"),
        ({"sampling": {"temprature": 0.5}}, "sampling.temprature", "did you mean 'temperature'"),
        ({"planner": {"name": "static", "draft_length": -1}}, "planner.draft_length", ">= 0"),
        (
            {"planner": {"name": "static", "skipped_items": [1, "x"]}},
            "planner.skipped_items",
            "expected an integer",
        ),
        ({"planner": {"name": "static", "skipped_items": 3}}, "planner.skipped_items", "list"),
        ({"planner": {"name": "early-exit", "exit_layer": 0}}, "planner.exit_layer", ">= 1"),
        ({"planner": {"name": "static", "tau": 0.5}}, "planner.tau", "unknown key"),
        ({"planner": "static"}, "planner", "expected a table"),
        ({"planner": {"name": 3}}, "planner.name", "component name"),
        ({"max_draft_lenght": 3}, "max_draft_lenght", "did you mean 'max_draft_length'"),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(
    change: dict[str, Any], field: str, reason: str
) -> None:
    data = explicit().to_dict()
    for key, value in change.items():
        data[key] = value
    with pytest.raises(ConfigError) as info:
        DecoderConfig.from_dict(data)
    message = str(info.value)
    assert message.startswith(f"{field}:"), message
    assert reason in message, message


@needs_components
@SETTINGS
@given(
    kind=st.sampled_from(sorted(COMPONENT_REGISTRIES)),
    data=st.data(),
)
def test_every_component_field_rejects_a_wrong_type_by_name(kind: str, data: st.DataObject) -> None:
    registry = COMPONENT_REGISTRIES[kind]  # type: ignore[index]
    name = data.draw(st.sampled_from(registry.names()))
    fields = [f for f in attrs.fields(registry.get(name).config_class) if f.init]
    if not fields:
        return
    field = data.draw(st.sampled_from(fields))
    section = {"name": name, field.name: {"not": "a scalar"}}
    with pytest.raises(ConfigError, match=rf"^{kind}\.{re.escape(field.name)}: "):
        DecoderConfig.from_dict({**explicit().to_dict(), kind: section})


@needs_components
def test_unknown_component_name_lists_valid_names_and_closest_match() -> None:
    with pytest.raises(UnknownComponentError) as info:
        DecoderConfig.from_dict({**explicit().to_dict(), "planner": {"name": "statc"}})
    message = str(info.value)
    assert message.startswith("planner.name: unknown planner 'statc'")
    assert "early-exit" in message and "static" in message
    assert "did you mean 'static'?" in message


@needs_components
def test_dotted_names_need_the_opt_in() -> None:
    dotted = "knapspec.planners.static:StaticPlanner"
    with pytest.raises(UnknownComponentError, match="allow_dotted_paths = true"):
        explicit(planner=dotted)
    config = explicit(planner=dotted, allow_dotted_paths=True)
    assert config.planner.name == "static"  # found under its registered name
    assert DecoderConfig.from_dict(config.to_dict()) == config


@needs_components
def test_params_of_the_wrong_class_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^planner\.params: 'static' takes StaticPlannerConfig"):
        explicit(planner=ComponentConfig("static", EarlyExitPlannerConfig()))


# ------------------------------------------------------------------------------ files
@needs_components
def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("max_draft_length = = 3\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML: .*line 1"):
        load_config(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(bad_json)
    with pytest.raises(ConfigError, match=re.escape("unsupported config format '.yaml'")):
        load_config(tmp_path / "config.yaml")
    invalid = tmp_path / "invalid.toml"
    invalid.write_text("confidence_threshold = 2.0\n")
    with pytest.raises(ConfigError, match=r"invalid\.toml: confidence_threshold: must be in"):
        load_config(invalid)


# -------------------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("planner.tau=0.6", ["planner", "tau"], 0.6),
        ("max_draft_length=4", ["max_draft_length"], 4),
        ("sampling.do_sample=true", ["sampling", "do_sample"], True),
        ("planner.skipped_items=[1, 3]", ["planner", "skipped_items"], [1, 3]),
        ("planner.name=static", ["planner", "name"], "static"),
        ("planner.name=early-exit", ["planner", "name"], "early-exit"),
        ('planner.name="static"', ["planner", "name"], "static"),
        (" sampling.top_p = 0.9 ", ["sampling", "top_p"], 0.9),
        ("planner.name=pkg.mod:Cls", ["planner", "name"], "pkg.mod:Cls"),
    ],
)
def test_parse_override(text: str, key: list[str], value: Any) -> None:
    assert parse_override(text) == (key, value)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("planner.tau", "expected KEY=VALUE"),
        ("=3", "bad key"),
        ("planner..tau=3", "bad key"),
        ("a.b.c.d=3", "bad key"),
        ("planner.tau=", "missing value"),
        ("planner.skipped_items=[1, 2", "cannot parse value"),
        ('planner.name="static', "cannot parse value"),
        ("planner.tau=1 2", "cannot parse value"),
    ],
)
def test_parse_override_rejects_bad_syntax(text: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        parse_override(text)


@needs_components
def test_apply_overrides() -> None:
    base = explicit(planner=ComponentConfig("static", StaticPlannerConfig((2,), 5)))
    changed = apply_overrides(
        base,
        [
            "max_draft_length=6",
            "sampling.temperature=0.7",
            "sampling.do_sample=true",
            "planner.skipped_items=[1, 3]",
            "sampling.seed=11",
        ],
    )
    assert changed.max_draft_length == 6
    assert changed.sampling == SamplingParams(do_sample=True, temperature=0.7, seed=11)
    assert changed.planner.params == StaticPlannerConfig((1, 3), 5)
    assert apply_overrides(changed, ["sampling.seed=none"]).sampling.seed is None
    assert apply_overrides(base, []) == base


@needs_defaults
def test_lookup_settings_are_config_fields_with_overrides_and_clear_errors() -> None:
    changed = apply_overrides(
        DecoderConfig(),
        [
            "drafters.lookup.max_ngram=2",
            "drafters.lookup.max_tokens=6",
            # Checked together: only the final pair must agree.
            "planner.lookup_match_edges=[1, 3]",
            "planner.lookup_prior_acceptance=[0.2, 0.6]",
        ],
    )
    assert changed.drafters["lookup"] == LookupConfig(max_ngram=2, max_tokens=6)
    assert changed.planner.params.lookup_acceptance_config() == LookupAcceptanceConfig(
        match_edges=(1, 3), prior_acceptance=(0.2, 0.6)
    )
    assert DecoderConfig.from_dict(tomllib.loads(changed.to_toml())) == changed
    bad = [
        ("planner.lookup_decay=0", "planner.lookup_decay: must be in (0, 1]"),
        ("planner.lookup_match_edges=[2, 3]", "must be integers rising strictly from 1"),
        (
            "planner.lookup_prior_acceptance=[0.5]",
            "planner.lookup_prior_acceptance: needs one value per match-length bucket",
        ),
        ("planner.lookup_prior_acceptance=[0, 0.5]", "values in (0, 1)"),
    ]
    for override, reason in bad:
        with pytest.raises(ConfigError, match=re.escape(reason)) as info:
            apply_overrides(DecoderConfig(), [override, "max_draft_length=4"])
        assert str(info.value).startswith(f"--set {override!r}:")


@needs_components
def test_a_component_name_override_resets_its_params_and_applies_first() -> None:
    base = explicit(planner=ComponentConfig("static", StaticPlannerConfig((2,), 5)))
    changed = apply_overrides(base, ["planner.draft_length=1", "planner.name=early-exit"])
    assert changed.planner == ComponentConfig("early-exit", EarlyExitPlannerConfig(draft_length=1))
    same = apply_overrides(base, ["planner.name=static"])  # same name: params kept
    assert same == base


@needs_components
@pytest.mark.parametrize(
    ("override", "error", "reason"),
    [
        ("planner.tauu=0.6", ConfigError, "planner.tauu: unknown key"),
        ("max_draft_length=0", ConfigError, "max_draft_length: must be an integer >= 1"),
        ("sampling.temperature=hot", ConfigError, "sampling.temperature: expected a number"),
        ("samplin.top_p=0.5", ConfigError, "did you mean 'sampling'"),
        ("sampling=3", ConfigError, "'sampling' is a section"),
        ("max_draft_length.x=3", ConfigError, "'max_draft_length' is not a section"),
        ("planner.name=knapsackk", UnknownComponentError, "valid names"),
        ("drafters.lookup.max_ngram=0", ConfigError, "drafters.lookup.max_ngram: must be"),
        ("drafters.lookup.max_match=2", ConfigError, "drafters.lookup.max_match: must be >="),
        ("drafters.lookp.max_ngram=2", ConfigError, "did you mean 'lookup'"),
        ("drafters.lookup.ngram=2", ConfigError, "drafters.lookup.ngram: unknown key"),
        ("drafters.lookup=3", ConfigError, "'drafters.lookup' is a section"),
    ],
)
def test_bad_overrides_name_the_override_and_field(
    override: str, error: type[Exception], reason: str
) -> None:
    with pytest.raises(error) as info:
        apply_overrides(explicit(), [override])
    message = str(info.value)
    assert message.startswith(f"--set {override!r}:"), message
    assert reason in message, message


# ------------------------------------------------------------------------------- docs
def test_attribute_docs_parses_google_style_sections() -> None:
    docs = attribute_docs(DecoderConfig)
    assert docs["max_draft_length"] == "D, the largest γ any plan may use (>= 1)."
    # Continuation lines are joined; "a, b: text" documents both fields.
    assert docs["window_max_tokens"].endswith("bounds the planner's work per plan.")
    assert attribute_docs(SamplingParams)["seed"].startswith("the sampling seed")


def test_every_field_is_documented_in_docstrings() -> None:
    for key, _, description in describe_fields():
        assert description, f"{key} has no description in its class docstring"
    for kind in COMPONENT_REGISTRIES:
        for name, rows in component_fields(kind).items():  # type: ignore[arg-type]
            for field, _, description in rows:
                assert description, f"{kind} {name!r}: field {field!r} is undocumented"


def fields_markdown() -> str:
    """The field tables of docs/configuration.md, rendered from the attrs metadata."""
    lines = ["### Decoder and sampling fields", "", "| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | `{default}` | {doc} |" for key, default, doc in describe_fields()]
    for kind in COMPONENT_REGISTRIES:
        for name, rows in component_fields(kind).items():  # type: ignore[arg-type]
            lines += ["", f'### `{kind}.name = "{name}"`', ""]
            if not rows:
                lines.append("No parameters.")
                continue
            lines += ["| key | default | meaning |", "|---|---|---|"]
            lines += [f"| `{kind}.{field}` | `{default}` | {doc} |" for field, default, doc in rows]
    for name, rows in drafter_fields().items():
        lines += ["", f"### `[drafters.{name}]`", ""]
        if not rows:
            lines.append("No parameters.")
            continue
        lines += ["| key | default | meaning |", "|---|---|---|"]
        lines += [
            f"| `drafters.{name}.{field}` | `{default}` | {doc} |" for field, default, doc in rows
        ]
    return "\n".join(line.replace("\n", " ") for line in lines) + "\n"


BEGIN, END = "<!-- fields:begin (generated) -->\n", "<!-- fields:end -->"


def test_configuration_doc_lists_every_field() -> None:
    """docs/configuration.md holds the generated tables; KNAPSPEC_UPDATE_DOCS=1 rewrites them."""
    path = ROOT / "docs" / "configuration.md"
    text = path.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, "docs/configuration.md lost its field-table markers"
    head, rest = text.split(BEGIN, 1)
    current, tail = rest.split(END, 1)
    expected = fields_markdown()
    if os.environ.get("KNAPSPEC_UPDATE_DOCS") == "1":
        path.write_text(head + BEGIN + expected + END + tail, encoding="utf-8")
        current = expected
    assert current == expected, (
        "docs/configuration.md is out of date with the config classes; regenerate with "
        "KNAPSPEC_UPDATE_DOCS=1 pytest tests/test_config.py -k configuration_doc"
    )


@needs_defaults
def test_default_config_names_the_published_method() -> None:
    # montecarlo is the default proxy: same α as cosine's top-1 agreement under greedy,
    # exact under sampling, best rank correlation on SmolLM2 (results/proxies/summary.md).
    config = DecoderConfig()
    assert (config.planner.name, config.cost_model.name, config.proxy.name) == (
        "knapsack",
        "online",
        "montecarlo",
    )
    assert (config.max_draft_length, config.window_rounds, config.confidence_threshold) == (
        10,
        5,
        0.7,
    )
    assert DecoderConfig.from_dict({}) == config
