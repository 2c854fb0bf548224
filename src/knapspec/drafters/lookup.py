"""Prompt-lookup drafting: continue an earlier occurrence of the context's suffix.

The target's outputs often repeat spans of their prompt (quotes, names, edits of a
passage) and of themselves. :class:`LookupIndex` keeps, for every n-gram length ``1..N``,
the end positions of each n-gram seen so far, updated incrementally as tokens are
committed (O(N²) tuple work per token, independent of the context length: a few
microseconds; ``benchmarks/lookup_index.py`` measures it). A proposal:

1. finds the **longest** suffix of the context (up to ``N`` tokens) that occurred before;
2. takes the most recent ``max_candidates`` occurrences of it and extends each match
   backwards (up to ``max_match``) to learn how long it really is;
3. builds the continuation token by token by a **vote** of the occurrences that still
   agree with the tokens chosen so far, each weighted by its match length (the longer an
   occurrence matches the context, the more its continuation is trusted), as in
   SuffixDecoding's frequency-weighted continuation trees.

**History** (``history_tokens > 0``). The drafter also keeps the sequences (prompt and
output) of its earlier calls, up to ``history_tokens`` tokens, the oldest evicted first, each
in its own index: a call whose context ends with something an earlier call wrote (a second
question on the same document, the same prompt again, a template) votes with those
occurrences too. A new prompt that merely extends the last sequence (a conversation's next
turn) is indexed incrementally instead of archived. In a batch, each row also looks up in
the other rows' sequences as they grow, and the rows keep one history (a server's lanes:
what one request wrote is there for the next request in any lane), within one budget.

The draft's length is not decided here: the planner cuts it at the tokens-per-time optimum
from online acceptance estimates (:class:`~knapspec.drafters.acceptance.LookupAcceptance`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import attrs

from knapspec.drafters.base import DRAFTERS, LOOKUP, Draft, Drafter, DraftRequest
from knapspec.drafters.lookup_tree import TreeBuilder
from knapspec.types import DraftTree
from knapspec.validators import at_least


@attrs.frozen
class LookupConfig:
    """Hyper-parameters of :class:`LookupDrafter`.

    Attributes:
        max_ngram: N, the longest suffix looked up in the hash (>= 1); longer matches are
            measured by extending the candidates backwards.
        max_candidates: how many of the most recent occurrences of the matched suffix vote
            on the continuation (>= 1).
        max_match: cap on the measured match length (>= max_ngram); it only feeds the
            acceptance buckets and the vote weights.
        max_tokens: the longest continuation proposed (>= 1); the decoder's D caps it too.
        history_tokens: how many tokens of earlier calls' sequences (prompt and output)
            the drafter keeps to look up in (>= 0; 0, the default, turns history off; 16384
            is a fair size). About 0.7 KB of index per token with ``max_ngram = 4``. Off by
            default: with it, a repeated prompt drafts its whole earlier answer, so cold-call
            benchmarks that repeat prompts would measure the history instead.
        tree_nodes: the most nodes of the token tree a proposal holds (>= 0): the
            heaviest continuation, then the other occurrences' branches, best supported
            first (:meth:`LookupIndex.propose_tree`). The planner verifies the part that
            pays (a chain when branches do not). 0: chains only. At most 63 nodes are
            verified in one pass.
    """

    max_ngram: int = attrs.field(default=4, validator=at_least(1))
    max_candidates: int = attrs.field(default=8, validator=at_least(1))
    max_match: int = attrs.field(default=32, validator=at_least(1))
    max_tokens: int = attrs.field(default=16, validator=at_least(1))
    history_tokens: int = attrs.field(default=0, validator=at_least(0))
    tree_nodes: int = attrs.field(default=32, validator=at_least(0))

    def __attrs_post_init__(self) -> None:
        if self.max_match < self.max_ngram:
            raise ValueError(
                f"max_match must be >= max_ngram ({self.max_ngram}), got {self.max_match}"
            )


class LookupIndex:
    """An incremental n-gram index of a growing token sequence.

    For each ``n`` in ``1..N``, ``latest[n][gram]`` is the end position ``e`` of the most
    recent occurrence of the ``n``-gram ``gram`` such that a token follows ``e`` (a gram is
    registered when its next token arrives, so every occurrence has a continuation), and
    ``earlier[n][e]`` the end of the occurrence of the same gram before it (-1: none).
    Occurrences are read newest first along that chain, as many as wanted. The chains are
    flat lists of ints, not a list per gram: the garbage collector walks a few big objects
    instead of hundreds of thousands of small ones (with a list per gram, a full collection
    stalls indexing visibly once the sequence reaches tens of thousands of tokens; figures:
    ``results/engine/HISTORY.md``, "Figures behind docstrings").

    Args:
        max_ngram: N, the longest n-gram indexed (>= 1).
    """

    def __init__(self, max_ngram: int = 4) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]
        #: ``_earlier[n][e]``: see the class docstring (-1 also where no n-gram ends at e).
        self._earlier: list[list[int]] = [[] for _ in range(max_ngram + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens = []
        for latest, earlier in zip(self._latest, self._earlier, strict=True):
            latest.clear()
            earlier.clear()

    def append(self, token: int) -> None:
        """Add one token: registers the grams that end just before it (O(N²))."""
        tokens = self.tokens
        end = len(tokens) - 1  # grams ending here now have a continuation
        tokens.append(token)
        if end < 0:
            return
        for n in range(1, self.max_ngram + 1):
            if n > end + 1:
                self._earlier[n].append(-1)  # no n-gram ends at ``end``
                continue
            gram = tuple(tokens[end - n + 1 : end + 1])
            latest = self._latest[n]
            self._earlier[n].append(latest.get(gram, -1))
            latest[gram] = end

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def occurrences(self, gram: tuple[int, ...], limit: int | None = None) -> list[int]:
        """End positions (oldest first) of the most recent ``limit`` (default: all) earlier
        occurrences of ``gram`` that have a continuation; ``len(gram)`` must be in
        ``1..N``."""
        if not 1 <= len(gram) <= self.max_ngram:
            raise ValueError(f"gram length must be in [1, {self.max_ngram}], got {len(gram)}")
        n = len(gram)
        earlier = self._earlier[n]
        ends: list[int] = []
        end = self._latest[n].get(gram, -1)
        while end >= 0 and (limit is None or len(ends) < limit):
            ends.append(end)
            end = earlier[end]
        ends.reverse()
        return ends

    def longest_suffix_match(self, limit: int | None = None) -> tuple[int, list[int]]:
        """``(n, ends)``: the longest ``n <= N`` whose last-``n``-token suffix occurred
        before with a continuation, and the end positions of (the most recent ``limit``
        of) those occurrences, oldest first ((0, []) if none). The suffix's own position
        never counts: it has no continuation yet."""
        return self.suffix_occurrences(self.tokens, limit)

    def suffix_occurrences(
        self, context: Sequence[int], limit: int | None = None
    ) -> tuple[int, list[int]]:
        """``(n, ends)``: the longest ``n <= N`` such that the last ``n`` tokens of
        ``context`` occur in this index with a continuation, and the end positions of (the
        most recent ``limit`` of) those occurrences, oldest first ((0, []) if none)."""
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            gram = tuple(context[-n:])
            if gram in self._latest[n]:
                return n, self.occurrences(gram, limit)
        return 0, []

    def match_length(self, end: int, cap: int) -> int:
        """How many tokens ending at ``end`` equal the sequence's suffix (at most ``cap``)."""
        return _match_length(self.tokens, end, self.tokens, cap)

    def propose(
        self,
        max_tokens: int,
        *,
        max_candidates: int = 8,
        max_match: int = 32,
        history: Sequence[LookupIndex] = (),
    ) -> tuple[list[int], list[float], int]:
        """A continuation of the sequence by weighted vote of earlier occurrences.

        The occurrences are those of the longest suffix of the sequence found in it or in
        any of the ``history`` indexes (other sequences, oldest first), the most recent
        ``max_candidates`` of them (this sequence's count as the most recent).

        Returns:
            ``(tokens, support, match_length)``: up to ``max_tokens`` proposed tokens, per
            token the weighted fraction of still-agreeing occurrences that continue with
            it, and the longest measured match among the occurrences that agree with the
            first token (0 and empty lists when the suffix never occurred).
        """
        tree = self.propose_tree(
            max_tokens,
            max_nodes=0,
            max_candidates=max_candidates,
            max_match=max_match,
            history=history,
        )
        if tree is None:
            return [], [], 0
        draft, match = tree
        chain = draft.chain()
        return [draft.tokens[i] for i in chain], [draft.support[i] for i in chain], match

    def propose_tree(
        self,
        max_depth: int,
        *,
        max_nodes: int,
        max_candidates: int = 8,
        max_match: int = 32,
        history: Sequence[LookupIndex] = (),
    ) -> tuple[DraftTree, int] | None:
        """The continuations of the earlier occurrences as one token tree.

        The occurrences are those :meth:`propose` votes with. Each tree node gathers the
        occurrences that continue with its path, weighted by their match lengths; a node's
        children are ranked by that weight (ties: the most recent occurrence first), and
        the rank-0 path is :meth:`propose`'s continuation. The tree holds that whole path
        (up to ``max_depth``), then, best first by the product of the supports along
        their path, other nodes until it has ``max(max_nodes, path)`` nodes.

        Returns:
            ``(tree, match_length)``, None when the suffix never occurred or
            ``max_depth < 1``.
        """
        context = self.tokens
        found = [
            (other.tokens, *other.suffix_occurrences(context, max_candidates)) for other in history
        ]
        found.append((context, *self.longest_suffix_match(max_candidates)))
        n = max(length for _, length, _ in found)
        if n == 0 or max_depth < 1:
            return None
        occurrences = [
            (source, end) for source, length, ends in found if length == n for end in ends
        ]
        # Each candidate: (its sequence, where its continuation starts, its match length).
        candidates = [
            (source, end + 1, _match_length(source, end, context, max_match))
            for source, end in occurrences[-max_candidates:]
        ]
        builder = TreeBuilder(candidates, max_depth)
        # The heaviest path first, whole: it is what a chain drafts.
        node, options = -1, builder.expand(list(range(len(candidates))), 0)
        while options:
            builder.spare.extend((node, option) for option in options[1:])
            node = builder.add(node, options[0])
            options = builder.expand(options[0].supporters, builder.depth[node])
        builder.grow(max_nodes)
        if not builder.tokens:
            return None
        first = builder.first_supporters
        match = max((candidates[i][2] for i in first), default=n)
        return builder.tree(), match


