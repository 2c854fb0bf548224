"""Checks of the exactness contract (``docs/theory.md``), for tests and for users.

The contract: for a cache holding ``n`` tokens and ``k`` tokens verified in one pass, the
logits and the K/V written for the token at position ``n + j`` are bitwise equal to those
of a one-token step at ``n + j`` on the cache holding the first ``n + j`` tokens. These
helpers run both and report every position where they differ; an empty list is the
contract kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from knapspec.model.passes.batched import AttentionLayout, forward_batch, new_batch_cache
from knapspec.model.passes.tree import tree_layout

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


def tree_mismatches(
    engine: SublayerEngine,
    context: torch.Tensor,
    tokens: torch.Tensor,
    parents: list[int],
    node: int,
    following: torch.Tensor,
) -> list[str]:
    """Where verifying the token tree ``tokens (T,)`` (``parents``: each node's parent,
    -1 for the root) after ``context (n,)``, then keeping the path to ``node``, differs
    from one-token steps along that path: the path's logits, every layer's K/V, and one
    step of ``following (1,)`` after the compaction."""
    start = context.numel()
    capacity = start + tokens.numel() + 1
    cache = engine.new_cache(capacity)
    engine.forward(context, 0, cache, all_logits=False)
    verified = engine.forward_tree(tokens, start, parents, cache)
    path = tree_layout(parents, start, tokens.numel()).path(node)
    cache.compact(start, path)
    reference = engine.new_cache(capacity)
    engine.forward(context, 0, reference, all_logits=False)
    problems = []
    for j, slot in enumerate(path):
        stepped = engine.forward(tokens[slot : slot + 1], start + j, reference).logits[0]
        if not torch.equal(verified.logits[slot], stepped):
            problems.append(f"logits of node {slot}")
    end = start + len(path)
    if not cache.lengths == reference.lengths == [end] * engine.num_layers:
        problems.append(f"lengths {cache.lengths} after compaction, expected {end} each")
        return problems
    for layer in range(engine.num_layers):
        if not torch.equal(cache.keys(layer), reference.keys(layer)):
            problems.append(f"keys layer {layer}")
        if not torch.equal(cache.values(layer), reference.values(layer)):
            problems.append(f"values layer {layer}")
    after = engine.forward(following, end, cache).logits
    if not torch.equal(after, engine.forward(following, end, reference).logits):
        problems.append("the step after compaction")
    return problems


class RowCountingKernel:
    """A product kernel for checks of power: ``base``'s result (``F.linear`` unless given),
    scaled by ``1 + drift`` whenever more than one row is computed, so a nonzero ``drift``
    makes it row-count dependent (the fault the contract rules out) and zero makes it the
    control. It records every call's row count, so a check can first show that the kernel
    ran where the engine computes (:meth:`SublayerEngine.substituted_products` puts it
    there) before it shows what the contract made of it."""

    def __init__(
        self,
        drift: float,
        base: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
        | None = None,
    ) -> None:
        self.drift = drift
        self.base = base if base is not None else F.linear
        #: The number of rows of every call, in order.
        self.rows: list[int] = []

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x (..., in)`` through ``weight (out, in)`` -> ``(..., out)``."""
        rows = x.numel() // x.shape[-1]
        self.rows.append(rows)
        out = self.base(x, weight, bias)
        return out * (1 + self.drift) if self.drift and rows > 1 else out

    @property
    def multi_row_calls(self) -> int:
        """How many calls computed more than one row (where a drift shows)."""
        return sum(1 for rows in self.rows if rows > 1)


__all__ = ["RowCountingKernel", "batch_mismatches", "tree_mismatches", "verification_mismatches"]
