"""One generic name -> class registry for cost models, value proxies and planners.

Usage (the timm pattern)::

    @PLANNERS.register("my-planner")
    class MyPlanner(Planner): ...

Every registered class is a :class:`~knapspec.components.Component`: it carries an attrs
``config_class`` (its validated hyper-parameters) and a ``from_config(config, engine)``
constructor; :func:`knapspec.config.build_components` looks classes up here and builds
them with it. Third-party code registers the same way, or
names a class by dotted path (``"package.module:ClassName"``) when ``allow_dotted`` is on.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)


class UnknownComponentError(KeyError):
    """An unknown component name; the message lists the valid ones and the closest match."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to component classes of one kind (e.g. planners).

    Args:
        kind: human name of the component kind, used in error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator registering ``cls`` under ``name`` (lower-case, unique)."""
        key = name.lower()

        def decorator(cls: C) -> C:
            existing = self._classes.get(key)
            if existing is not None and existing is not cls:
                raise ValueError(
                    f"{self.kind} name {key!r} is already registered to {existing.__qualname__}"
                )
            self._classes[key] = cls
            cls.registered_name = key  # type: ignore[attr-defined]
            return cls

        return decorator

    def unregister(self, name: str) -> None:
        """Remove a registration (tests and plugin reloads)."""
        self._classes.pop(name.lower(), None)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str, *, allow_dotted: bool = False) -> type[T]:
        """The class registered as ``name``.

        With ``allow_dotted``, ``"pkg.module:Class"`` (or ``"pkg.module.Class"``) imports
        a class that is not registered. Unknown names raise :class:`UnknownComponentError`.
        """
        key = name.lower()
        if key in self._classes:
            return self._classes[key]
        if allow_dotted and ("." in name or ":" in name):
            return self._import(name)
        valid = ", ".join(self.names()) or "(none registered)"
        close = difflib.get_close_matches(key, self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownComponentError(f"unknown {self.kind} {name!r}; valid names: {valid}{hint}")

    def _import(self, dotted: str) -> type[T]:
        module_name, _, attr = dotted.replace(":", ".").rpartition(".")
        try:
            module = importlib.import_module(module_name)
            cls: Any = getattr(module, attr)
        except (ImportError, AttributeError) as error:
            raise UnknownComponentError(f"cannot import {self.kind} {dotted!r}: {error}") from error
        if not isinstance(cls, type):
            raise UnknownComponentError(f"{dotted!r} is not a class")
        return cls


__all__ = ["Registry", "UnknownComponentError"]
