"""Multi-token rejection sampling: every position of a long round is distributed as the target.

``test_sampling.py`` checks the decoder's joint output distribution; this file checks the
rejection rule itself on rounds of four drafted tokens whose target and draft rows all
differ (so a bug that reads the wrong row cannot hide behind identical rows), with a
deliberately poor draft (frequent rejections, so the residual is exercised at every
position). Each correctness check is paired with power checks: the same statistic rejects
the two bugs a mutation review injected, "draft row 0 for every position" and "residual
from the next target row".

The model is position-dependent and context-independent: the target draws token ``j`` of
a round from ``p_j`` and the draft from ``q_j``. Then a lossless rule commits, at every
position ``j`` a round reaches, a token distributed as ``p_j`` (whether reaching ``j``
depends only on earlier positions, which are independent of position ``j``'s draws).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from scipy.stats import chisquare

import knapspec.decoding.sampler as sampler_module
import knapspec.decoding.verify as verify_module
from knapspec.decoding.verify import Verdict, verify_sampling

DRAFTED = 4
VOCAB = 5
ROUNDS = 12_000
#: Generations per decoder-level power check (half of the correctness test's).
DECODER_RUNS = 1000
#: Per-position chi-square threshold for the correct rule (fixed seeds: deterministic).
PASS = 1e-3
#: What a power check must reach against a wrong rule.
REJECT = 1e-8

Verifier = Callable[[list[int], torch.Tensor, torch.Tensor, torch.Generator | None], Verdict]


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """``p (DRAFTED + 1, V)`` target rows and ``q (DRAFTED, V)`` draft rows, all distinct.

    The draft puts its mass where the target has little, so about half of the draft
    tokens are rejected and the residual ``norm(max(0, p_j - q_j))`` decides many tokens.
    """
    p = torch.tensor(
        [
            [0.50, 0.20, 0.15, 0.10, 0.05],
            [0.05, 0.45, 0.10, 0.30, 0.10],
            [0.10, 0.05, 0.60, 0.05, 0.20],
            [0.30, 0.10, 0.05, 0.15, 0.40],
            [0.15, 0.35, 0.20, 0.25, 0.05],
        ],
        dtype=torch.float64,
    )
    q = torch.tensor(
        [
            [0.10, 0.10, 0.20, 0.20, 0.40],
            [0.40, 0.10, 0.30, 0.10, 0.10],
            [0.30, 0.30, 0.10, 0.20, 0.10],
            [0.05, 0.50, 0.30, 0.10, 0.05],
        ],
        dtype=torch.float64,
    )
    return p, q


def _position_samples(verify: Verifier, rounds: int = ROUNDS) -> tuple[list[list[int]], list[int]]:
    """Run ``rounds`` rounds; per position, the committed tokens; and the accepted counts."""
    p, q = _rows()
    generator = torch.Generator().manual_seed(0)
    drafts = torch.stack(
        [
            torch.multinomial(q[j], rounds, replacement=True, generator=generator)
            for j in range(DRAFTED)
        ],
        dim=1,
    ).tolist()  # (rounds, DRAFTED): x_j ~ q_j
    by_position: list[list[int]] = [[] for _ in range(DRAFTED + 1)]
    accepted: list[int] = []
    for draft in drafts:
        verdict = verify(draft, q, p, generator)
        accepted.append(verdict.accepted)
        for position, token in enumerate(verdict.tokens):
            by_position[position].append(token)
    return by_position, accepted


def _position_pvalues(by_position: list[list[int]]) -> list[float]:
    """Chi-square p-value of each position's committed tokens against ``p_j``."""
    p, _ = _rows()
    values = []
    for position, tokens in enumerate(by_position):
        counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
        expected = p[position] * counts.sum()
        values.append(float(chisquare(counts.tolist(), expected.tolist()).pvalue))
    return values


