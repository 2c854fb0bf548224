"""Token-tree rounds in the decoder: lossless greedy and sampled output, the cache after
compaction, and the tree walk's sampling rule against its target rows (with power checks).

The decoder tests use a tiny Llama, prompts whose n-grams recur with different
continuations (so the lookup proposes branching trees), and a cost model under which any
verification width costs one step (so the planner verifies whole trees): every test
asserts that trees were verified and that drafts were accepted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from knapspec import SpeculativeDecoder
from knapspec.config import DecoderConfig, build_components, load_builtin_components
from knapspec.decoding.sampler import TokenSampler
from knapspec.model.engine import SublayerEngine
from knapspec.sampling import REJECTION, SamplingParams
from knapspec.testing import CheapDraftCostModel, tiny_llama
from knapspec.types import DraftTree
from tiny_models import greedy_reference

load_builtin_components()

NEW_TOKENS = 40


def branching_prompt(seed: int) -> torch.Tensor:
    """``(n,)``: a few phrases, each repeated with varying endings (``a b c x``, ``a b c
    y``, ...), so a suffix recurs with several continuations."""
    generator = torch.Generator().manual_seed(seed)
    phrases = [torch.randint(0, 97, (3,), generator=generator) for _ in range(3)]
    parts = []
    for _ in range(4):
        for phrase in phrases:
            parts += [phrase, torch.randint(0, 97, (2,), generator=generator)]
    return torch.cat(parts)


PROMPTS = [branching_prompt(seed) for seed in (0, 1, 2)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(4, vocab_size=97, hidden_size=64)


def tree_decoder(model: torch.nn.Module, **lookup: Any) -> SpeculativeDecoder:
    """The knapsack planner with lookup drafts only, priced by a flat-width cost model."""
    engine = SublayerEngine(model)
    settings = DecoderConfig.from_dict(
        {
            "planner": {"name": "knapsack", "drafters": ["lookup"]},
            "drafters": {"lookup": lookup},
        }
    )
    planner, _, _ = build_components(settings, engine)
    return SpeculativeDecoder(
        engine, settings, planner=planner, cost_model=CheapDraftCostModel(engine.num_layers)
    )


def test_greedy_tree_rounds_equal_plain_greedy_decoding(model: torch.nn.Module) -> None:
    decoder = tree_decoder(model)
    trees = accepted = 0
    for index, prompt in enumerate(PROMPTS):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        expected = greedy_reference(model, prompt, NEW_TOKENS)
        assert torch.equal(result.tokens, expected), f"prompt {index} differs from greedy"
        trees += result.stats.tree_rounds
        accepted += result.stats.accepted_tokens
    assert trees > 0, "no token tree was verified: this test says nothing about trees"
    assert accepted > 0


def test_the_cache_holds_exactly_the_committed_tokens_after_tree_rounds(
    model: torch.nn.Module,
) -> None:
    decoder = tree_decoder(model)
    prompt = PROMPTS[0]
    result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
    assert result.stats.tree_rounds > 0
    sequence = result.sequences[0]
    # The last committed token is pending (its K/V is written by the next pass).
    held = sequence[:-1]
    cache = decoder._cache
    assert cache.seq_length == held.numel()
    reference = decoder.engine.new_cache(held.numel() + 8)
    decoder.engine.forward(held[: prompt.numel()], 0, reference, all_logits=False)
    for position in range(prompt.numel(), held.numel()):
        decoder.engine.forward(held[position : position + 1], position, reference)
    for layer in range(decoder.engine.num_layers):
        assert cache.lengths[layer] == held.numel()
        assert torch.equal(cache.keys(layer), reference.keys(layer)), f"keys, layer {layer}"
        assert torch.equal(cache.values(layer), reference.values(layer)), f"values, layer {layer}"


def test_keyed_sampling_with_trees_equals_plain_sampling(model: torch.nn.Module) -> None:
    decoder = tree_decoder(model)
    plain = SpeculativeDecoder.from_config(model, {"planner": {"name": "autoregressive"}})
    trees = 0
    for seed, prompt in enumerate(PROMPTS):
        kwargs: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "seed": seed}
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS, sampling=kwargs)
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS, sampling=kwargs)
        assert torch.equal(result.tokens, expected.tokens), f"prompt {seed}"
        trees += result.stats.tree_rounds
    assert trees > 0


def test_trees_off_verifies_chains_only(model: torch.nn.Module) -> None:
    decoder = tree_decoder(model, tree_nodes=0)
    result = decoder.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    assert result.stats.tree_rounds == 0
    assert torch.equal(result.tokens, greedy_reference(model, PROMPTS[0], NEW_TOKENS))


# ----------------------------------------------------------------- the walk's sampling rule

VOCAB = 5
ROUNDS = 12_000
PASS = 1e-3
REJECT = 1e-8
#: A tree over tokens 0..4: the root has children 0, 1, 2; node 0 (token 0) has 3 and 1.
TREE = DraftTree(
    tokens=(0, 1, 2, 3, 1, 4),
    parents=(-1, -1, -1, 0, 0, 3),
    support=(0.5, 0.3, 0.2, 0.6, 0.4, 1.0),
    rank=(0, 1, 2, 0, 1, 0),
)


def _rows() -> torch.Tensor:
    """``(1 + len(TREE), VOCAB)`` target rows, all distinct (row 0: the root; row ``1 + i``:
    below node ``i``), with enough mass on the tree's tokens that the walk often goes
    deep, and enough elsewhere that it often stops early."""
    return torch.tensor(
        [
            [0.50, 0.15, 0.10, 0.05, 0.20],  # root: children 0, 1, 2
            [0.10, 0.25, 0.05, 0.45, 0.15],  # below node 0 (token 0): children 3, 1
            [0.30, 0.10, 0.20, 0.15, 0.25],  # below node 1: a leaf
            [0.05, 0.35, 0.10, 0.30, 0.20],  # below node 2: a leaf
            [0.15, 0.05, 0.20, 0.10, 0.50],  # below node 3 (token 3): child 4
            [0.25, 0.25, 0.30, 0.10, 0.10],  # below node 4: a leaf
            [0.40, 0.20, 0.05, 0.25, 0.10],  # below node 5 (token 4): a leaf
        ],
        dtype=torch.float64,
    )


def _walk_samples(sampler: TokenSampler) -> dict[int, list[int]]:
    """Per tree row, the tokens the walk committed or followed from that row."""
    rows = _rows()
    logits = rows.log().float()
    picked: dict[int, list[int]] = {row: [] for row in range(rows.shape[0])}
    for _ in range(ROUNDS):
        verdict, path = sampler.verify_tree(TREE, logits, 0)
        for row, token in zip([0, *(node + 1 for node in path)], verdict.tokens, strict=True):
            picked[row].append(token)
    return picked


def _pvalues(picked: dict[int, list[int]]) -> dict[int, float]:
    rows = _rows()
    values = {}
    for row, tokens in picked.items():
        if len(tokens) < 200:
            continue
        counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
        values[row] = float(chisquare(counts.tolist(), (rows[row] * counts.sum()).tolist()).pvalue)
    return values


def test_every_tree_row_commits_tokens_distributed_as_that_row() -> None:
    sampler = TokenSampler(
        SamplingParams(do_sample=True, verification=REJECTION), 11, torch.device("cpu")
    )
    picked = _walk_samples(sampler)
    # The walk reaches the deep rows often enough to test them.
    assert len(picked[1 + 3]) > 1000 and len(picked[1 + 5]) > 200
    pvalues = _pvalues(picked)
    assert set(pvalues) >= {0, 1, 2, 4, 6}
    assert min(pvalues.values()) > PASS, pvalues


class _ParentRowSampler(TokenSampler):
    """A lossy walk: below the root it samples from the parent's row (off by one)."""

    def verify_tree(  # type: ignore[override]
        self, tree: DraftTree, logits: torch.Tensor, position: int
    ) -> tuple[Any, list[int]]:
        shifted = logits.clone()
        for node, parent in enumerate(tree.parents):
            shifted[node + 1] = logits[parent + 1]
        return super().verify_tree(tree, shifted, position)


