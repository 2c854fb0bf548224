"""Config files: read and write a :class:`~knapspec.config.schema.DecoderConfig` as TOML or JSON."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from knapspec.config.coercion import ConfigError
from knapspec.config.schema import DecoderConfig
from knapspec.registry import UnknownComponentError


def load_config(path: str | Path) -> DecoderConfig:
    """Read a ``.toml`` or ``.json`` config file.

    Raises:
        ConfigError: missing or unreadable file, a syntax error (with its line), an
            unsupported extension, or an invalid config.
        UnknownComponentError: an unknown component name.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {error.start}: {error.reason})"
        ) from None
    try:
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: invalid JSON: {error}") from None
    try:
        return DecoderConfig.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error.__cause__
    except UnknownComponentError as error:
        raise UnknownComponentError(f"{path}: {error}") from error.__cause__


def save_config(config: DecoderConfig, path: str | Path) -> None:
    """Write ``config`` as ``.toml`` or ``.json`` (by extension); ``load_config`` reads it back.

    See :meth:`DecoderConfig.to_toml` for how None is written to TOML.
    """
    path = Path(path)
    data = config.to_dict()
    suffix = path.suffix.lower()
    if suffix == ".json":
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    elif suffix == ".toml":
        path.write_text(config.to_toml(), encoding="utf-8")
    else:
        raise ConfigError(f"{path}: unsupported config format {suffix!r}; use .toml or .json")


__all__ = ["load_config", "save_config"]