def test_every_position_of_a_four_token_round_is_distributed_as_its_target_row() -> None:
    by_position, accepted = _position_samples(verify_sampling)
    # The rounds really are long: thousands commit a 4th and a 5th token (bonus), and
    # thousands reject at each position, so both branches of the rule are exercised.
    assert sum(a >= 3 for a in accepted) > 1000, sorted(set(accepted))
    for position in range(DRAFTED):
        assert sum(a == position for a in accepted) > 500, f"few rejections at {position}"
    pvalues = _position_pvalues(by_position)
    assert min(pvalues) > PASS, pvalues


def _row_zero_draft(
    drafts: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """The bug: every position is judged with the first draft row ``q_0``."""
    rows = draft_probs[:1].expand(len(drafts), -1) if len(drafts) else draft_probs
    return verify_sampling(drafts, rows, target_probs, generator)


@contextmanager
def _residual_from_the_next_target_row() -> Iterator[None]:
    """The bug: after a rejection at ``j``, resample from ``norm(max(0, p_{j+1} - q_j))``.

    The real :func:`verify_sampling` runs; only its residual call is redirected to the next
    target row (found by identity among the rows of the call in progress).
    """
    original_verify = verify_module.verify_sampling
    original_residual = verify_module.residual_distribution
    current: list[torch.Tensor] = []

    def residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
        target = current[-1]
        j = next(i for i in range(target.shape[0]) if target[i].data_ptr() == p_row.data_ptr())
        return original_residual(target[min(j + 1, target.shape[0] - 1)], q_row)

    def verify(
        drafts: list[int],
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Verdict:
        current.append(target_probs)
        try:
            return original_verify(drafts, draft_probs, target_probs, generator)
        finally:
            current.pop()

    mp = pytest.MonkeyPatch()
    mp.setattr(verify_module, "residual_distribution", residual)
    mp.setattr(sampler_module, "verify_sampling", verify)
    try:
        yield
    finally:
        mp.undo()


def test_the_position_check_rejects_draft_row_zero_for_every_position() -> None:
    by_position, _ = _position_samples(_row_zero_draft)
    pvalues = _position_pvalues(by_position)
    assert pvalues[0] > PASS  # position 0 really uses q_0: the bug is invisible there
    assert min(pvalues[1:]) < REJECT, pvalues


def test_the_position_check_rejects_an_off_by_one_residual() -> None:
    with _residual_from_the_next_target_row():
        by_position, _ = _position_samples(sampler_module.verify_sampling)
    pvalues = _position_pvalues(by_position)
    assert min(pvalues[:DRAFTED]) < REJECT, pvalues


# ------------------------------------------------------------- through the decoder
def test_the_decoders_joint_check_rejects_draft_row_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """The joint chi-square of ``test_sampling.py`` (rounds of 3 drafts) rejects the row-0 bug.

    (The off-by-one residual moves the joint less: at 1000 generations its p-value was
    0.03, so it is left to the per-position check above, which rejects it at < 1e-8.)
    """
    from knapspec.decoding.decoder import SpeculativeDecoder
    from knapspec.planners import StaticPlanner
    from knapspec.sampling import SamplingParams
    from test_sampling import (
        BAD_DRAFT,
        LENGTH,
        PROMPT,
        _chi_square_pvalue,
        _exact_joint,
        _sample,
        _small_vocab_model,
    )

    model = _small_vocab_model()
    params = SamplingParams(do_sample=True, temperature=1.0, verification="rejection")
    decoder = SpeculativeDecoder(
        model, planner=StaticPlanner(BAD_DRAFT, LENGTH), confidence_threshold=0
    )
    monkeypatch.setattr(sampler_module, "verify_sampling", _row_zero_draft)
    samples = _sample(decoder, PROMPT, params, DECODER_RUNS, LENGTH)
    assert _chi_square_pvalue(samples, _exact_joint(model, PROMPT, params, LENGTH)) < REJECT
