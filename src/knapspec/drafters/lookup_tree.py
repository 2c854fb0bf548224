"""Building a lookup proposal's token tree (:meth:`LookupIndex.propose_tree`).

The candidates are earlier occurrences of the context's suffix, each with its sequence,
where its continuation starts and its match length (its vote weight). A node gathers the
candidates that continue with its path; its children are the distinct next tokens of
those candidates, ranked by summed weight.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import attrs

from knapspec.types import DraftTree


@attrs.frozen
class TreeOption:
    """A possible tree node: its token, weight share among its siblings, sibling rank and
    the candidates that continue with it."""

    token: int
    support: float
    rank: int
    supporters: list[int]


class TreeBuilder:
    """Grows a lookup tree node by node (see :meth:`LookupIndex.propose_tree`)."""

    def __init__(
        self, candidates: Sequence[tuple[Sequence[int], int, int]], max_depth: int
    ) -> None:
        self.candidates = candidates
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.support: list[float] = []
        self.rank: list[int] = []
        self.depth: dict[int, int] = {-1: 0}
        self.path_support: dict[int, float] = {-1: 1.0}
        #: Options not added yet, as (parent, option).
        self.spare: list[tuple[int, TreeOption]] = []
        self.first_supporters: list[int] = []

    def expand(self, supporters: list[int], depth: int) -> list[TreeOption]:
        """The options below a node at ``depth`` that ``supporters`` reach, heaviest
        first (none at the depth limit)."""
        if depth >= self.max_depth:
            return []
        votes: dict[int, float] = {}
        backers: dict[int, list[int]] = {}
        for i in supporters:
            source, start, weight = self.candidates[i]
            if start + depth < len(source):
                token = source[start + depth]
                votes[token] = votes.get(token, 0.0) + float(weight)
                backers.setdefault(token, []).append(i)
        if not votes:
            return []
        total = sum(votes.values())
        order = list(votes)
        # Heaviest first; ties go to the token first seen latest (the most recent
        # occurrence's), as the chain's vote always did.
        ranked = sorted(range(len(order)), key=lambda k: (-votes[order[k]], -k))
        return [
            TreeOption(order[k], votes[order[k]] / total, rank, backers[order[k]])
            for rank, k in enumerate(ranked)
        ]

    def add(self, parent: int, option: TreeOption) -> int:
        node = len(self.tokens)
        self.tokens.append(option.token)
        self.parents.append(parent)
        self.support.append(option.support)
        self.rank.append(option.rank)
        self.depth[node] = self.depth[parent] + 1
        self.path_support[node] = self.path_support[parent] * option.support
        if node == 0:  # the chain's first token (later roots are the tree's side options)
            self.first_supporters = option.supporters
        return node

    def grow(self, max_nodes: int) -> None:
        """Add the best pending options (by path support) until ``max_nodes`` nodes."""
        heap: list[tuple[float, int, int, TreeOption]] = []
        counter = 0

        def push(parent: int, option: TreeOption) -> None:
            nonlocal counter
            score = self.path_support[parent] * option.support
            heapq.heappush(heap, (-score, counter, parent, option))
            counter += 1

        for parent, option in self.spare:
            push(parent, option)
        self.spare = []
        while heap and len(self.tokens) < max_nodes:
            _, _, parent, option = heapq.heappop(heap)
            node = self.add(parent, option)
            for child in self.expand(option.supporters, self.depth[node]):
                push(node, child)

    def tree(self) -> DraftTree:
        return DraftTree(
            tuple(self.tokens), tuple(self.parents), tuple(self.support), tuple(self.rank)
        )


__all__ = ["TreeBuilder", "TreeOption"]
