"""Alternated rounds for benchmarks that compare servers (bench/vs_llama_cpp.py --rounds):
the order the servers run in each round, and each figure's median and range over rounds.

Alternating the order puts both servers of a pair on the same drift of a shared machine (a
server that always runs second always meets a warmer, or busier, machine)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def round_order(names: Sequence[str], rnd: int) -> list[str]:
    """The servers' order in round `rnd` (from 0): as listed in even rounds, reversed in odd."""
    return list(names) if rnd % 2 == 0 else list(reversed(names))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, lowest and highest of `values` (one per round)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_run(summaries: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """Of one server's runs of a workload, the one whose `key` is the median (the lower of the
    middle two for an even count), so that the figures reported beside it come from one run;
    a failed run (an "error" key) if any failed."""
    failed = [s for s in summaries if "error" in s]
    if failed:
        return failed[0]
    ranked = sorted(summaries, key=lambda s: s[key])
    return ranked[(len(ranked) - 1) // 2]


def ratio_spread(
    rounds: Sequence[dict[str, dict[str, Any]]], ours: str, peer: str, key: str
) -> dict[str, float] | None:
    """`spread` of ours' `key` over peer's, each round's pair on its own; None if no round
    has both."""
    ratios = [
        r[ours][key] / r[peer][key]
        for r in rounds
        if r.get(ours, {}).get(key) and r.get(peer, {}).get(key)
    ]
    return spread(ratios) if ratios else None
