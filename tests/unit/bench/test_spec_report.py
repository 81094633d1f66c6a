"""bench/spec_report.py pools a server's rounds (bench/spec_decode.py --rounds) into one row
and reads each round's ratio against its own plain server.

The summaries are written by hand in the shape spec_decode.py's client writes them; the
expected figures are worked out here from the counts, not taken from the code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from spec_report import pool, pool_rounds, round_ratios  # noqa: E402


def summary(tokens: int, seconds: float, decode_tokens: int, decode_s: float, **extra: Any) -> dict:
    return {
        "prompts": 2, "outputs": 2, "errors": 0, "duration_s": seconds,
        "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
        "decode_tokens": decode_tokens, "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s, "tpot_ms_p50": 1000 * decode_s / decode_tokens,
        "repeating": 1, "llama_draft_n": 0, "llama_draft_n_accepted": 0,
        "contention": "0.9 / 0.00", "commands": ["server", "client"], **extra,
    }  # fmt: skip


def test_pooled_rates_are_taken_over_the_summed_counts_not_averaged() -> None:
    fast = summary(100, 1.0, 98, 0.5, spec={"drafts": 3, "draft_tokens": 10, "accepted_tokens": 7})
    slow = summary(100, 4.0, 98, 3.5, spec={"drafts": 1, "draft_tokens": 4, "accepted_tokens": 1})
    pooled = pool([fast, slow])
    # 200 tokens in 5 s, not the mean of 100 and 25 tok/s (62.5).
    assert pooled["output_tokens_per_s"] == 40.0
    assert pooled["decode_tokens_per_s"] == 196 / 4.0
    assert pooled["outputs"] == 4 and pooled["repeating"] == 2
    assert pooled["spec"] == {"drafts": 4, "draft_tokens": 14, "accepted_tokens": 8}
    assert pooled["contention"] == "0.9 / 0.00; 0.9 / 0.00"


def test_a_failed_round_is_reported_not_pooled() -> None:
    failed = {"label": "llmserve", "error": "not healthy"}
    assert pool([summary(10, 1.0, 9, 0.9), failed]) is failed


def test_each_round_is_compared_with_its_own_plain_server() -> None:
    rounds = [
        {"code": {"llmserve": summary(100, 2.0, 98, 1.5), "llmserve-spec": summary(100, 1.0, 98, 0.5)}},
        {"code": {"llmserve-spec": summary(100, 1.0, 98, 0.7), "llmserve": summary(100, 1.25, 98, 1.05)}},
    ]  # fmt: skip
    result = {"rounds": rounds, "runs": pool_rounds(rounds)}
    assert result["runs"]["code"]["llmserve"]["output_tokens_per_s"] == 200 / 3.25
    (note,) = round_ratios(result)
    # Round 1: 100 / 50 tok/s = 2.00x, decode 196 / 65.3 = 3.00x; round 2: 100 / 80 = 1.25x,
    # decode 140 / 93.3 = 1.50x.
    assert note.endswith("2.00x (3.00x), 1.25x (1.50x)")


def test_a_run_stopped_early_pools_the_rounds_each_server_finished() -> None:
    rounds = [
        {"text": {"llmserve": summary(50, 1.0, 48, 0.8), "llmserve-spec": summary(50, 0.5, 48, 0.3)}},
        {"text": {"llmserve-spec": summary(50, 0.5, 48, 0.5)}},
    ]  # fmt: skip
    pooled = pool_rounds(rounds)["text"]
    assert pooled["llmserve"]["output_tokens"] == 50
    assert pooled["llmserve-spec"]["output_tokens"] == 100
    (note,) = round_ratios({"rounds": rounds, "runs": {"text": pooled}})
    assert note.endswith(": 2.00x (2.67x)")
