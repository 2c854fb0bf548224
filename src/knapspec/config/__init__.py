"""Decoder configuration: attrs frozen records, dict / TOML / JSON forms, ``--set`` overrides.

A :class:`DecoderConfig` names one registered planner, cost model and value proxy, each
with its own validated hyper-parameters (the component's ``config_class``), the
hyper-parameters of every registered drafter (``[drafters.lookup]``), plus the decoder's
own knobs. Its flat dict form is what the TOML and JSON files hold::

    max_draft_length = 10

    [planner]
    name = "static"          # a registered name (or "pkg.module:Class" when
    skipped_items = [3, 5]   # allow_dotted_paths = true); other keys are its params
    draft_length = 4

    [drafters.lookup]
    max_ngram = 3            # every drafter's section is optional

    [sampling]
    do_sample = false

Everything here works through the registries (``PLANNERS``, ``COST_MODELS``,
``PROXIES``, ``DRAFTERS``); no component is special-cased by name. Every error is a
:class:`ConfigError` (a ``ValueError``) whose message starts with the dotted path of the
offending field, or the registry's :class:`~knapspec.registry.UnknownComponentError` (a
``KeyError``) for an unknown component name.

The package has one module per job: :mod:`~knapspec.config.schema` (the records),
:mod:`~knapspec.config.coercion` (reading values into them), :mod:`~knapspec.config.files`
and :mod:`~knapspec.config.toml` (TOML / JSON), :mod:`~knapspec.config.overrides`
(``--set``) and :mod:`~knapspec.config.factory` (building the components). Every public
name is importable from ``knapspec.config``.
"""

from knapspec.config.coercion import ConfigError, build_attrs
from knapspec.config.factory import as_decoder_config, build_components, build_drafters
from knapspec.config.files import load_config, save_config
from knapspec.config.overrides import apply_overrides, parse_override
from knapspec.config.schema import (
    COMPONENT_REGISTRIES,
    ComponentConfig,
    ComponentKind,
    DecoderConfig,
    component_from_dict,
    component_to_dict,
    load_builtin_components,
    resolve_component,
    resolve_drafters,
)
from knapspec.config.toml import to_toml

__all__ = [
    "COMPONENT_REGISTRIES",
    "ComponentConfig",
    "ComponentKind",
    "ConfigError",
    "DecoderConfig",
    "apply_overrides",
    "as_decoder_config",
    "build_attrs",
    "build_components",
    "build_drafters",
    "component_from_dict",
    "component_to_dict",
    "load_builtin_components",
    "load_config",
    "parse_override",
    "resolve_component",
    "resolve_drafters",
    "save_config",
    "to_toml",
]
