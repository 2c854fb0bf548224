"""Checking and converting ``generate``'s arguments (shared by the single and batched paths)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from knapspec.decoding.sampler import resolve_seed
from knapspec.model.engine import ContextLengthError, SublayerEngine
from knapspec.request import new_token_limit, sampling_params, stop_set
from knapspec.sampling import SamplingParams


def batch_rows_limit(max_batch_rows: object) -> int | None:
    """``max_batch_rows`` checked: None, or an integer (numpy integers too) >= 1."""
    if max_batch_rows is None:
        return None
    if not isinstance(max_batch_rows, numbers.Integral) or isinstance(max_batch_rows, bool):
        raise TypeError(
            f"max_batch_rows must be an integer or None, got {type(max_batch_rows).__name__} "
            f"{max_batch_rows!r}"
        )
    if int(max_batch_rows) < 1:
        raise ValueError(f"max_batch_rows must be >= 1, got {int(max_batch_rows)}")
    return int(max_batch_rows)


def single_prompt(input_ids: torch.Tensor | Sequence[int], engine: SublayerEngine) -> torch.Tensor:
    """``(n,)`` long token ids on ``engine``'s device from a single prompt: ``(n,)`` or
    ``(1, n)`` ids, or a list of ints.

    Raises:
        ValueError: several rows (the message says how to pass a batch), another shape,
            an empty prompt, non-integer ids or ids outside ``[0, vocab)``.
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"input_ids has {ids.shape[0]} rows: pass attention_mask "
                f"(torch.ones_like(input_ids) for a batch without padding) or a list of "
                f"sequences for a batch, or call generate_batch"
            )
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must have shape (n,) or (1, n), got {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids, got dtype {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= engine.vocab_size:
        raise ValueError(f"token ids must be in [0, {engine.vocab_size}); got out-of-range ids")
    return ids.to(device=engine.device, dtype=torch.long)


def batch_prompts(
    input_ids: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    attention_mask: torch.Tensor | None,
    vocab_size: int,
) -> list[torch.Tensor]:
    """The rows of a batch as 1-D ``long`` tensors, padding removed.

    Args:
        input_ids: ``(B, n)`` left-padded ids, or a list of ``B`` token sequences.
        attention_mask: ``(B, n)`` 1 for tokens, 0 for (left) padding; only with a tensor.

    Raises:
        ValueError: naming the row: a mask of another shape, padding that is not on the
            left, an empty row, ids out of ``[0, vocab_size)``.
    """
    rows: list[torch.Tensor] = []
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"batched input_ids must be (B, n), got {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; they must match"
            )
        for row in range(input_ids.shape[0]):
            keep = mask[row].bool()
            count = int(keep.sum())
            if count and not bool(keep[-count:].all()):
                raise ValueError(
                    f"row {row}: attention_mask must be left padding (zeros, then ones); "
                    "pad on the left or pass a list of sequences"
                )
            rows.append(input_ids[row, keep])
    else:
        if attention_mask is not None:
            raise ValueError("attention_mask is only for a (B, n) tensor; a list has no padding")
        rows = [torch.as_tensor(row) for row in input_ids]
    if not rows:
        raise ValueError("the batch is empty: give at least one prompt")
    checked = []
    for row, ids in enumerate(rows):
        if ids.dim() != 1:
            raise ValueError(f"row {row}: a prompt must be 1-D token ids, got {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError(f"row {row}: the prompt is empty: give at least one token")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"row {row}: token ids must be integers, got dtype {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"row {row}: token ids must be in [0, {vocab_size})")
        checked.append(ids.to(torch.long).cpu())
    return checked


def check_batch_context(prompts: list[torch.Tensor], max_new_tokens: int, max_context: int) -> None:
    """Raise :class:`ContextLengthError` naming the first row whose prompt +
    ``max_new_tokens`` new tokens exceed ``max_context``."""
    for row, prompt in enumerate(prompts):
        if prompt.numel() + max_new_tokens > max_context:
            raise ContextLengthError(
                f"row {row}: {prompt.numel()} prompt tokens + max_new_tokens "
                f"{max_new_tokens} exceed the model's context of {max_context} tokens"
            )


def is_batch(input_ids: object) -> bool:
    """Whether ``input_ids`` is a list of token sequences (not a flat list of ids)."""
    if isinstance(input_ids, torch.Tensor) or not isinstance(input_ids, Sequence):
        return False
    if isinstance(input_ids, (str, bytes)) or not input_ids:
        return False
    first = input_ids[0]
    return isinstance(first, torch.Tensor) or (
        isinstance(first, Sequence) and not isinstance(first, (str, bytes))
    )


def row_seeds(params: SamplingParams, rows: int, seeds: Sequence[int] | None) -> list[int]:
    """Per row of a batch, the seed it samples with (resolved now, in row order).

    Row ``r`` samples with seed ``seeds[r]`` (mod ``2**64``), else ``params.seed + r``,
    else a fresh seed drawn from torch's global RNG (so ``torch.manual_seed`` makes the
    call reproducible); greedy rows draw nothing.
    """
    if seeds is not None and len(seeds) != rows:
        raise ValueError(f"seeds has {len(seeds)} entries for a batch of {rows} rows")
    if seeds is not None:
        return [int(seed) % 2**64 for seed in seeds]
    return [resolve_seed(params, row) for row in range(rows)]


__all__ = [
    "batch_prompts",
    "batch_rows_limit",
    "check_batch_context",
    "is_batch",
    "new_token_limit",
    "row_seeds",
    "sampling_params",
    "single_prompt",
    "stop_set",
]
