"""bench/rounds.py: alternated server order, and medians and ranges over rounds. The expected
values are worked out here from the inputs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from rounds import median_run, ratio_spread, round_order, spread  # noqa: E402


def test_odd_rounds_run_the_servers_in_reverse() -> None:
    orders = [round_order(["llmserve", "llama.cpp"], r) for r in range(4)]
    assert orders == [["llmserve", "llama.cpp"], ["llama.cpp", "llmserve"]] * 2


def test_the_spread_is_the_median_and_both_ends() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([4.0, 1.0, 2.0, 10.0]) == {"median": 3.0, "min": 1.0, "max": 10.0}


def test_the_median_run_is_one_real_run_and_a_failure_wins() -> None:
    runs = [{"tps": 5.0, "at": "a"}, {"tps": 9.0, "at": "b"}, {"tps": 7.0, "at": "c"}]
    assert median_run(runs, "tps")["at"] == "c"
    assert median_run(runs[:2], "tps")["at"] == "a"  # the lower of the middle two
    assert median_run([*runs, {"error": "exited"}], "tps") == {"error": "exited"}


def test_ratios_pair_each_round_with_itself() -> None:
    rounds = [
        {"ours": {"tps": 20.0}, "peer": {"tps": 10.0}},  # 2.0
        {"ours": {"tps": 30.0}, "peer": {"tps": 30.0}},  # 1.0
        {"ours": {"tps": 12.0}, "peer": {"tps": 8.0}},  # 1.5
        {"ours": {"tps": 50.0}},  # the peer failed: no pair
    ]
    assert ratio_spread(rounds, "ours", "peer", "tps") == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert ratio_spread(rounds[3:], "ours", "peer", "tps") is None
