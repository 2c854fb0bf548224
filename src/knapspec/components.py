"""The shape every pluggable component shares: planners, cost models, value proxies, drafters.

A component class

* is registered under a name in its kind's :class:`~knapspec.registry.Registry`
  (``@PLANNERS.register("static")`` sets :attr:`Component.registered_name`);
* declares :attr:`Component.config_class`, an attrs frozen class of its validated
  hyper-parameters (the keys of its section in a config file);
* is built by :meth:`Component.from_config` from an instance of that class and the
  :class:`~knapspec.model.engine.SublayerEngine` it will serve;
* keeps the record it was built from as ``self.config``.

``from_config`` checks the record's type (None means the defaults), calls the class hook
:meth:`Component._construct`, and stores the record on the result. A component whose
``__init__`` takes the config record alone needs no hook at all; one that needs the model
(its depth, say) overrides ``_construct``. Scikit-learn's estimators follow the same rule:
hyper-parameters in, fitted state out, nothing read from the environment in ``__init__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Self

if TYPE_CHECKING:
    from knapspec.model.engine import SublayerEngine


class Component:
    """Base of every registered component (planner, cost model, proxy, drafter).

    Attributes:
        config: the validated hyper-parameters (an instance of :attr:`config_class`) the
            component was built from, or that describe it when built directly.
    """

    #: The name the class is registered under (set by ``Registry.register``).
    registered_name: ClassVar[str] = ""
    #: attrs frozen class of validated hyper-parameters, consumed by ``from_config``.
    config_class: ClassVar[type[Any]]

    config: Any

    @classmethod
    def checked_config(cls, config: Any) -> Any:
        """``config`` when it is an instance of :attr:`config_class`; None gives the defaults.

        Raises:
            TypeError: ``config`` is another type (the message names both classes).
        """
        if config is None:
            return cls.config_class()
        if not isinstance(config, cls.config_class):
            raise TypeError(
                f"{cls.__name__} needs a {cls.config_class.__name__}, got {type(config).__name__}"
            )
        return config

    @classmethod
    def from_config(cls, config: Any, engine: SublayerEngine) -> Self:
        """Build from a validated config for ``engine``'s model (the registry entry point).

        Raises:
            TypeError: ``config`` is not an instance of :attr:`config_class`.
            ValueError: the config does not fit this model (e.g. a layer beyond its depth).
        """
        checked = cls.checked_config(config)
        component = cls._construct(checked, engine)
        component.config = checked
        return component

    @classmethod
    def _construct(cls, config: Any, engine: SublayerEngine) -> Self:
        """Construct from a type-checked config; the default passes it to ``__init__``."""
        return cls(config)  # type: ignore[call-arg]


__all__ = ["Component"]
