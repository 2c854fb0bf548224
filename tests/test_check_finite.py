"""The NaN/inf check of every pass's logits: exact, with a one-reduction fast path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knapspec.errors import NonFiniteLogitsError
from knapspec.validators import check_finite


@given(
    shape=st.sampled_from([(7,), (3, 11), (2, 4, 9)]),
    bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    where=st.integers(0, 10_000),
    seed=st.integers(0, 99),
)
def test_any_nan_or_inf_entry_raises(
    shape: tuple[int, ...], bad: float, where: int, seed: int
) -> None:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    check_finite(logits, "a step", error=NonFiniteLogitsError.during)  # finite: no error
    logits.view(-1)[where % logits.numel()] = bad
    with pytest.raises(NonFiniteLogitsError, match="during a step"):
        check_finite(logits, "a step", error=NonFiniteLogitsError.during)


def test_huge_finite_logits_whose_sum_overflows_are_not_an_error() -> None:
    logits = torch.full((4, 49152), 3e38)  # finite entries, a sum of inf
    assert not torch.isfinite(logits.sum())
    check_finite(logits, "a step", error=NonFiniteLogitsError.during)
    logits[2, 7] = float("inf")
    with pytest.raises(NonFiniteLogitsError):
        check_finite(logits, "a step", error=NonFiniteLogitsError.during)


def test_without_an_error_class_it_raises_a_value_error_naming_the_tensor() -> None:
    check_finite(torch.ones(3), "p")
    with pytest.raises(ValueError, match="p contains NaN"):
        check_finite(torch.tensor([1.0, float("nan")]), "p")