def _match_length(source: Sequence[int], end: int, context: Sequence[int], cap: int) -> int:
    """How many tokens of ``source`` ending at ``end`` equal the last ones of ``context``
    (at most ``cap``)."""
    last = len(context) - 1
    length = 0
    while (
        length < cap
        and end - length >= 0
        and last - length >= 0
        and source[end - length] == context[last - length]
    ):
        length += 1
    return length


@DRAFTERS.register(LOOKUP)
class LookupDrafter(Drafter):
    """Drafts the continuation of the context's longest earlier-seen suffix (q one-hot).

    Args:
        config: hyper-parameters (:class:`LookupConfig`).
    """

    config_class = LookupConfig
    proposes_before_planning = True

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config if config is not None else LookupConfig()
        self.index = LookupIndex(self.config.max_ngram)
        #: Earlier calls' sequences, oldest first, at most ``config.history_tokens`` in all.
        self.history: deque[LookupIndex] = deque()
        #: The other rows of this drafter's batch (history on only), read live.
        self.peers: list[LookupDrafter] = []

    def share_rows(self, rows: Sequence[LookupDrafter]) -> None:
        """With history on, the other rows' sequences vote too (after the history's, before
        this row's own), and the rows keep one history: a sequence a row finishes is there
        for every row (a server's lanes: request ``i + 1`` often lands in another lane than
        request ``i``), within the one budget of ``history_tokens``."""
        if self.config.history_tokens > 0:
            self.peers = [row for row in rows if row is not self]
            self.history = rows[0].history

    def reset(self, tokens: list[int]) -> None:
        """Start a new sequence ``tokens``. The last one goes to the history, unless
        ``tokens`` extends it (then only the new tokens are indexed: the same index)."""
        current = self.index
        size = len(current)
        if size and len(tokens) >= size and tokens[:size] == current.tokens:
            current.extend(tokens[size:])
            return
        self._archive(current)
        self.index = LookupIndex(self.config.max_ngram)
        self.index.extend(tokens)

    def clear_history(self) -> None:
        """Forget every earlier call's sequence, the last one included (it would be
        archived by the next call's ``reset``)."""
        self.history.clear()
        self.index = LookupIndex(self.config.max_ngram)

    @property
    def history_size(self) -> int:
        """Tokens held in the history."""
        return sum(len(index) for index in self.history)

    def _archive(self, index: LookupIndex) -> None:
        """Keep ``index`` in the history (if it fits at all), evicting the oldest first."""
        budget = self.config.history_tokens
        if len(index) < 2 or len(index) > budget:
            return
        self.history.append(index)
        size = self.history_size
        while size > budget:
            size -= len(self.history.popleft())

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def propose(self, request: DraftRequest) -> Draft:
        """Up to ``min(request.budget, config.max_tokens)`` tokens; timed. Reads only the
        committed tokens it was given (``reset``/``extend``), never the model."""
        started = time.perf_counter()
        config = self.config
        found = self.index.propose_tree(
            min(request.budget, config.max_tokens),
            max_nodes=0 if request.chain_only else config.tree_nodes,
            max_candidates=config.max_candidates,
            max_match=config.max_match,
            history=[*self.history, *(peer.index for peer in self.peers)],
        )
        if found is None:
            return Draft((), LOOKUP, seconds=time.perf_counter() - started)
        tree, match = found
        chain = tree.chain()
        return Draft(
            tuple(tree.tokens[i] for i in chain),
            LOOKUP,
            support=tuple(tree.support[i] for i in chain),
            match_length=match,
            seconds=time.perf_counter() - started,
            tree=tree if len(tree) > len(chain) else None,
        )


__all__ = ["LookupConfig", "LookupDrafter", "LookupIndex"]
