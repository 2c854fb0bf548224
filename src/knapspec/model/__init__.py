"""The sublayer engine, its KV cache and model provisioning."""

from knapspec.model.cache import KVCache
from knapspec.model.engine import (
    SUPPORTED_MODEL_TYPES,
    ContextLengthError,
    ForwardOutput,
    OffloadedModelError,
    SublayerEngine,
    UnsupportedModelError,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ContextLengthError",
    "ForwardOutput",
    "KVCache",
    "OffloadedModelError",
    "SublayerEngine",
    "UnsupportedModelError",
]
