"""The bookkeeping of ``benchmarks/tree_replay.py`` (trees, chains and hindsight oracles
replayed on recorded greedy outputs): greedy acceptance of a kept subtree against a
brute-force walk, and the replay's accounting on real lookup proposals."""

from __future__ import annotations

import pytest
from benchmarks.tree_replay import POLICIES, CurveCost, deepest_match, replay
from hypothesis import given, settings
from hypothesis import strategies as st

from knapspec.types import DraftTree


@st.composite
def trees_and_paths(draw: st.DrawFn) -> tuple[DraftTree, set[int], list[int]]:
    """A random token tree over a 4-token vocabulary, an ancestor-closed kept set and the
    target's next tokens."""
    size = draw(st.integers(1, 14))
    tokens: list[int] = []
    parents: list[int] = []
    for node in range(size):
        parent = draw(st.integers(-1, node - 1))
        used = {t for t, p in zip(tokens, parents, strict=True) if p == parent}
        free = [t for t in range(4) if t not in used]
        if not free:
            parent, free = -1, [4 + node]  # a token no other node has, under the root
        tokens.append(draw(st.sampled_from(free)))
        parents.append(parent)
    tree = DraftTree(tuple(tokens), tuple(parents), (1.0,) * size, (0,) * size)
    chosen = draw(st.sets(st.integers(0, size - 1)))
    kept = {n for n in chosen if all(a in chosen for a in ancestors(tree, n))}
    expected = draw(st.lists(st.integers(0, 5), max_size=8))
    return tree, kept, expected


def ancestors(tree: DraftTree, node: int) -> list[int]:
    path = []
    while tree.parents[node] >= 0:
        node = tree.parents[node]
        path.append(node)
    return path


def brute_force_match(tree: DraftTree, kept: set[int], expected: list[int]) -> int:
    """The longest kept root path whose tokens are a prefix of ``expected``."""
    best = 0
    for node in kept:
        path = [node, *ancestors(tree, node)][::-1]
        tokens = [tree.tokens[n] for n in path]
        if len(tokens) <= len(expected) and tokens == expected[: len(tokens)]:
            best = max(best, len(tokens))
    return best


@settings(max_examples=300, deadline=None)
@given(trees_and_paths())
def test_deepest_match_is_the_longest_kept_path_the_target_continues(
    case: tuple[DraftTree, set[int], list[int]],
) -> None:
    tree, kept, expected = case
    assert deepest_match(tree, kept, expected) == brute_force_match(tree, kept, expected)


class LinearCost:
    """A verification-cost law ``step·(1 + 0.06 (k - 1))`` (this CPU's measured slope)."""

    def step_cost(self, n: int) -> float:
        return 0.1 + 1e-6 * n

    def verify_cost(self, tokens: int, n: int) -> float:
        return self.step_cost(n) * (1.0 + 0.06 * (tokens - 1))


def repeating_text() -> tuple[list[int], list[int]]:
    """A prompt holding two variants of one phrase, and an output that reuses both, so
    the lookup tree branches and the continuation is partly predictable."""
    phrase_a = [11, 12, 13, 14, 15, 16, 17, 18]
    phrase_b = [11, 12, 13, 24, 25, 26, 27, 28]
    prompt = [1, 2, *phrase_a, 3, 4, *phrase_b, 5, 6, *phrase_a, 7]
    output = [8, *phrase_b, 9, *phrase_a, 10, *phrase_b, *phrase_a, 2]
    return prompt, output


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("slope", [None, 1.0 / 30.0])
def test_replay_commits_the_whole_output_and_counts_its_rounds(
    policy: str, slope: float | None
) -> None:
    prompt, output = repeating_text()
    result = replay(prompt, output, policy, CurveCost(LinearCost(), slope), max_draft=10)
    assert result["accepted"] + result["rounds"] == len(output) - 1
    assert result["accepted"] <= result["verified_nodes"]
    assert result["tokens_per_round"] == pytest.approx((len(output) - 1) / result["rounds"])
    assert result["speedup"] > 0


def test_oracles_accept_drafts_on_repeated_phrases_and_beat_plain_steps() -> None:
    prompt, output = repeating_text()
    cost = CurveCost(LinearCost(), None)
    for policy in ("chain-oracle", "tree-oracle", "wide-oracle"):
        result = replay(prompt, output, policy, cost, max_draft=10)
        # An oracle drafts only tokens that are accepted, so it never loses to plain steps.
        assert result["accepted"] == result["verified_nodes"] > 0
        assert result["speedup"] > 1.0


def test_replay_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match="valid: chain, tree"):
        replay([1, 2, 3], [4, 5], "beam", CurveCost(LinearCost(), None), max_draft=4)
