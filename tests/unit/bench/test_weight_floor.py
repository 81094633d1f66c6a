"""bench/weight_floor.py's report lines: llmserve's single-stream TPOT against the bytes a
decode step reads over the measured bandwidth. Expected values worked out here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from weight_floor import floor_lines  # noqa: E402


def test_each_file_is_set_against_its_floor() -> None:
    result = {
        "bandwidth": {"gb_per_s": 25.0},
        "floor": {"q4_0": {"bytes": 100e6, "ms": 4.0}, "q8_0": {"bytes": 150e6, "ms": 6.0}},
        "runs": {"1-q4_0": {"llmserve": {"tpot_ms": {"p50": 5.2}}}, "16-q8_0": {}},
    }
    assert floor_lines(result) == [
        "- q4_0: 100.0 MB of weights per decode step / 25.0 GB/s = 4.00 ms per token; "
        "llmserve's median single-stream TPOT 5.2 ms is 1.30x the floor (target <= 1.3x).",
        "- q8_0: 150.0 MB of weights per decode step / 25.0 GB/s = 6.00 ms per token; "
        "no llmserve single-stream run.",
    ]
