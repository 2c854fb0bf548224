"""Skip markers for tests whose kernels need a compiled unit natively (AMX tiles,
AVX512-BF16): on a CPU without the unit, or under ``--cpu-flags`` claiming a CPU without
it (``nox -s avx2``, ``nox -s zen4``), they skip with a reason that starts with
:data:`NATIVE_SKIP`, and the run's summary counts them in one line (``conftest.py``)."""

from __future__ import annotations

import pytest

from knapspec.model.kernels.row_attention import available_bf16_units
from knapspec.model.kernels.row_linear import amx_available, packed_available
from knapspec.model.machine import AMX_TILE_FLAGS, AVX512_BF16_FLAGS, claimed_absent

#: How every such skip reason starts.
NATIVE_SKIP = "native unit"


def native_reason(unit: str, flags: tuple[str, ...]) -> str:
    """Why a test of ``unit`` (which needs ``flags``) skips on this run."""
    where = (
        "absent from the claimed CPU flags (--cpu-flags)"
        if claimed_absent(*flags)
        else "absent from this CPU, or refused by its OS"
    )
    return f"{NATIVE_SKIP}: {unit} ({' '.join(flags)}) {where}"


AMX_REASON = native_reason("AMX tiles", AMX_TILE_FLAGS)
AVX512_BF16_REASON = native_reason("AVX512-BF16", AVX512_BF16_FLAGS)

needs_amx_tiles = pytest.mark.skipif(not amx_available(), reason=AMX_REASON)
needs_avx512_bf16 = pytest.mark.skipif(not packed_available(), reason=AVX512_BF16_REASON)
#: The bf16 compiled layer loop calls packed products: either unit serves it.
needs_packed_products = pytest.mark.skipif(
    not (amx_available() or packed_available()),
    reason=native_reason("AVX512-BF16 or AMX tiles", AVX512_BF16_FLAGS),
)


def skip_unless_attention_unit(unit: str) -> None:
    """Skip the calling test unless bf16 attention may run on ``unit`` here."""
    if unit == "amx-tiles" and unit not in available_bf16_units():
        pytest.skip(AMX_REASON)
    if unit == "avx512-bf16" and unit not in available_bf16_units():
        pytest.skip(AVX512_BF16_REASON)
