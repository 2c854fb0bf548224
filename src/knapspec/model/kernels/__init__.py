"""What computes a product: the engine's kernels and the compiled C behind them.

- :mod:`~knapspec.model.kernels.table`: the candidate linear kernels by name and
  :class:`KernelTable`, which says per weight shape and row count which one runs;
- :mod:`~knapspec.model.kernels.row_linear` and :mod:`~knapspec.model.kernels.onednn`: the
  compiled row-invariant products (vector, AMX tiles, packed for VDPBF16PS) and oneDNN's
  packed product;
- :mod:`~knapspec.model.kernels.row_attention`: row-invariant attention, the attention half
  of the exactness contract;
- :mod:`~knapspec.model.kernels.layer_ops` and :mod:`~knapspec.model.kernels.layer_loop`:
  a layer's small operations as single compiled calls, and an exact pass's whole layer
  loop as one;
- :mod:`~knapspec.model.kernels.fusion`: q/k/v and gate/up weights as one product's rows;
- :mod:`~knapspec.model.kernels.compiled`: builds the C sources in ``csrc/`` on first use.

Which kernel runs on this machine is chosen in :mod:`knapspec.model.tuning`. The table's
names are re-exported here (``knapspec.model.kernels.KernelTable`` keeps working).
"""

from knapspec.model.kernels.table import (
    KERNELS,
    PLAIN_KERNEL,
    SMALL_ROWS,
    Kernel,
    KernelTable,
)

__all__ = ["KERNELS", "PLAIN_KERNEL", "SMALL_ROWS", "Kernel", "KernelTable"]
