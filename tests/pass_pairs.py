"""One batched pass run twice, one of the engine's paths on then off
(:class:`~knapspec.model.passes.exact_pass.EnginePaths`), for bitwise comparisons
(``test_exact_pass.py``: the lean pass against the general path; ``test_layer_loop.py``:
the compiled layer loop against the lean items)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from knapspec.model.cache import KVCache
from knapspec.model.engine import ForwardOutput, SublayerEngine
from knapspec.model.passes.batched import forward_batch, new_batch_cache
from knapspec.types import SublayerMask

VOCAB = 97


def batched_both_ways(
    engine: SublayerEngine,
    switch: str,
    contexts: list[int],
    inputs: torch.Tensor,
    widths: list[int] | None,
    mask: SublayerMask | None = None,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Logits and every layer's K/V buffers of one batched pass of ``inputs (rows, q)``
    (row ``r`` after a prompt of ``contexts[r]`` tokens, prefilled alone and loaded into
    the batch cache), with the engine's path ``switch`` (an ``EnginePaths`` field) on, then
    off (as the engine had it afterwards)."""
    logits, buffers = [], []
    for on in (True, False):
        cache = new_batch_cache(engine, len(contexts), 48)
        for row, context in enumerate(contexts):
            single = engine.new_cache(48)
            generator = torch.Generator().manual_seed(seed + row)
            prompt = torch.randint(0, VOCAB, (context,), generator=generator)
            engine.forward(prompt, 0, single, all_logits=False)
            cache.load_row(row, single, context)
        with engine.use_paths(**{switch: on}):
            logits.append(forward_batch(engine, inputs, contexts, cache, widths=widths, mask=mask))
        buffers.append([b for layer in range(engine.num_layers) for b in cache.buffers(layer)])
    return logits, buffers


def assert_bitwise(logits: list[torch.Tensor], buffers: list[list[torch.Tensor]]) -> None:
    """Both runs' logits and K/V buffers are equal bit for bit."""
    assert torch.equal(logits[0], logits[1])
    for on, off in zip(*buffers, strict=True):
        assert torch.equal(on, off)


def sequence_both_ways(
    engine: SublayerEngine,
    switch: str,
    prompt: torch.Tensor,
    step: Callable[[KVCache], ForwardOutput],
) -> tuple[list[ForwardOutput], list[KVCache]]:
    """``prompt`` prefilled into a fresh cache, then ``step(cache)`` (a decode step, a
    verification, a token tree), with the engine's path ``switch`` (an ``EnginePaths``
    field) on, then off (as the engine had it afterwards): both outputs and both caches."""
    outputs, caches = [], []
    for on in (True, False):
        with engine.use_paths(**{switch: on}):
            cache = engine.new_cache(16)  # grows during the step: a lean pass reserves
            engine.forward(prompt, 0, cache, all_logits=False)
            outputs.append(step(cache))
            caches.append(cache)
    return outputs, caches


def assert_caches_equal(caches: list[KVCache]) -> None:
    """Both caches hold the same lengths and, bit for bit, the same keys and values."""
    assert caches[0].lengths == caches[1].lengths
    for layer in range(len(caches[0].lengths)):
        assert torch.equal(caches[0].keys(layer), caches[1].keys(layer))
        assert torch.equal(caches[0].values(layer), caches[1].values(layer))
