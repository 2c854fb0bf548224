"""A row's one commit: up to its limit and its first stop token, with its stop reason."""

from __future__ import annotations

import torch

from knapspec.decoding.row import Row
from knapspec.decoding.sampler import TokenSampler
from knapspec.request import Request


def _row(limit: int, stop_ids: frozenset[int] = frozenset()) -> Row:
    request = Request([1, 2, 3], limit, stop_ids=stop_ids)
    return Row(request, TokenSampler.for_request(request, torch.device("cpu")))


def test_a_new_row_starts_at_its_prompt() -> None:
    row = _row(5)
    assert row.length == 3 and row.stats.prompt_tokens == 3
    assert row.output == [] and row.remaining == 5 and not row.stopped


def test_commit_keeps_tokens_up_to_the_limit() -> None:
    row = _row(4)
    assert row.commit([7, 8]) == [7, 8] and not row.stopped
    assert row.commit([9, 10, 11]) == [9, 10]
    assert row.output == [7, 8, 9, 10] and row.remaining == 0
    assert row.stats.stop_reason == "max_new_tokens"


def test_commit_stops_at_the_first_stop_token_and_keeps_it() -> None:
    row = _row(10, frozenset({5, 6}))
    assert row.commit([4, 6, 5, 9]) == [4, 6]
    assert row.stats.stop_reason == "eos" and row.stopped


def test_a_stop_token_at_the_limit_is_an_eos() -> None:
    row = _row(2, frozenset({5}))
    assert row.commit([4, 5]) == [4, 5] and row.stats.stop_reason == "eos"


def test_unreported_hands_each_token_once() -> None:
    row = _row(10)
    row.commit([1, 2])
    assert row.unreported() == [1, 2] and row.unreported() == []
    row.commit([3])
    assert row.unreported() == [3]


def test_draft_room_follows_the_limit_and_the_context() -> None:
    row = _row(4)
    assert row.draft_room(8, max_context=1000) == 3
    row.commit([1, 2])
    assert row.draft_room(8, max_context=1000) == 1
    row.length = 999
    assert row.draft_room(8, max_context=1000) == 0
