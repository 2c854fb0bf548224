"""The greedy token helpers against torch.argmax (the oracle): ties, NaN, infinities,
strided views, dtypes numpy reads and those it does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from knapspec.decoding.greedy import greedy_ids, greedy_token, greedy_tokens

# Few distinct values, so that ties (the first index must win) are common.
values = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    table=arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 40)), elements=values),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_rows_match_torch_argmax(table: np.ndarray, dtype: torch.dtype) -> None:
    logits = torch.from_numpy(table).to(dtype)
    expected = logits.argmax(dim=-1)
    assert greedy_tokens(logits) == expected.tolist()
    ids = greedy_ids(logits)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, expected)
    for row in range(logits.shape[0]):
        assert greedy_token(logits[row]) == int(logits[row].argmax())


@settings(max_examples=100, deadline=None)
@given(table=arrays(np.float32, (6, 30), elements=values), step=st.integers(1, 3))
def test_strided_views_match(table: np.ndarray, step: int) -> None:
    logits = torch.from_numpy(table)
    view = logits[::step, 1::step]  # neither rows nor columns contiguous
    assert greedy_tokens(view) == view.argmax(dim=-1).tolist()
    assert greedy_token(view[0]) == int(view[0].argmax())


def test_inference_mode_and_grad_tensors() -> None:
    logits = torch.randn(3, 50, requires_grad=True)
    assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
    with torch.inference_mode():
        inner = torch.randn(4, 50)
        assert greedy_tokens(inner) == inner.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [1, 49152])
def test_the_first_of_equal_maxima(vocab: int) -> None:
    logits = torch.zeros(2, vocab)
    logits[1, vocab // 2 :] = 1.0
    assert greedy_tokens(logits) == [0, vocab // 2]
