"""``benchmarks/sampled_replay.py``: the wall-time ceiling a decode-phase speed puts on a
call whose prefill no drafter shortens, and the check that a stored recording answers the
command's question."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from benchmarks.sampled_replay import check_recording, recording_settings, wall_bound
from hypothesis import given
from hypothesis import strategies as st

seconds = st.floats(0.01, 100.0)
speeds = st.floats(0.1, 50.0)


@given(seconds, seconds, speeds, speeds)
def test_the_bound_rises_with_decode_speed_and_stays_under_the_prefill_ceiling(
    prefill: float, decode: float, slow: float, fast: float
) -> None:
    slow, fast = sorted((slow, fast))
    assert wall_bound(prefill, decode, slow) <= wall_bound(prefill, decode, fast) + 1e-12
    # However fast the decode phase, the call still pays its prefill.
    ceiling = (prefill + decode) / prefill
    assert wall_bound(prefill, decode, fast) < ceiling
    assert wall_bound(prefill, decode, 1.0) == pytest.approx(1.0)


def test_with_a_third_of_the_call_in_prefill_1_25x_wall_needs_about_1_43x_decode() -> None:
    # Issue #31's sampling goal at 2,048 tokens: P = 5 s, D = 10 s of plain sampling.
    assert wall_bound(5.0, 10.0, 1.4) == pytest.approx(15.0 / (5.0 + 10.0 / 1.4))
    assert wall_bound(5.0, 10.0, 1.4) < 1.25 < wall_bound(5.0, 10.0, 1.5)


def test_the_bound_rejects_impossible_timings() -> None:
    with pytest.raises(ValueError, match="decode > 0"):
        wall_bound(1.0, 0.0, 1.2)
    with pytest.raises(ValueError, match="speed-up > 0"):
        wall_bound(1.0, 2.0, 0.0)


RECORDING = Path(__file__).resolve().parents[1] / "results/drafters/sampled_outputs.json"


def asked(**changes: object) -> argparse.Namespace:
    settings = {"contexts": [2048, 4096], "prompts": 4, "seeds": 3, "new_tokens": 128}
    return argparse.Namespace(**{**settings, "T": 0.7, "top_p": 0.9, **changes})


def test_the_committed_recording_holds_what_the_default_command_asks() -> None:
    stored = json.loads(RECORDING.read_text())
    assert recording_settings(stored) == {
        "contexts": [2048, 4096],
        "prompts": 4,
        "seeds": 3,
        "new_tokens": 128,
        "T": 0.7,
        "top_p": 0.9,
    }
    check_recording(stored, asked(), RECORDING)  # the defaults replay it


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"contexts": [512]}, "contexts [2048, 4096] (asked [512])"),
        ({"seeds": 1}, "seeds 3 (asked 1)"),
        ({"new_tokens": 256}, "new_tokens 128 (asked 256)"),
        ({"T": 1.0}, "T 0.7 (asked 1.0)"),
    ],
)
def test_a_recording_made_with_other_settings_is_refused_by_name(
    change: dict[str, object], named: str
) -> None:
    stored = json.loads(RECORDING.read_text())
    with pytest.raises(ValueError, match="recorded with other settings") as raised:
        check_recording(stored, asked(**change), RECORDING)
    assert named in str(raised.value)