class _FavourDraftSampler(TokenSampler):
    """A lossy walk: a miss takes the heaviest child anyway one time in two."""

    def pick(self, logits: torch.Tensor, position: int) -> int:
        token = super().pick(logits, position)
        missed = token not in (0, 3) and self.generator is not None
        if missed and float(torch.rand((), generator=self.generator)) < 0.5:
            return 0
        return token


@pytest.mark.parametrize("mutant", [_ParentRowSampler, _FavourDraftSampler])
def test_the_row_check_rejects_a_lossy_walk(mutant: type[TokenSampler]) -> None:
    sampler = mutant(
        SamplingParams(do_sample=True, verification=REJECTION), 11, torch.device("cpu")
    )
    assert min(_pvalues(_walk_samples(sampler)).values()) < REJECT


def test_greedy_tree_rounds_equal_plain_decoding_in_bfloat16() -> None:
    """The exactness contract covers tree rows in bf16 too: trees verified, output equal to
    the same engine's plain greedy decoding (bf16's own reference, not float32's)."""
    model = tiny_llama(4, vocab_size=97, hidden_size=64).to(torch.bfloat16)
    decoder = tree_decoder(model)
    plain = SpeculativeDecoder(decoder.engine, {"planner": {"name": "autoregressive"}})
    trees = 0
    for index, prompt in enumerate(PROMPTS):
        result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
        expected = plain.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.tokens, expected.tokens), f"prompt {index} differs (bf16)"
        trees += result.stats.tree_rounds
    assert trees > 0, "no token tree was verified in bf16"
