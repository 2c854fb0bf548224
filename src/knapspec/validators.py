"""The attrs validators every config record uses, and the finite-tensor check.

Built on :mod:`attrs.validators`: ``optional``, ``ge``, ``gt``, ``in_``, ``instance_of``
and ``min_len`` are used as they are; this module adds only what attrs lacks, a number
range with a readable message (``tau must be in [-1, 1], got 2``) and an integer bound
that refuses ``True`` (``window_rounds must be an integer >= 1, got 0``). The config
layer strips the leading field name when it prefixes the message with the field's dotted
path (``planner.tau: must be ...``).

Usage::

    tau: float | None = attrs.field(default=0.5, validator=optional(cosine))
    window_rounds: int = attrs.field(default=5, validator=at_least(1))
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from attrs.validators import ge, gt

#: An attrs validator: ``validator(instance, attribute, value)`` raises on a bad value.
Validator = Any


@attrs.frozen(repr=False)
class _Interval:
    """``value`` is a real number in the interval (bounds open or closed)."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_real(value) or not self._contains(float(value)):
            raise ValueError(f"{attribute.name} must be in {self._text()}, got {value!r}")

    def _contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def _text(self) -> str:
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"{left}{_number(self.low)}, {_number(self.high)}{right}"

    def __repr__(self) -> str:
        return f"<interval validator {self._text()}>"


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def interval(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Validator:
    """A real number between ``low`` and ``high`` (closed bounds unless marked open)."""
    return _Interval(low, high, low_open, high_open)


@attrs.frozen(repr=False)
class _Integer:
    """``value`` is an ``int`` and not a ``bool`` (``True`` is an int in Python), at least
    ``minimum`` when one is given."""

    minimum: int | None = None

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        bound = "" if self.minimum is None else f" >= {self.minimum}"
        not_integer = isinstance(value, bool) or not isinstance(value, int)
        if not_integer or (self.minimum is not None and value < self.minimum):
            raise ValueError(f"{attribute.name} must be an integer{bound}, got {value!r}")

    def __repr__(self) -> str:
        return f"<integer validator >= {self.minimum}>"


@attrs.frozen(repr=False)
class _Finite:
    """``value`` is a finite real number."""

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_real(value) or not math.isfinite(value):
            raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")

    def __repr__(self) -> str:
        return "<finite validator>"


#: ``[0, 1]``: probabilities, fractions, thresholds on a probability.
unit_interval: Validator = interval(0.0, 1.0)
#: ``(0, 1)``: confidence levels, EMA weights.
open_unit_interval: Validator = interval(0.0, 1.0, low_open=True, high_open=True)
#: ``[-1, 1]``: thresholds on a cosine similarity.
cosine: Validator = interval(-1.0, 1.0)
#: An ``int`` that is not a ``bool``.
integer: Validator = _Integer()
#: A finite real number.
finite: Validator = _Finite()


def at_least(bound: int) -> Validator:
    """An integer ``>= bound`` (counts, lengths, sizes)."""
    return _Integer(bound)


def optional(validator: Validator) -> Validator:
    """``validator``, or None (:func:`attrs.validators.optional`)."""
    return attrs.validators.optional(validator)


#: A non-empty string (a file path).
non_empty_string: Validator = attrs.validators.and_(
    attrs.validators.instance_of(str), attrs.validators.min_len(1)
)
#: ``> 0``.
positive: Validator = gt(0)
#: ``>= 0``.
non_negative: Validator = ge(0)


def _not_finite(name: str) -> Exception:
    return ValueError(f"{name} contains NaN or infinite values")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN or infinite value.

    A finite sum implies finite entries (NaN and ±inf propagate through it), and one
    reduction costs a small fraction of an element-wise mask of a ``(rows, width, vocab)``
    batch (figures: ``results/engine/HISTORY.md``, "Figures behind docstrings"); only a
    sum that is not finite, possibly an overflow of huge finite entries, is checked entry
    by entry.
    """
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(
    tensor: torch.Tensor, name: str, *, error: Callable[[str], Exception] = _not_finite
) -> None:
    """Raise ``error(name)`` (a ``ValueError`` naming ``name`` by default) when ``tensor``
    holds NaN or infinite values (checked as :func:`all_finite` does)."""
    if not all_finite(tensor):
        raise error(name)


__all__ = [
    "Validator",
    "all_finite",
    "at_least",
    "check_finite",
    "cosine",
    "finite",
    "integer",
    "interval",
    "non_empty_string",
    "non_negative",
    "open_unit_interval",
    "optional",
    "positive",
    "unit_interval",
]
