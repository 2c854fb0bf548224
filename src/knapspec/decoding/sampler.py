"""How one sequence chooses and verifies its tokens: greedy, position-keyed or rejection.

A :class:`TokenSampler` is built per sequence per call (one per batch row) and used by
every place that picks a token: the prefill's first token, a plain step, a sub-network
draft step and the verification rows. Each call names the absolute position of the token
it picks (the prompt's tokens are positions ``0 .. n - 1``, the first new token is ``n``),
which is what position-keyed sampling keys its noise by (:mod:`knapspec.gumbel`).
"""

from __future__ import annotations

import torch

from knapspec.decoding.greedy import greedy_token
from knapspec.decoding.verify import Verdict, verify_greedy, verify_sampling
from knapspec.drafters.base import Draft
from knapspec.gumbel import keyed_argmax, position_key
from knapspec.request import Request
from knapspec.sampling import (
    REJECTION,
    SamplingParams,
    processed_probs,
    processed_scores,
    sample_token,
)
from knapspec.types import DraftTree


def resolve_seed(params: SamplingParams, offset: int = 0) -> int:
    """The seed a call samples with: ``params.seed + offset`` (mod ``2**64``), or, unseeded,
    a fresh one from torch's global RNG (so ``torch.manual_seed`` makes the call repeat).
    Greedy calls need none: 0, leaving the global RNG untouched."""
    if not params.do_sample:
        return 0
    if params.seed is not None:
        return (params.seed + offset) % 2**64
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def request_seed(request: Request) -> int:
    """The seed ``request`` samples with: its ``seed`` (mod ``2**64``), else as
    :func:`resolve_seed` gives for its sampling parameters."""
    if request.seed is not None:
        return request.seed % 2**64
    return resolve_seed(request.sampling)


class TokenSampler:
    """Picks and verifies one sequence's tokens under ``params``.

    Args:
        params: greedy when ``do_sample`` is false; else its ``verification`` scheme.
        seed: the resolved seed (:func:`resolve_seed`); ignored when greedy.
        device: where the rejection scheme's generator draws.
    """

    def __init__(self, params: SamplingParams, seed: int, device: torch.device) -> None:
        self.params = params
        self.seed = seed
        self.sampled = params.do_sample
        self.rejection = params.do_sample and params.verification == REJECTION
        self.generator: torch.Generator | None = None
        if self.rejection:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    @classmethod
    def for_request(cls, request: Request, device: torch.device) -> TokenSampler:
        """The sampler of ``request`` (its sampling parameters, :func:`request_seed`)."""
        return cls(request.sampling, request_seed(request), device)

    def choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The token at ``position`` from ``logits (vocab,)`` (already through any logits
        processor), and its processed distribution ``(vocab,)`` when sampling (a draft's
        ``q``; None when greedy)."""
        if not self.sampled:
            return greedy_token(logits), None
        if self.rejection:
            probs = processed_probs(logits, self.params)
            return sample_token(probs, self.generator), probs
        scores = processed_scores(logits, self.params)
        token = keyed_argmax(scores[None], [position_key(self.seed, position)])[0]
        return token, scores.softmax(dim=-1)

    def verify(self, draft: Draft, logits: torch.Tensor, position: int) -> Verdict:
        """Verify ``draft`` against the target's ``logits (k + 1, vocab)``, whose row ``j``
        picks the token at ``position + j``.

        Position-keyed: the target's token at each row is ``argmax(s + G)`` with that
        row's noise, and the drafts are matched against it exactly as greedy drafts are
        against the argmax; the committed tokens are those plain sampling picks.
        """
        drafts = list(draft.tokens)
        if not self.sampled:
            return verify_greedy(drafts, logits)
        if self.rejection:
            target = processed_probs(logits, self.params)
            draft_probs = draft.draft_probs(target.shape[-1], target.device)
            return verify_sampling(drafts, draft_probs, target, self.generator)
        scores = processed_scores(logits, self.params)
        # Row by row, stopping at the first mismatch: later rows' noise is never needed.
        j = 0
        while True:
            token = keyed_argmax(scores[j : j + 1], [position_key(self.seed, position + j)])[0]
            if j == len(drafts) or token != drafts[j]:
                return Verdict(j, [*drafts[:j], token])
            j += 1

    def pick(self, logits: torch.Tensor, position: int) -> int:
        """The target's token at ``position`` from one row of verification ``logits
        (vocab,)``: the argmax, the position-keyed sample (as :meth:`choose` picks it), or
        a draw from the processed distribution with the call's generator (rejection
        scheme)."""
        if not self.sampled:
            return greedy_token(logits)
        if self.rejection:
            return sample_token(processed_probs(logits, self.params), self.generator)
        return self.choose(logits, position)[0]

    def verify_tree(
        self, tree: DraftTree, logits: torch.Tensor, position: int
    ) -> tuple[Verdict, list[int]]:
        """Verify a token tree against the target's ``logits (1 + len(tree), vocab)``: row
        0 follows the committed tokens, row ``1 + i`` follows node ``i``'s path; the token
        a row picks is at ``position + depth``.

        From the root, the target picks its token at the current row (:meth:`pick`); the
        walk descends to the child holding that token, and ends, committing it, where no
        child does. Every committed token is thus the target's own pick given the
        committed prefix (the argmax; the position-keyed sample plain sampling draws; a
        draw from ``p``), so the output is plain decoding's, greedy or sampled
        (``docs/theory.md``, "Token trees"). Lookup drafts only: their ``q`` is one-hot.

        Returns:
            the verdict and the accepted nodes, root side first.
        """
        children: dict[int, dict[int, int]] = {}
        for i, (parent, token) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
            children.setdefault(parent, {})[token] = i
        node = -1
        path: list[int] = []
        tokens: list[int] = []
        while True:
            token = self.pick(logits[node + 1], position + len(path))
            tokens.append(token)
            child = children.get(node, {}).get(token)
            if child is None:
                return Verdict(len(path), tokens), path
            path.append(child)
            node = child


__all__ = ["TokenSampler", "request_seed", "resolve_seed"]
