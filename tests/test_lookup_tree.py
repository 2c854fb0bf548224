"""Token trees from lookup: the tree a proposal builds, its hindsight estimates, its price.

Oracles: the occurrences' continuations enumerated by brute force (the tree holds exactly
their prefixes), and every ancestor-closed node set of a small tree (the pricing's cut is
the tokens-per-time optimum among all of them).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.costmodels.base import CostModel
from knapspec.decoding.sampler import TokenSampler
from knapspec.drafters.acceptance import BranchAcceptance, LookupAcceptanceConfig
from knapspec.drafters.base import DraftRequest
from knapspec.drafters.lookup import LookupConfig, LookupDrafter, LookupIndex, _match_length
from knapspec.planners.lookup import LookupPricing
from knapspec.sampling import SamplingParams
from knapspec.types import Draft, DraftTree

sequences = st.lists(st.integers(0, 3), min_size=2, max_size=60)


def continuations(tokens: list[int], depth: int, max_ngram: int, limit: int) -> list[list[int]]:
    """Brute force: the continuations (up to ``depth``) of the most recent ``limit``
    earlier occurrences of the longest suffix (``<= max_ngram``) that occurred before."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == suffix]
        if ends:
            return [tokens[e + 1 : e + 1 + depth] for e in ends[-limit:]]
    return []


@settings(max_examples=200, deadline=None)
@given(tokens=sequences, depth=st.integers(1, 6), limit=st.integers(1, 5))
def test_the_tree_holds_every_occurrence_continuation_and_nothing_else(
    tokens: list[int], depth: int, limit: int
) -> None:
    index = LookupIndex(3)
    index.extend(tokens)
    found = index.propose_tree(depth, max_nodes=10_000, max_candidates=limit)
    expected = continuations(tokens, depth, 3, limit)
    if not expected:
        assert found is None
        return
    assert found is not None
    tree, match = found
    paths = {tuple(tree.tokens[i] for i in tree.path(node)) for node in range(len(tree))}
    prefixes = {tuple(c[:k]) for c in expected for k in range(1, len(c) + 1)}
    assert paths == prefixes
    assert len(paths) == len(tree)  # siblings differ: one node per prefix
    assert match >= 1
    # Siblings' supports sum to one; rank 0 is the heaviest.
    for parent in {-1, *range(len(tree))}:
        kids = [i for i in range(len(tree)) if tree.parents[i] == parent]
        if kids:
            assert sum(tree.support[i] for i in kids) == pytest.approx(1.0)
            heaviest = max(tree.support[i] for i in kids)
            assert [tree.rank[i] for i in kids if tree.support[i] == heaviest].count(0) == 1
            assert sorted(tree.rank[i] for i in kids) == list(range(len(kids)))


def weighted_vote_chain(tokens: list[int], depth: int, limit: int) -> list[int]:
    """Brute force of the chain: at each step, the token with the most match-length
    weight among the occurrences agreeing so far (ties: first seen latest)."""
    index = LookupIndex(3)
    index.extend(tokens)
    _, ends = index.longest_suffix_match(limit)
    weights = {e: _match_length(tokens, e, tokens, 32) for e in ends}
    chain: list[int] = []
    active = list(ends)
    for step in range(depth):
        votes: dict[int, float] = {}
        for e in active:
            if e + 1 + step < len(tokens):
                token = tokens[e + 1 + step]
                votes[token] = votes.get(token, 0.0) + weights[e]
        if not votes:
            break
        best = max(reversed(list(votes)), key=votes.__getitem__)
        chain.append(best)
        active = [e for e in active if e + 1 + step < len(tokens) and tokens[e + 1 + step] == best]
    return chain


