"""Checks of the exactness contract (``docs/theory.md``), for tests and for users.

The contract: for a cache holding ``n`` tokens and ``k`` tokens verified in one pass, the
logits and the K/V written for the token at position ``n + j`` are bitwise equal to those
of a one-token step at ``n + j`` on the cache holding the first ``n + j`` tokens. These
helpers run both and report every position where they differ; an empty list is the
contract kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from knapspec.model.batched import AttentionLayout, forward_batch, new_batch_cache

if TYPE_CHECKING:
    from knapspec.model.cache import KVCache
    from knapspec.model.engine import SublayerEngine


def _one_token_steps(
    engine: SublayerEngine, context: torch.Tensor, drafted: torch.Tensor
) -> tuple[torch.Tensor, KVCache]:
    """``(k, vocab)`` logits of ``k`` one-token steps after a prefill of ``context``."""
    cache = engine.new_cache(context.numel() + drafted.numel())
    engine.forward(context, 0, cache, all_logits=False)
    rows = []
    for j in range(drafted.numel()):
        rows.append(engine.forward(drafted[j : j + 1], context.numel() + j, cache).logits[0])
    return torch.stack(rows), cache


def verification_mismatches(
    engine: SublayerEngine, context: torch.Tensor, drafted: torch.Tensor
) -> list[str]:
    """Where verifying ``drafted (k,)`` after ``context (n,)`` in one pass differs from
    ``k`` one-token steps: ``"logits j"`` / ``"kv layer l position p"`` entries."""
    n = context.numel()
    cache = engine.new_cache(n + drafted.numel())
    engine.forward(context, 0, cache, all_logits=False)
    verified = engine.forward(drafted, n, cache).logits
    stepped, reference = _one_token_steps(engine, context, drafted)
    problems = [
        f"logits {j}" for j in range(drafted.numel()) if not torch.equal(verified[j], stepped[j])
    ]
    end = n + drafted.numel()
    for layer in range(engine.num_layers):
        for name, ours, theirs in (
            ("keys", cache.keys(layer, end), reference.keys(layer, end)),
            ("values", cache.values(layer, end), reference.values(layer, end)),
        ):
            for position in range(n, end):
                if not torch.equal(ours[:, position], theirs[:, position]):
                    problems.append(f"{name} layer {layer} position {position}")
    return problems


def batch_mismatches(
    engine: SublayerEngine,
    contexts: Sequence[torch.Tensor],
    drafted: Sequence[torch.Tensor],
    *,
    attention: AttentionLayout = "auto",
    packed: bool = True,
) -> list[str]:
    """Where a batched verification (row ``r``: ``drafted[r]`` after ``contexts[r]``)
    differs from row ``r`` decoded alone by one-token steps: logits and K/V, per row.

    ``packed``: ragged widths run packed (``widths=``); False pads every row to the widest
    (then rows must all have the same width).
    """
    rows = len(contexts)
    widths = [int(d.numel()) for d in drafted]
    width = max(widths)
    capacity = max(int(c.numel()) for c in contexts) + width
    cache = new_batch_cache(engine, rows, capacity)
    for row, context in enumerate(contexts):
        single = engine.new_cache(capacity)
        engine.forward(context, 0, single, all_logits=False)
        cache.load_row(row, single, context.numel())
    inputs = torch.zeros(rows, width, dtype=torch.long)
    for row, tokens in enumerate(drafted):
        inputs[row, : tokens.numel()] = tokens
    starts = [int(c.numel()) for c in contexts]
    logits = forward_batch(
        engine,
        inputs,
        starts,
        cache,
        widths=widths if packed else None,
        attention=attention,
        packed_logits=True,
    )
    problems = []
    offset = 0
    for row, (context, tokens) in enumerate(zip(contexts, drafted, strict=True)):
        stepped, reference = _one_token_steps(engine, context, tokens)
        for j in range(tokens.numel()):
            index = offset + j if packed else row * width + j
            if not torch.equal(logits[index], stepped[j]):
                problems.append(f"row {row} logits {j}")
        offset += tokens.numel()
        end = starts[row] + tokens.numel()
        for layer in range(engine.num_layers):
            ours = cache.row_keys(layer, row, end)[0][:, starts[row] :]
            if not torch.equal(ours, reference.keys(layer, end)[:, starts[row] :]):
                problems.append(f"row {row} keys layer {layer}")
    return problems


__all__ = ["batch_mismatches", "verification_mismatches"]
