"""Token trees for one-pass verification: who sees whom, and where each node sits.

A tree of ``q`` tokens is given by its parents: node 0 is the pending token at position
``start`` (``parents[0] == -1``), node ``i > 0`` hangs under ``parents[i] < i``. Node ``i``
sits at position ``start + depth(i)``; its K/V are written at cache slot ``start + i``,
and it attends to the cached positions before ``start`` plus its ancestors and itself.
:meth:`knapspec.model.engine.SublayerEngine.forward_tree` runs such a tree;
:meth:`knapspec.model.cache.KVCache.compact` then keeps one root-to-node path.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from knapspec.model.kernels.row_attention import EXACT_MAX_QUERIES


@attrs.frozen
class TreeLayout:
    """A validated token tree at ``start``.

    Attributes:
        start: cache slot (and position) of node 0.
        parents: ``parents[i]`` for every node (``-1`` for node 0).
        positions: ``(q,)`` int64, ``start + depth(i)``.
        prefix: ``(q,)`` int64, ``start`` for every node (the keys every node sees whole).
        visible: ``(q,)`` int64 bit masks: bit ``a`` is set when node ``a`` is node ``i``
            or one of its ancestors (slot ``start + a``); bit 63 is the sign bit.
    """

    start: int
    parents: tuple[int, ...]
    positions: torch.Tensor
    prefix: torch.Tensor
    visible: torch.Tensor

    @property
    def size(self) -> int:
        """Nodes ``q``."""
        return len(self.parents)

    def mask(self, device: torch.device) -> torch.Tensor:
        """``(q, start + q)`` bool, True where node ``i`` may attend to slot ``j``."""
        nodes = torch.arange(self.size)
        bits = (self.visible.unsqueeze(1) >> nodes.unsqueeze(0)) & 1  # (q, q)
        seen = torch.ones(self.size, self.start, dtype=torch.bool)
        return torch.cat([seen, bits.bool()], dim=1).to(device)

    def path(self, node: int) -> list[int]:
        """Nodes from 0 down to ``node``, increasing: the slots to keep when ``node`` is the
        last accepted token (:meth:`knapspec.model.cache.KVCache.compact`)."""
        if not 0 <= node < self.size:
            raise ValueError(f"node {node} out of range [0, {self.size})")
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def tree_layout(parents: torch.Tensor | Sequence[int], start: int, size: int) -> TreeLayout:
    """Check ``parents`` for a tree of ``size`` tokens at ``start`` and lay it out.

    Args:
        parents: ``(q,)`` integers: ``parents[0] == -1``, ``0 <= parents[i] < i`` for
            ``i > 0``.
        start: position of node 0 (``>= 0``).
        size: the number of tokens ``q`` (``1 <= q <= EXACT_MAX_QUERIES``).

    Raises:
        ValueError: on a wrong shape, count or ordering.
    """
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1 or parents.is_floating_point() or parents.is_complex():
            raise ValueError(
                f"parents must be a 1-D integer tensor, got {parents.dtype} of shape "
                f"{tuple(parents.shape)}"
            )
        parents = parents.tolist()
    links = tuple(int(p) for p in parents)
    if not 1 <= size <= EXACT_MAX_QUERIES:
        raise ValueError(f"a token tree holds 1 to {EXACT_MAX_QUERIES} tokens, got {size}")
    if len(links) != size:
        raise ValueError(f"parents has {len(links)} entries for {size} tokens")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if links[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root), got {links[0]}")
    depths = [0] * size
    masks = [1] + [0] * (size - 1)
    for node in range(1, size):
        parent = links[node]
        if not 0 <= parent < node:
            raise ValueError(
                f"parents[{node}] = {parent}: every node's parent must come before it "
                f"(0 <= parent < {node})"
            )
        depths[node] = depths[parent] + 1
        masks[node] = masks[parent] | 1 << node
    return TreeLayout(
        start=start,
        parents=links,
        positions=torch.tensor(depths, dtype=torch.int64) + start,
        prefix=torch.full((size,), start, dtype=torch.int64),
        # Bit 63 set means a negative int64: the same 64 bits.
        visible=torch.tensor([m - (1 << 64) if m >> 63 else m for m in masks]),
    )