@settings(max_examples=200, deadline=None)
@given(tokens=sequences, depth=st.integers(1, 6), limit=st.integers(1, 5), nodes=st.integers(0, 9))
def test_the_heaviest_path_is_the_chain_and_the_size_is_bounded(
    tokens: list[int], depth: int, limit: int, nodes: int
) -> None:
    index = LookupIndex(3)
    index.extend(tokens)
    chain, _, _ = index.propose(depth, max_candidates=limit)
    assert chain == weighted_vote_chain(tokens, depth, limit)
    found = index.propose_tree(depth, max_nodes=nodes, max_candidates=limit)
    if found is None:
        assert chain == []
        return
    tree, _ = found
    assert [tree.tokens[i] for i in tree.chain()] == chain
    assert len(tree) <= max(nodes, len(chain))
    assert max(tree.depths) <= depth
    # Kept side nodes are the best supported: none left out is likelier than one kept.
    full, _ = index.propose_tree(depth, max_nodes=10_000, max_candidates=limit) or (tree, 0)
    assert len(full) >= len(tree)


@settings(max_examples=100, deadline=None)
@given(tokens=sequences, budget=st.integers(1, 6))
def test_a_chain_only_request_gets_the_same_chain_and_no_tree(
    tokens: list[int], budget: int
) -> None:
    drafter = LookupDrafter(LookupConfig(max_ngram=3, tree_nodes=32))
    drafter.reset(tokens)
    full = drafter.propose(DraftRequest(budget))
    chain = drafter.propose(DraftRequest(budget, chain_only=True))
    assert chain.tokens == full.tokens
    assert chain.support == full.support
    assert chain.match_length == full.match_length
    assert chain.tree is None


def test_a_tree_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="parent"):
        DraftTree((1, 2), (-1, 1), (1.0, 1.0), (0, 0))
    with pytest.raises(ValueError, match="siblings"):
        DraftTree((1, 1), (-1, -1), (0.5, 0.5), (0, 1))
    tree = DraftTree((5, 6, 7, 8), (-1, 0, -1, 1), (0.6, 1.0, 0.4, 1.0), (0, 0, 1, 0))
    assert tree.depths == (1, 2, 1, 3)
    assert tree.chain() == (0, 1, 3)
    assert tree.path(3) == [0, 1, 3]
    assert not tree.is_chain
    assert tree.subtree([0, 2]).tokens == (5, 7)
    with pytest.raises(ValueError, match="without its parent"):
        tree.subtree([1])
    draft = Draft((5, 6, 8), "lookup", support=(0.6, 1.0, 1.0), tree=tree)
    assert draft.truncated(2).tree is None
    branched = draft.branched([0, 2])
    assert branched.tokens == (5,) and branched.tree is not None and len(branched.tree) == 2


def test_side_branches_learn_from_hindsight() -> None:
    branches = BranchAcceptance(LookupAcceptanceConfig(decay=1.0))
    tree = DraftTree((5, 6, 7), (-1, 0, -1), (0.6, 1.0, 0.4), (0, 0, 1))
    before = branches.rate(0, 0.4, 1, chain_rate=0.5)
    for _ in range(20):
        branches.observe_round(tree, 0, [7, 1])  # the side branch was the target's token
    assert branches.rate(0, 0.4, 1, chain_rate=0.5) > 0.9 > before
    for _ in range(40):
        branches.observe_round(tree, 0, [5, 6])  # the heaviest path; the side branch lost
    assert branches.rate(0, 0.4, 1, chain_rate=0.5) < 0.4


class WidthCost(CostModel):
    """``t_verify(k) = 1 + slope·(k - 1)``: a plain step costs 1."""

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def t_attn(self, context_length: int, layer: int | None = None) -> float:
        return 0.0

    def t_mlp(self, layer: int | None = None) -> float:
        return 0.0

    def overhead(self, context_length: int) -> float:
        return 1.0

    def verify_cost(self, tokens: int, context_length: int) -> float:
        return 1.0 + self.slope * (tokens - 1)


class _Context:
    def __init__(self, draft: Draft) -> None:
        self._draft = draft
        self.context_length = 100
        self.trees = True

    def proposal(self, drafter: str) -> Draft | None:
        return self._draft


