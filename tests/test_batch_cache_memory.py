"""The batch K/V cache's buffers: zeros whose memory is committed as rows are written
(:func:`knapspec.model.batch_cache.zeros_on_demand`)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

from knapspec.model.batch_cache import BatchKVCache, zeros_on_demand

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_buffer_is_zeros_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    buffer = zeros_on_demand((3, 2, 50, 8), dtype, CPU)
    assert buffer.shape == (3, 2, 50, 8) and buffer.dtype == dtype and buffer.is_contiguous()
    assert torch.equal(buffer, torch.zeros_like(buffer))
    buffer[1, :, 10:20] = 2.5
    gc.collect()  # the mapping lives as long as the tensor, not as the Python object
    assert torch.all(buffer[1, :, 10:20] == 2.5)
    assert torch.count_nonzero(buffer) == 2 * 10 * 8
    assert buffer.data_ptr() % 64 == 0  # page-aligned: the kernels' vector loads
    assert zeros_on_demand((0, 4), dtype, CPU).shape == (0, 4)


_RESIDENCY = """
import json
from pathlib import Path

import torch

from knapspec.model.batch_cache import zeros_on_demand


def resident_mib():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


before = resident_mib()
buffer = zeros_on_demand((16, 3, 4096, 64), torch.float32, torch.device("cpu"))  # 48 MiB
untouched = resident_mib() - before
buffer[:, :, :1024] = 1.0  # a quarter of every row
written = resident_mib() - before
eager = torch.zeros((16, 3, 4096, 64))
print(json.dumps([untouched, written, resident_mib() - before - written]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads resident memory from /proc")
def test_memory_is_committed_only_where_rows_are_written() -> None:
    """Measured in a fresh interpreter: in a test worker that has freed large tensors
    before, ``torch.zeros`` may land on pages already resident and the eager baseline
    (the check that resident memory shows writes at all) grows by less than it writes."""
    result = subprocess.run(
        [sys.executable, "-c", _RESIDENCY], capture_output=True, text=True, timeout=120, check=True
    )
    untouched, written, eager = json.loads(result.stdout.strip().splitlines()[-1])
    assert untouched < 4, f"{untouched:.1f} MiB resident before anything was written"
    assert 10 <= written <= 16, f"{written:.1f} MiB resident after writing 12 MiB"
    assert eager >= 40, f"torch.zeros of 48 MiB committed only {eager:.1f} MiB"


def test_a_batch_cache_reads_zeros_past_every_rows_length() -> None:
    cache = BatchKVCache(2, 3, 2, 8, 64, dtype=torch.bfloat16, device=CPU)
    for layer in range(2):
        keys, values = cache._keys[layer], cache._values[layer]
        assert torch.count_nonzero(keys) == 0 and torch.count_nonzero(values) == 0
        assert torch.isfinite(keys.float()).all() and torch.isfinite(values.float()).all()
