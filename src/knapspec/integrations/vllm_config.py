"""Settings of the vLLM proposer (:mod:`knapspec.integrations.vllm`) beyond vLLM's own.

vLLM's speculative config carries only ``num_speculative_tokens`` (the cap on γ) for a
``custom_class`` proposer; the rest is read from the TOML file named by
``$KNAPSPEC_VLLM_CONFIG`` (top level or a ``[vllm]`` table), then from
``$KNAPSPEC_VLLM_<FIELD>`` variables, in the environment ``vllm serve`` starts in (its
workers inherit it). Every error names the variable or file to fix.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from knapspec.validators import at_least, interval

CONFIG_ENV = "KNAPSPEC_VLLM_CONFIG"
"""Environment variable naming a TOML file of :class:`VllmProposerConfig` fields."""

ENV_PREFIX = "KNAPSPEC_VLLM_"
"""Prefix of the per-field environment variables (``KNAPSPEC_VLLM_HISTORY_TOKENS``)."""

PRICINGS = ("tpt", "fixed", "off")


class VllmProposerError(ValueError):
    """The proposer's configuration is unusable; the message names the fix."""


@attrs.frozen
class VllmProposerConfig:
    """The proposer's settings beyond vLLM's ``num_speculative_tokens`` (the cap on γ).

    Attributes:
        max_ngram: the longest suffix looked up (the lookup index's N, >= 1).
        max_candidates: how many recent occurrences vote on the continuation (>= 1).
        max_match: cap on the measured match length (>= max_ngram).
        history_tokens: tokens of finished requests' sequences kept to look up in, and
            with it the other live rows are looked up in too (>= 0; 0 turns it off).
        pricing: ``"tpt"`` (the batch's tokens per time from the learned step costs and
            acceptance; γ = 0 when nothing pays), ``"fixed"`` (draft the whole proposal
            up to the cap, like vLLM's n-gram method: the ablation) or ``"off"`` (never
            draft: what vLLM's speculative path costs by itself, async scheduling off).
        profile: a step-cost file to start from (read only); None: knapspec's cache file
            for this model, machine and vLLM version, measured online and written back.
        cache: whether the learned step costs are written to the cache (``profile`` is
            never overwritten).
        window: how many recent step times of a width its cost is the median of (>= 1;
            the median, not an average: step times come with bursts of 2-10x).
        prior_slope: before a width ``N`` is measured, ``T(N) = T(1)·(1 + slope·(N - 1))``
            (scaled from the nearest measured width); >= 0. Small values make the
            proposer try drafting, then price it by what it measured.
        trace: a file to append one JSON line per call to (rows, proposals, chosen γ,
            predicted and measured step times), for tests and benchmarks; None: off.
    """

    max_ngram: int = attrs.field(default=4, validator=at_least(1))
    max_candidates: int = attrs.field(default=8, validator=at_least(1))
    max_match: int = attrs.field(default=32, validator=at_least(1))
    history_tokens: int = attrs.field(default=0, validator=at_least(0))
    pricing: str = attrs.field(default="tpt")
    profile: str | None = None
    cache: bool = True
    window: int = attrs.field(default=16, validator=at_least(1))
    prior_slope: float = attrs.field(default=0.05, validator=interval(0.0, math.inf))
    trace: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.pricing not in PRICINGS:
            raise VllmProposerError(
                f"pricing must be one of {', '.join(PRICINGS)}, got {self.pricing!r} "
                f"(set {ENV_PREFIX}PRICING or 'pricing' in ${CONFIG_ENV})"
            )
        if self.max_match < self.max_ngram:
            raise VllmProposerError(
                f"max_match ({self.max_match}) must be >= max_ngram ({self.max_ngram})"
            )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> VllmProposerConfig:
        """The config from ``$KNAPSPEC_VLLM_CONFIG``'s file, then ``$KNAPSPEC_VLLM_<FIELD>``.

        Raises:
            VllmProposerError: an unreadable file, an unknown field, or a bad value (the
                message names the variable or file to fix).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = env.get(CONFIG_ENV)
        if path:
            values.update(_read_toml(Path(path).expanduser()))
        names = {field.name: field for field in attrs.fields(cls)}
        for name in names:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name] = _coerce(name, raw, names[name].default)
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise VllmProposerError(
                f"unknown knapspec vLLM setting(s) {', '.join(unknown)} in {path}; "
                f"known: {', '.join(names)}"
            )
        try:
            return cls(**values)
        except VllmProposerError:
            raise
        except (TypeError, ValueError) as error:
            raise VllmProposerError(
                f"bad knapspec vLLM setting: {error} (from ${CONFIG_ENV}={path!r} or "
                f"{ENV_PREFIX}<FIELD> variables)"
            ) from error


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise VllmProposerError(
            f"cannot read ${CONFIG_ENV}={path} ({error}); point it at a TOML file or unset it"
        ) from error
    except tomllib.TOMLDecodeError as error:
        raise VllmProposerError(f"${CONFIG_ENV}={path} is not valid TOML: {error}") from error
    table = data.get("vllm", data)
    if not isinstance(table, dict):
        raise VllmProposerError(f"[vllm] in {path} must be a table")
    return dict(table)


def _coerce(name: str, raw: str, default: object) -> object:
    """An environment string as the field's type (the default's type; None: a string)."""
    variable = ENV_PREFIX + name.upper()
    try:
        if isinstance(default, bool):
            lowered = raw.strip().lower()
            if lowered not in {"1", "0", "true", "false", "yes", "no", "on", "off"}:
                raise ValueError(raw)
            return lowered in {"1", "true", "yes", "on"}
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError as error:
        kind = type(default).__name__
        raise VllmProposerError(f"{variable}={raw!r} is not a valid {kind}") from error
    return raw


__all__ = ["CONFIG_ENV", "ENV_PREFIX", "PRICINGS", "VllmProposerConfig", "VllmProposerError"]
