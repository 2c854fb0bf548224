"""A preallocated KV cache for a batch of sequences with per-row lengths.

Every layer owns one ``(rows, kv_heads, capacity, head_dim)`` buffer for keys and one for
values; token ``p`` of row ``r`` lives at index ``[r, :, p]`` (no padding inside a row, so
a row's positions are its own). Each row has one valid length shared by all layers: a
layer-skipping draft step writes only past the committed length, and the full-model
verification after it rewrites every layer there, so after each round the layers agree.
Cropping a row after verification is a length move; a row that finished leaves the batch
through :meth:`BatchKVCache.keep`, which packs the remaining rows to the front so that
attention reads a view of the first rows, never a gathered copy.
"""

from __future__ import annotations

import math
import mmap

import torch

from knapspec.model.cache import KVCache
from knapspec.model.kernels.layer_ops import scatter_


def zeros_on_demand(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor of ``shape`` whose memory is committed as it is written.

    On a CPU the buffer is an anonymous private mapping (``mmap``), which the OS fills with
    zeros page by page on first touch, so a cache sized for long rows holds resident
    memory only for the tokens written into it (``torch.zeros`` writes every page: a
    server's 16 rows of 4,096 tokens of SmolLM2 K/V were 1.5 GB resident from the start).
    Elsewhere, ``torch.zeros``.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private, as malloc's own large blocks
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: an anonymous mapping has no flags (committed on touch as well)
        mapping = mmap.mmap(-1, nbytes)
    # The tensor's storage keeps the mapping alive (torch.frombuffer holds the buffer).
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


class BatchKVCache:
    """Per-layer ``(rows, kv_heads, capacity, head_dim)`` key/value buffers and a length
    per row.

    Args:
        num_layers: decoder layers ``L``.
        rows: sequences in the batch.
        kv_heads, head_dim: the model's key/value heads and head size.
        capacity: token slots per row (every row's prompt + new tokens + draft room).
        dtype, device: the model's.
        compiled_writes: write K/V through one compiled copy per buffer where it serves
            (:func:`~knapspec.model.kernels.layer_ops.scatter_`, bitwise the indexed assignment).

    Buffers start as zeros: a padded query attends to nothing it should not, but its
    masked keys still enter the product ``softmax · V`` with weight 0, so they must be
    finite (``0 · NaN`` would poison the row). On a CPU the zeros are committed page by
    page as rows grow (:func:`zeros_on_demand`).
    """

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        compiled_writes: bool = True,
    ) -> None:
        if rows < 1 or capacity < 1:
            raise ValueError(
                f"a batch cache needs rows >= 1 and capacity >= 1, got {rows}, {capacity}"
            )
        shape = (rows, kv_heads, capacity, head_dim)
        #: Rows the buffers hold (active or free).
        self.slots = rows
        self.num_layers = num_layers
        self.capacity = capacity
        self.device = device
        self._compiled_writes = compiled_writes and device.type == "cpu"
        self._keys = [zeros_on_demand(shape, dtype, device) for _ in range(num_layers)]
        self._values = [zeros_on_demand(shape, dtype, device) for _ in range(num_layers)]
        #: Valid tokens of each active row (every layer holds the same count).
        self.lengths: list[int] = [0] * rows

    @property
    def rows(self) -> int:
        """Active rows (the first ``rows`` slots of every buffer)."""
        return len(self.lengths)

    @property
    def compiled_writes(self) -> bool:
        """Whether K/V are written through the compiled copy."""
        return self._compiled_writes

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s whole key and value buffers, ``(slots, kv_heads, capacity,
        head_dim)`` contiguous each (for callers that write and read them through compiled
        kernels; the active rows are the first :attr:`rows` slots)."""
        return self._keys[layer], self._values[layer]

    def load_row(self, row: int, cache: KVCache, length: int) -> None:
        """Copy the first ``length`` tokens of a single-sequence ``cache`` (a prefill run
        alone) into row ``row``."""
        if length > self.capacity:
            raise ValueError(f"row {row}: {length} tokens exceed the capacity {self.capacity}")
        for layer in range(self.num_layers):
            self._keys[layer][row, :, :length].copy_(cache.keys(layer, length))
            self._values[layer][row, :, :length].copy_(cache.values(layer, length))
        self.lengths[row] = length

    def append_row(self, cache: KVCache, length: int) -> int:
        """Make a new active row, after the others, from the first ``length`` tokens of a
        single-sequence ``cache``; returns its slot. Raises ValueError when every slot is
        taken (a finished row frees its slot through :meth:`keep`)."""
        slot = self.rows
        if slot >= self.slots:
            raise ValueError(f"the batch cache has no free row: all {slot} are active")
        self.lengths.append(0)
        self.load_row(slot, cache, length)
        return slot

    def write(
        self,
        layer: int,
        index: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Store K/V of ``q`` new tokens per active row.

        Args:
            index: ``(rows, q)`` row and position indices (from :meth:`write_index`), or
                ``(1, T)`` indices of ``T`` packed tokens.
            keys, values: ``(rows, kv_heads, q, head_dim)``, or ``(1, kv_heads, T,
                head_dim)`` packed.
        """
        rows, positions = index
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # (rows, q, kvH, hd)
        # One compiled copy per buffer where it serves (bitwise the indexed assignment, whose
        # per-layer cost showed in a 16-row round); a refused layout writes nothing.
        if (
            self._compiled_writes
            and scatter_(self._keys[layer], rows, positions, keys)
            and scatter_(self._values[layer], rows, positions, values)
        ):
            return
        self._keys[layer][rows, :, positions] = keys
        self._values[layer][rows, :, positions] = values

    def check_room(self, positions: int) -> None:
        """Raise ValueError unless a row can hold ``positions`` positions."""
        if positions > self.capacity:
            raise ValueError(
                f"{positions} positions exceed the batch cache's capacity {self.capacity}"
            )

    def write_index(self, starts: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, q)`` row and position indices of ``q`` tokens per row from ``starts``."""
        rows = self.rows
        self.check_room(int(starts.max()) + q_len)
        row_index = torch.arange(rows, device=self.device).repeat_interleave(q_len)
        row_index = row_index.view(rows, q_len)  # contiguous, as the compiled copy wants
        positions = starts.unsqueeze(1) + torch.arange(q_len, device=self.device)
        return row_index, positions

    def keys(self, layer: int, end: int) -> torch.Tensor:
        """``(rows, kv_heads, end, head_dim)`` view of the active rows' keys."""
        return self._keys[layer][: self.rows, :, :end]

    def values(self, layer: int, end: int) -> torch.Tensor:
        """``(rows, kv_heads, end, head_dim)`` view of the active rows' values."""
        return self._values[layer][: self.rows, :, :end]

    def row_keys(self, layer: int, row: int, end: int) -> torch.Tensor:
        """``(1, kv_heads, end, head_dim)`` view of active row ``row``'s keys."""
        return self._keys[layer][row : row + 1, :, :end]

    def row_values(self, layer: int, row: int, end: int) -> torch.Tensor:
        """``(1, kv_heads, end, head_dim)`` view of active row ``row``'s values."""
        return self._values[layer][row : row + 1, :, :end]

    def set_lengths(self, lengths: list[int]) -> None:
        """Each active row's valid length after a step (its accepted tokens; a crop)."""
        if len(lengths) != self.rows:
            raise ValueError(f"{len(lengths)} lengths for {self.rows} rows")
        self.lengths = list(lengths)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) as the active rows ``0 .. len(rows) - 1``.

        Only the rows that change slot are copied, and only their valid tokens: a server
        retiring one of 16 rows of 8k capacity had copied every row's whole capacity
        (about 0.4 GB at 1k capacity, on every retirement). Where no row moves into a slot
        another row is read from (what :meth:`BatchRun._retire` arranges: the last rows
        fill the holes), each moves directly; otherwise one gather up to the longest row."""
        lengths = [self.lengths[row] for row in rows]
        moves = [(slot, row) for slot, row in enumerate(rows) if slot != row]
        if not moves:
            self.lengths = lengths
            return
        destinations = {slot for slot, _ in moves}
        if all(row not in destinations for _, row in moves):
            for slot, row in moves:
                n = self.lengths[row]
                for layer in range(self.num_layers):
                    self._keys[layer][slot, :, :n] = self._keys[layer][row, :, :n]
                    self._values[layer][slot, :, :n] = self._values[layer][row, :, :n]
        else:
            longest = max(lengths, default=0)
            index = torch.tensor(rows, device=self.device)
            for layer in range(self.num_layers):
                kept_keys = self._keys[layer][index, :, :longest]
                kept_values = self._values[layer][index, :, :longest]
                self._keys[layer][: len(rows), :, :longest] = kept_keys
                self._values[layer][: len(rows), :, :longest] = kept_values
        self.lengths = lengths
