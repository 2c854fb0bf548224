"""The request record: its conversions, its checks' messages, and the two rooms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from knapspec.decoding.sampler import TokenSampler, request_seed
from knapspec.request import Request, completion_room, draft_room
from knapspec.sampling import SamplingParams


def test_a_request_converts_its_fields() -> None:
    request = Request([3, 1, 4], np.int64(7), {"do_sample": True, "seed": 5}, 2, seed=np.int32(9))
    assert request.prompt.dtype == torch.long and request.prompt.tolist() == [3, 1, 4]
    assert request.prompt_tokens == 3
    assert request.max_new_tokens == 7 and type(request.max_new_tokens) is int
    assert request.sampling == SamplingParams(do_sample=True, seed=5)
    assert request.stop_ids == frozenset({2})
    assert request.seed == 9 and type(request.seed) is int
    narrow = Request(torch.tensor([1, 2], dtype=torch.int32), stop_ids=torch.tensor([[4, 5]]))
    assert narrow.prompt.dtype == torch.long and narrow.stop_ids == frozenset({4, 5})
    assert Request([1], stop_ids=[4, 5]).stop_ids == frozenset({4, 5})
    assert Request([1], stop_ids={4, 5}).stop_ids == frozenset({4, 5})
    assert Request([1]).stop_ids == frozenset() == Request([1], stop_ids=None).stop_ids


def test_a_request_is_compared_by_identity() -> None:
    assert Request([1, 2], 3) != Request([1, 2], 3)
    request = Request([1, 2], 3)
    assert request == request and len({request, request}) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"prompt": []}, ValueError, "the prompt is empty"),
        ({"prompt": torch.ones(2, 2, dtype=torch.long)}, ValueError, "1-D token ids"),
        ({"prompt": torch.ones(2)}, ValueError, "integer token ids"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an integer"),
        ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an integer"),
        ({"sampling": {"temp": 1.0}}, TypeError, "unknown field(s) temp"),
        ({"sampling": 0.7}, TypeError, "sampling must be a SamplingParams"),
        ({"stop_ids": ["x"]}, TypeError, "eos_token_id must be a token id"),
        ({"seed": "1"}, TypeError, "seed must be an integer or None"),
        ({"logits_processor": 3}, TypeError, "logits_processor must be a callable"),
    ],
)
def test_a_bad_field_is_named(kwargs: dict[str, object], error: type, message: str) -> None:
    fields: dict[str, object] = {"prompt": [1, 2], **kwargs}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        Request(**fields)  # type: ignore[arg-type]


def test_a_tensor_prompt_keeps_its_values_and_a_frozen_record_refuses_writes() -> None:
    ids = torch.tensor([5, 6, 7])
    request = Request(ids, 4)
    assert torch.equal(request.prompt, ids)
    with pytest.raises(AttributeError):
        request.max_new_tokens = 5  # type: ignore[misc]


def test_remaining_counts_down_to_the_limit() -> None:
    request = Request([1], 5)
    assert [request.remaining(n) for n in range(6)] == [5, 4, 3, 2, 1, 0]


def test_draft_room_is_bounded_by_the_draft_length_the_limit_and_the_context() -> None:
    assert draft_room(8, remaining=100, context=10, max_context=1000) == 8
    assert draft_room(8, remaining=4, context=10, max_context=1000) == 3  # one for the target
    assert draft_room(8, remaining=1, context=10, max_context=1000) == 0
    assert draft_room(8, remaining=100, context=995, max_context=1000) == 4
    assert draft_room(8, remaining=0, context=999, max_context=1000) == 0  # never negative


def test_completion_room_leaves_the_last_rounds_drafts_and_pending_token() -> None:
    assert completion_room(256, 100, 8) == 147
    assert completion_room(20, 12, 8) == -1  # nothing fits


def test_the_seed_of_a_request() -> None:
    sampled = SamplingParams(do_sample=True, seed=11)
    assert request_seed(Request([1], sampling=sampled)) == 11
    assert request_seed(Request([1], sampling=sampled, seed=3)) == 3  # its own wins
    assert request_seed(Request([1], sampling=sampled, seed=-1)) == 2**64 - 1
    assert request_seed(Request([1])) == 0  # greedy draws nothing
    torch.manual_seed(0)
    first = request_seed(Request([1], sampling=SamplingParams(do_sample=True)))
    torch.manual_seed(0)
    assert request_seed(Request([1], sampling=SamplingParams(do_sample=True))) == first
    sampler = TokenSampler.for_request(Request([1], sampling=sampled, seed=4), torch.device("cpu"))
    assert sampler.seed == 4 and sampler.sampled