def ancestor_closed_sets(tree: DraftTree, deepest: int) -> list[tuple[int, ...]]:
    nodes = [i for i in range(len(tree)) if tree.depths[i] <= deepest]
    found = []
    for size in range(1, len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(tree.parents[i] < 0 or tree.parents[i] in chosen for i in subset):
                found.append(subset)
    return found


@settings(max_examples=60, deadline=None)
@given(
    slope=st.floats(0.005, 0.6),
    seed=st.integers(0, 10_000),
    max_draft=st.integers(1, 4),
)
def test_the_tree_cut_is_the_tokens_per_time_optimum_over_every_subtree(
    slope: float, seed: int, max_draft: int
) -> None:
    generator = np.random.default_rng(seed)
    size = int(generator.integers(2, 8))
    parents: list[int] = [-1]
    for i in range(1, size):
        parents.append(int(generator.integers(-1, i)))
    tokens = list(range(10, 10 + size))
    support = [float(generator.uniform(0.05, 1.0)) for _ in range(size)]
    rank = []
    for i, parent in enumerate(parents):
        siblings = [j for j in range(size) if parents[j] == parent]
        rank.append(sorted(siblings, key=lambda j: -support[j]).index(i))
    tree = DraftTree(tuple(tokens), tuple(parents), tuple(support), tuple(rank))
    chain = tree.chain()
    draft = Draft(tuple(tokens[i] for i in chain), "lookup", match_length=3, tree=tree)
    pricing = LookupPricing()
    option = pricing.price(_Context(draft), WidthCost(slope), max_draft)  # type: ignore[arg-type]
    assert option is not None
    # The brute-force optimum, with the same per-node probabilities.
    rates = pricing.acceptance.conditional(option.bucket, max(tree.depths))
    on_path = np.zeros(size)
    for i in range(size):
        rate = float(rates[tree.depths[i] - 1])
        if tree.rank[i] > 0:
            rate = pricing.branches.rate(option.bucket // 2, support[i], tree.depths[i], rate)
        on_path[i] = rate * (on_path[parents[i]] if parents[i] >= 0 else 1.0)
    best = 1.0  # gamma = 0: one token per plain step
    for subset in ancestor_closed_sets(tree, max_draft):
        best = max(best, (1.0 + on_path[list(subset)].sum()) / (1.0 + slope * len(subset)))
    assert option.tokens_per_second == pytest.approx(best, rel=1e-9)


def test_greedy_and_keyed_tree_walks_pick_the_targets_tokens() -> None:
    tree = DraftTree((5, 6, 7, 8), (-1, 0, -1, 2), (0.6, 1.0, 0.4, 1.0), (0, 0, 1, 0))
    logits = torch.full((5, 12), -5.0)
    logits[0, 7] = 5.0  # root: the target says 7 -> node 2
    logits[3, 8] = 5.0  # below node 2: 8 -> node 3
    logits[4, 1] = 5.0  # below node 3: 1, the bonus token
    greedy = TokenSampler(SamplingParams(), 0, torch.device("cpu"))
    verdict, path = greedy.verify_tree(tree, logits, 10)
    assert path == [2, 3] and verdict.tokens == [7, 8, 1] and verdict.accepted == 2
    logits[3, 8] = -5.0
    logits[3, 2] = 5.0
    verdict, path = greedy.verify_tree(tree, logits, 10)
    assert path == [2] and verdict.tokens == [7, 2]
    # Position-keyed: each step's token is what plain sampling picks at that position.
    params = SamplingParams(do_sample=True, temperature=1.0, seed=3)
    keyed = TokenSampler(params, 3, torch.device("cpu"))
    scores = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    verdict, path = keyed.verify_tree(tree, scores, 10)
    rows = [0, *(node + 1 for node in path)]
    picks = [keyed.choose(scores[row], 10 + depth)[0] for depth, row in enumerate(rows)]
    assert verdict.tokens == picks
