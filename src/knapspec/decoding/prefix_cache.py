"""A bounded cache of prompt prefixes (tokens and their K/V), reused across calls.

After a call, the decoder keeps the K/V of its sequence (prompt and output). A later
prompt that starts with the same tokens (a system prompt, the same document with another
question, a conversation resent whole) copies the K/V of the longest common prefix into
its cache and prefills only the rest. Entries are evicted least recently used first,
so that all of them together stay under a budget in MiB.

The cache is used only on an engine whose forward is chunk-invariant
(:attr:`~knapspec.model.engine.SublayerEngine.chunk_invariant`): a token's K/V then
depends only on the tokens up to it, so a reused prefix is bitwise what a cold prefill
computes and outputs equal cold outputs. Lookup is a scan over the entries (one vectorised
comparison each): the budget keeps them few; a radix tree (SGLang's) would pay off for
thousands.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs
import torch

from knapspec.model.cache import KVCache

MIB = 1 << 20


@attrs.define(eq=False)
class PrefixEntry:
    """One cached sequence.

    Attributes:
        tokens: ``(t,)`` token ids (on the CPU).
        keys, values: per layer ``(kv_heads, t, head_dim)`` copies of the K/V.
    """

    tokens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@attrs.define
class PrefixCacheStats:
    """Counters since the cache was made: lookups that reused a prefix (``hits``) or
    none (``misses``), tokens reused, entries evicted for room."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    size = min(a.numel(), b.numel())
    if size == 0:
        return 0
    differ = (a[:size] != b[:size]).nonzero()
    return int(differ[0, 0]) if differ.numel() else size


class PrefixCache:
    """LRU cache of token sequences and their K/V under a memory budget.

    Args:
        budget_mib: the most memory all entries together may hold, in MiB (> 0). A
            sequence larger than the budget is not kept.
    """

    def __init__(self, budget_mib: float) -> None:
        if not budget_mib > 0:
            raise ValueError(f"budget_mib must be > 0, got {budget_mib!r}")
        self.budget_bytes = int(budget_mib * MIB)
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest use first
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory the entries hold."""
        return sum(entry.nbytes for entry in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def restore(self, prompt: torch.Tensor, cache: KVCache) -> int:
        """Copy the K/V of the longest cached prefix of ``prompt (n,)`` into ``cache``
        (which is reset first) and return its length, at most ``n - 1`` (the last prompt
        token is always run, for its logits); 0 when no entry shares a first token."""
        tokens = prompt.cpu()
        best, length = None, 0
        for key, entry in self._entries.items():
            shared = _common_prefix(entry.tokens, tokens)
            if shared > length:
                best, length = key, shared
        length = min(length, tokens.numel() - 1)
        cache.reset()
        if best is None or length < 1:
            self.stats.misses += 1
            return 0
        entry = self._entries[best]
        self._entries.move_to_end(best)
        cache.reserve(length)
        for layer in range(cache.num_layers):
            cache.write(layer, 0, entry.keys[layer][:, :length], entry.values[layer][:, :length])
        self.stats.hits += 1
        self.stats.reused_tokens += length
        return length

    def store(self, tokens: torch.Tensor, cache: KVCache, length: int) -> None:
        """Keep ``tokens[:length]`` with the K/V ``cache`` holds for them (every layer
        must hold ``length`` positions). An entry this one extends is replaced; one that
        already covers it is only marked as used."""
        if length < 1 or cache.seq_length < length:
            return
        tokens = tokens[:length].cpu()
        for key, entry in list(self._entries.items()):
            shared = _common_prefix(entry.tokens, tokens)
            if shared == length:  # an entry already holds this sequence (or a longer one)
                self._entries.move_to_end(key)
                return
            if shared == entry.tokens.numel():  # this sequence extends the entry
                del self._entries[key]
        entry = PrefixEntry(
            tokens.clone(),
            [cache.keys(layer, length).clone() for layer in range(cache.num_layers)],
            [cache.values(layer, length).clone() for layer in range(cache.num_layers)],
        )
        if entry.nbytes > self.budget_bytes:
            return
        self._entries[self._next_key] = entry
        self._next_key += 1
        total = self.nbytes
        while total > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            total -= evicted.nbytes
            self.stats.evictions += 1


__all__ = ["MIB", "PrefixCache", "PrefixCacheStats", "PrefixEntry"]
