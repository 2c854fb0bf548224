"""Checking and converting ``generate``'s arguments (shared by the single and batched paths)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from knapspec.sampling import SamplingParams


def sampling_params(sampling: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    """``sampling`` as :class:`SamplingParams` (a dict gives its fields)."""
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        fields = {field.name for field in attrs.fields(SamplingParams)}
        unknown = sorted(str(key) for key in sampling if key not in fields)
        if unknown:
            raise TypeError(
                f"sampling: unknown field(s) {', '.join(unknown)}; valid: {', '.join(fields)}"
            )
        return SamplingParams(**sampling)
    raise TypeError(
        f"sampling must be a SamplingParams or a dict of its fields, got {type(sampling).__name__}"
    )


def stop_set(eos_token_id: int | Sequence[int] | torch.Tensor | None) -> frozenset[int]:
    """The stop token ids as a set (None: no stop token)."""
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, torch.Tensor):
        values: list[Any] = eos_token_id.flatten().tolist()
    elif isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, Sequence):
        values = [eos_token_id]
    else:
        values = list(eos_token_id)
    for value in values:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(
                f"eos_token_id must be a token id (an integer), a sequence of them or a "
                f"tensor; got {type(value).__name__} {value!r}"
            )
    return frozenset(int(value) for value in values)


def new_token_limit(max_new_tokens: object) -> int:
    """``max_new_tokens`` checked: an integer (numpy integers too) >= 1."""
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool):
        raise TypeError(
            f"max_new_tokens must be an integer, got {type(max_new_tokens).__name__} "
            f"{max_new_tokens!r}"
        )
    limit = int(max_new_tokens)
    if limit < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {limit}")
    return limit


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


def row_generators(
    params: SamplingParams, rows: int, seeds: Sequence[int] | None, device: torch.device
) -> list[torch.Generator | None]:
    """One generator per row when sampling (None per row when greedy).

    Row ``r`` is seeded with ``seeds[r]``, else ``params.seed + r``, else a seed drawn
    from torch's global RNG (so ``torch.manual_seed`` makes the call reproducible).
    """
    if seeds is not None and len(seeds) != rows:
        raise ValueError(f"seeds has {len(seeds)} entries for a batch of {rows} rows")
    if not params.do_sample:
        return [None] * rows
    generators: list[torch.Generator | None] = []
    for row in range(rows):
        if seeds is not None:
            seed = int(seeds[row])
        elif params.seed is not None:
            seed = (params.seed + row) % 2**64
        else:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        generators.append(generator)
    return generators


__all__ = ["is_batch", "new_token_limit", "row_generators", "sampling_params", "stop_set"]
