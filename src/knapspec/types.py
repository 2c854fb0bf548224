"""Small frozen records handed between the stages: engine -> planner -> decoder.

Item numbering, used everywhere in the library: a model with ``L`` decoder layers has
``2L`` items; item ``2i`` is the attention sublayer of layer ``i`` and item ``2i + 1`` its
MLP sublayer. Hidden-state *points* are numbered ``0..2L``: point 0 is the embedding
output and point ``k + 1`` is the residual stream after item ``k``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Final

import attrs
import torch

#: Name of the γ = 0 option (a plain step) wherever drafters are named: stats, plans.
NO_DRAFT: Final = "none"
SUBNETWORK: Final = "subnetwork"
LOOKUP: Final = "lookup"


@attrs.frozen
class DraftTree:
    """A token tree a drafter proposes: several continuations sharing their prefixes.

    Node ``i`` holds token ``tokens[i]`` and hangs below node ``parents[i]`` (``-1``: below
    the last committed token, the root). Parents come before their children
    (``parents[i] < i``) and siblings hold different tokens, so a path from the root is
    one candidate continuation and the target's token at each step picks at most one
    child. ``support[i]`` is the weighted fraction of the occurrences reaching the parent
    that continue with node ``i``; ``rank[i]`` is its place among its siblings by that
    weight (0: the heaviest, the one a chain would follow).

    Attributes:
        tokens, parents, support, rank: per node, as above (equal lengths).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    support: tuple[float, ...]
    rank: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        size = len(self.tokens)
        if not len(self.parents) == len(self.support) == len(self.rank) == size:
            raise ValueError("a draft tree needs one parent, support and rank per token")
        seen: set[tuple[int, int]] = set()
        for i, (parent, token) in enumerate(zip(self.parents, self.tokens, strict=True)):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent must be in [-1, {i}), got {parent}")
            if (parent, token) in seen:
                raise ValueError(f"node {i} repeats token {token} among its siblings")
            seen.add((parent, token))

    def __len__(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Per node, its depth: 1 for the root's children (the draft position + 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def is_chain(self) -> bool:
        """Whether every node is the previous one's only child (a plain draft)."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def children(self, node: int) -> dict[int, int]:
        """``{token: child}`` of ``node`` (-1: the root)."""
        return {
            token: i
            for i, (parent, token) in enumerate(zip(self.parents, self.tokens, strict=True))
            if parent == node
        }

    def chain(self) -> tuple[int, ...]:
        """The nodes of the heaviest path: from the root, each node's rank-0 child."""
        nodes: list[int] = []
        node = -1
        while True:
            nxt = next(
                (i for i, p in enumerate(self.parents) if p == node and self.rank[i] == 0), None
            )
            if nxt is None:
                return tuple(nodes)
            nodes.append(nxt)
            node = nxt

    def subtree(self, nodes: Sequence[int]) -> DraftTree:
        """The tree of ``nodes`` (each node's parent among them or the root), renumbered
        in increasing order of the old numbers."""
        kept = sorted(set(nodes))
        new_index = {old: new for new, old in enumerate(kept)}
        parents = []
        for old in kept:
            parent = self.parents[old]
            if parent >= 0 and parent not in new_index:
                raise ValueError(f"node {old} is kept without its parent {parent}")
            parents.append(new_index[parent] if parent >= 0 else -1)
        return DraftTree(
            tuple(self.tokens[i] for i in kept),
            tuple(parents),
            tuple(self.support[i] for i in kept),
            tuple(self.rank[i] for i in kept),
        )

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (inclusive)."""
        nodes: list[int] = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        nodes.reverse()
        return nodes


@attrs.frozen
class Draft:
    """Tokens one drafter proposed for one round.

    Attributes:
        tokens: the draft token ids, in order (may be empty: nothing to propose).
        drafter: the registered name of the drafter that produced it.
        probs: ``(len(tokens), vocab)`` the draft distributions ``q_j`` the tokens were
            sampled from, for rejection sampling; None for a deterministic draft (lookup),
            whose ``q`` is one-hot (:meth:`draft_probs` builds it).
        support: per token, the fraction of the matched earlier occurrences that continue
            with it (lookup only; 1.0 when one occurrence or all agree).
        match_length: tokens of the context's suffix the lookup matched (0 otherwise).
        predicted_acceptance: the planner's per-token acceptance estimate for the tokens it
            kept (None when not priced).
        seconds: wall time spent producing the draft.
        tree: the whole token tree when the drafter proposes one (lookup); ``tokens`` is
            then its heaviest path (:meth:`DraftTree.chain`), what a chain-only consumer
            drafts. None: a chain.
    """

    tokens: tuple[int, ...]
    drafter: str
    probs: torch.Tensor | None = None
    support: tuple[float, ...] = ()
    match_length: int = 0
    predicted_acceptance: float | None = None
    seconds: float = 0.0
    tree: DraftTree | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, length: int) -> Draft:
        """The first ``length`` tokens (and their distributions / support), as a chain (a
        tree's other branches are dropped)."""
        if length >= len(self.tokens):
            return self if self.tree is None else attrs.evolve(self, tree=None)
        probs = self.probs[:length] if self.probs is not None else None
        return attrs.evolve(
            self,
            tokens=self.tokens[:length],
            probs=probs,
            support=self.support[:length],
            tree=None,
        )

    def branched(self, nodes: Sequence[int]) -> Draft:
        """The draft of the subtree of :attr:`tree` on ``nodes`` (ancestor-closed): ``tokens``
        become the subtree's heaviest path, ``tree`` the subtree. Deterministic drafts
        only (a tree carries no draft distributions)."""
        if self.tree is None or self.probs is not None:
            raise ValueError("only a deterministic draft with a tree can be branched")
        tree = self.tree.subtree(nodes)
        chain = tree.chain()
        return attrs.evolve(
            self,
            tokens=tuple(tree.tokens[i] for i in chain),
            support=tuple(tree.support[i] for i in chain),
            tree=tree,
        )

    def draft_probs(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(len(tokens), vocab_size)`` draft distributions: the stored ``q`` or, for a
        deterministic draft, one-hot rows (accepting ``x`` with probability ``p(x)`` and
        resampling from ``p`` without ``x`` on rejection is then exact)."""
        if self.probs is not None:
            return self.probs
        one_hot = torch.zeros(len(self.tokens), vocab_size, device=device)
        if self.tokens:
            index = torch.tensor(self.tokens, device=device)
            one_hot[torch.arange(len(self.tokens), device=device), index] = 1.0
        return one_hot


@attrs.frozen
class Verification:
    """What one verify pass decided.

    Attributes:
        accepted: leading draft tokens accepted.
        tokens: committed tokens: the accepted drafts, then one token from the target.
        seconds: wall time of the full-model pass and the acceptance test.
        points: ``(2L + 1, k + 1, d_model)`` captured hidden states (None unless captured).
        target_next: ``(k + 1,)`` the target's argmax after each input (None unless
            captured).
    """

    accepted: int
    tokens: list[int]
    seconds: float
    points: torch.Tensor | None = None
    target_next: torch.Tensor | None = None


class ItemKind(StrEnum):
    """The two kinds of sublayer a decoder layer holds."""

    ATTENTION = "attn"
    MLP = "mlp"


def item_kind(item: int) -> ItemKind:
    """Kind of item ``item`` under the library's numbering (even = attention)."""
    return ItemKind.ATTENTION if item % 2 == 0 else ItemKind.MLP


def item_layer(item: int) -> int:
    """Decoder layer that item ``item`` belongs to."""
    return item // 2


def _to_bools(value: Iterable[object]) -> tuple[bool, ...]:
    return tuple(bool(x) for x in value)


def _check_executed(
    instance: SublayerMask, attribute: attrs.Attribute[object], value: object
) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, bool) for v in value):
        raise TypeError("SublayerMask.executed must be a tuple of bools")
    if len(value) == 0 or len(value) % 2 != 0:
        raise ValueError(
            f"SublayerMask needs 2L entries (one per attention and MLP item); got {len(value)}"
        )


