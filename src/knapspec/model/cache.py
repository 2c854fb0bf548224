"""A preallocated, position-indexed KV cache.

Every layer owns one ``(kv_heads, capacity, head_dim)`` buffer for keys and one for values.
Token ``p`` of the sequence lives at index ``p``: writing is an in-place copy (no
``torch.cat`` per step, unlike ``DynamicCache``) and cropping after a rejected draft only
moves a per-layer length pointer. Layers may differ in length after a layer-skipping draft
(a skipped attention item writes nothing).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class KVCache:
    """Per-layer key/value buffers plus a valid length per layer.

    Args:
        num_layers: decoder layers ``L``.
        kv_heads: key/value heads per layer.
        head_dim: size of one head.
        capacity: initial number of token slots; the cache grows by doubling on demand.
        dtype, device: taken from the model's parameters by the engine.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_capacity: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_capacity = max_capacity
        self._capacity = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.lengths: list[int] = [0] * num_layers
        self.reserve(max(capacity, 16))

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` token slots in every layer (amortised doubling)."""
        if needed <= self._capacity:
            return
        new_capacity = max(needed, 2 * self._capacity)
        if self.max_capacity is not None:
            new_capacity = min(max(needed, new_capacity), max(self.max_capacity, needed))
        shape = (self.kv_heads, new_capacity, self.head_dim)
        new_keys = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        new_values = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        for layer in range(len(self._keys)):
            length = self.lengths[layer]
            new_keys[layer][:, :length].copy_(self._keys[layer][:, :length])
            new_values[layer][:, :length].copy_(self._values[layer][:, :length])
        self._keys, self._values, self._capacity = new_keys, new_values, new_capacity

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store K/V for positions ``start .. start + q`` of layer ``layer``.

        Args:
            keys, values: ``(kv_heads, q, head_dim)``.

        The layer must already hold every earlier position (no gaps): attention reads the
        whole prefix, so a gap would silently attend to stale slots.
        """
        self.check_gap(layer, start)
        end = start + keys.shape[1]
        self.reserve(end)
        self._keys[layer][:, start:end].copy_(keys)
        self._values[layer][:, start:end].copy_(values)
        self.lengths[layer] = end

    def check_gap(self, layer: int, start: int) -> None:
        """Raise RuntimeError where a write at ``start`` would leave a gap in ``layer``."""
        if start > self.lengths[layer]:
            raise RuntimeError(
                f"KV cache gap at layer {layer}: it holds {self.lengths[layer]} tokens but a "
                f"write starts at position {start}"
            )

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s whole key and value buffers as one row, ``(1, kv_heads,
        capacity, head_dim)`` each (for a caller that writes them through a compiled copy,
        then sets :attr:`lengths`; :meth:`reserve` first)."""
        return self._keys[layer].unsqueeze(0), self._values[layer].unsqueeze(0)

    def keys(self, layer: int, end: int | None = None) -> torch.Tensor:
        """Layer ``layer``'s keys for positions ``[0, end)``: ``(kv_heads, end, head_dim)``."""
        return self._keys[layer][:, : self.lengths[layer] if end is None else end]

    def values(self, layer: int, end: int | None = None) -> torch.Tensor:
        """View of layer ``layer``'s values for positions ``[0, end)``."""
        return self._values[layer][:, : self.lengths[layer] if end is None else end]

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens in every layer (a pointer move, no copy)."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self.lengths = [min(n, length) for n in self.lengths]

    def compact(self, start: int, slots: Sequence[int]) -> None:
        """Keep, of a token tree verified at ``start``, the nodes at ``slots`` (its accepted
        path): every layer's K/V at ``start + slots[j]`` move to ``start + j`` and every
        layer then holds ``start + len(slots)`` tokens.

        Args:
            start: slot of the tree's node 0 (the pending token).
            slots: increasing offsets from ``start``, ``slots[0] == 0``; each layer must hold
                ``start + slots[-1] + 1`` tokens or more.

        Only the slots that move are copied (none for ``slots == range(len(slots))``).
        """
        kept = [int(s) for s in slots]
        if not kept or kept[0] != 0 or any(b <= a for a, b in itertools.pairwise(kept)):
            raise ValueError(f"slots must be increasing and start with 0, got {kept}")
        end = start + kept[-1] + 1
        if start < 0 or min(self.lengths) < end:
            raise ValueError(
                f"cannot keep slots up to {end - 1}: the shortest layer holds "
                f"{min(self.lengths)} tokens (start {start})"
            )
        # slots[j] >= j, so the leading run with slots[j] == j is already in place.
        first = next((j for j, slot in enumerate(kept) if slot != j), len(kept))
        if first < len(kept):
            source = torch.tensor(kept[first:], device=self.device) + start
            for buffers in (self._keys, self._values):
                for layer_buffer in buffers:
                    moved = layer_buffer.index_select(1, source)  # a copy: no overlap hazard
                    layer_buffer[:, start + first : start + len(kept)].copy_(moved)
        self.lengths = [start + len(kept)] * self.num_layers

    def reset(self) -> None:
        """Forget every token (buffers are kept for reuse)."""
        self.lengths = [0] * self.num_layers

    @property
    def seq_length(self) -> int:
        """Tokens held by every layer (the committed length after a crop)."""
        return min(self.lengths)

    def memory_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self._capacity * self.head_dim * element
