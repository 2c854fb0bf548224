"""The sublayer engine: a causal LM run sublayer by sublayer, its caches, and its wings.

Here: :mod:`~knapspec.model.engine` (:class:`SublayerEngine`), the caches
(:mod:`~knapspec.model.cache`, :mod:`~knapspec.model.batch_cache`), and what the wings
share (:mod:`~knapspec.model.machine`: the host CPU; :mod:`~knapspec.model.cachefiles`:
the library's cache files). The wings:

- :mod:`knapspec.model.loading`: how a model gets here (by name, provisioned, in a dtype);
- :mod:`knapspec.model.kernels`: what computes a product (and the compiled C behind it);
- :mod:`knapspec.model.tuning`: which kernel runs each product on this machine;
- :mod:`knapspec.model.passes`: batched, lean, tree and sliding-window passes.
"""

from knapspec.model.cache import KVCache
from knapspec.model.engine import (
    SUPPORTED_MODEL_TYPES,
    ContextLengthError,
    ForwardOutput,
    OffloadedModelError,
    SublayerEngine,
    UnsupportedModelError,
)
from knapspec.model.passes.exact_pass import EnginePaths

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "ContextLengthError",
    "EnginePaths",
    "ForwardOutput",
    "KVCache",
    "OffloadedModelError",
    "SublayerEngine",
    "UnsupportedModelError",
]