@attrs.frozen(repr=False)
class SublayerMask:
    """Which of the ``2L`` sublayers a draft executes.

    ``executed[k]`` is True when item ``k`` runs; a skipped item is the identity on the
    residual stream. The full model is the all-True mask.
    """

    executed: tuple[bool, ...] = attrs.field(converter=_to_bools, validator=_check_executed)

    @classmethod
    def full(cls, num_layers: int) -> SublayerMask:
        """The mask that runs every item (the target model itself)."""
        return cls((True,) * (2 * num_layers))

    @classmethod
    def from_skipped(cls, num_layers: int, skipped: Iterable[int]) -> SublayerMask:
        """Build a mask from the indices of the items to skip."""
        executed = [True] * (2 * num_layers)
        for item in skipped:
            if not 0 <= item < 2 * num_layers:
                raise ValueError(f"item {item} out of range for {num_layers} layers")
            executed[item] = False
        return cls(tuple(executed))

    @classmethod
    def from_layers(cls, num_layers: int, skipped_layers: Iterable[int]) -> SublayerMask:
        """Skip whole layers (attention and MLP together), as SWIFT/CLaSp-style drafts do."""
        items = [i for layer in skipped_layers for i in (2 * layer, 2 * layer + 1)]
        return cls.from_skipped(num_layers, items)

    @classmethod
    def early_exit(cls, num_layers: int, exit_layer: int) -> SublayerMask:
        """LayerSkip-style draft: run the first ``exit_layer`` layers, skip the rest."""
        if not 1 <= exit_layer <= num_layers:
            raise ValueError(f"exit_layer must be in [1, {num_layers}], got {exit_layer}")
        return cls.from_layers(num_layers, range(exit_layer, num_layers))

    @property
    def num_items(self) -> int:
        return len(self.executed)

    @property
    def num_layers(self) -> int:
        return len(self.executed) // 2

    @property
    def skipped(self) -> tuple[int, ...]:
        """Indices of the skipped items, ascending."""
        return tuple(i for i, run in enumerate(self.executed) if not run)

    @property
    def num_skipped(self) -> int:
        return self.executed.count(False)

    @property
    def num_attention_executed(self) -> int:
        return sum(self.executed[0::2])

    @property
    def num_mlp_executed(self) -> int:
        return sum(self.executed[1::2])

    @property
    def is_full(self) -> bool:
        return all(self.executed)

    def attention(self, layer: int) -> bool:
        """Whether layer ``layer``'s attention sublayer runs."""
        return self.executed[2 * layer]

    def mlp(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP sublayer runs."""
        return self.executed[2 * layer + 1]

    def item_map(self) -> str:
        """A readable two-row map: ``A`` / ``M`` run, ``.`` skipped, one column per layer."""
        attn = "".join("A" if run else "." for run in self.executed[0::2])
        mlp = "".join("M" if run else "." for run in self.executed[1::2])
        return f"attn {attn}\nmlp  {mlp}"

    def to_list(self) -> list[int]:
        """Skipped item indices, the compact serialised form."""
        return list(self.skipped)

    def __repr__(self) -> str:
        return (
            f"SublayerMask(layers={self.num_layers}, skipped={self.num_skipped}: "
            f"{list(self.skipped)})"
        )


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen
class DraftPlan:
    """What a planner proposes for the next speculation rounds.

    ``draft_length`` (gamma) is the maximum number of draft tokens; 0 means "take a plain
    autoregressive step with the full model". ``drafter`` names who drafts them:
    ``"subnetwork"`` (the target under ``mask``) or ``"lookup"`` (the lookup proposal of
    the round, cut to γ tokens; ``mask`` is then unused). The predicted fields are the
    planner's own estimates, kept for the stats and for drift detection;
    ``tree_nodes`` (lookup only) names the branches of the proposal's token tree to verify
    beside its heaviest path. ``best_draft_speedup`` is, for a γ = 0 plan, the predicted
    speed of the best speculative option the planner priced and rejected, relative to a
    plain step (None when it priced none), so a run without drafts can say why.
    """

    mask: SublayerMask
    draft_length: int = attrs.field(validator=_non_negative)
    predicted_acceptance: float | None = None
    predicted_tokens_per_second: float | None = None
    source: str = "static"
    drafter: str = SUBNETWORK
    best_draft_speedup: float | None = None
    #: The nodes of the proposal's token tree to verify (ancestor-closed; their deepest
    #: path is at most ``draft_length``); None: a chain of ``draft_length`` tokens.
    tree_nodes: tuple[int, ...] | None = None

    @property
    def drafter_used(self) -> str:
        """The drafter a round under this plan runs: ``"none"`` when γ = 0."""
        return self.drafter if self.draft_length > 0 else NO_DRAFT

    @classmethod
    def autoregressive(cls, num_layers: int, source: str = "fallback") -> DraftPlan:
        """The gamma = 0 plan: no speculation.

        Plans are immutable, so one instance per ``(num_layers, source)`` is shared: planners
        return it every plain round, and building a 2L-item mask each time showed up in the
        decode loop's profile.
        """
        return _autoregressive_plan(num_layers, source)


@functools.lru_cache(maxsize=64)
def _autoregressive_plan(num_layers: int, source: str) -> DraftPlan:
    return DraftPlan(SublayerMask.full(num_layers), 0, source=source)


@attrs.frozen
class StepOutcome:
    """What happened in one speculation round, fed back to ``Planner.update``.

    ``proposals`` are the drafts proposed before planning (full length: e.g. the lookup
    continuation, whether or not the round drafted with it) and ``committed_tokens`` the
    tokens the round committed, so a planner can score every proposal in hindsight.
    """

    plan: DraftPlan
    context_length: int
    drafted: int
    accepted: int
    draft_time_s: float
    verify_time_s: float
    proposals: tuple[Draft, ...] = ()
    committed_tokens: tuple[int, ...] = ()

    @property
    def committed(self) -> int:
        """Tokens committed this round: accepted drafts plus the bonus token."""
        return self.accepted + 1


def as_mask(value: SublayerMask | Sequence[bool]) -> SublayerMask:
    """Coerce a sequence of bools to a ``SublayerMask``."""
    return value if isinstance(value, SublayerMask) else SublayerMask(tuple(value))
