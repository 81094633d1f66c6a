"""The C++ kernels' thread pool (llmserve_kernels/cpu/pool.h): every chunk of a parallel loop runs
exactly once, and the loop returns only after all of them have run.

The race this guards against needs a helper thread preempted between reading a loop's ticket
and claiming from it while the caller moves on to a larger loop: more threads than this
machine's cores make that happen, a few times in ten million loops before the fix.
"""

from __future__ import annotations

import os

import pytest

from llmserve_kernels._checks import KernelArgumentError
from llmserve_kernels.cpu.pool import pool_check

# Loops of different sizes back to back, as a decode step's projections and attention are.
COUNTS = [2, 9, 3, 16]


def test_every_chunk_runs_once_before_the_loop_returns() -> None:
    threads = (os.cpu_count() or 1) + 1  # one more than the cores: helpers get preempted
    assert pool_check(COUNTS, loops=8_000_000, threads=threads) == 0


def test_slow_chunks_and_one_thread() -> None:
    assert pool_check(COUNTS, loops=20_000, threads=2, spin=200) == 0
    assert pool_check(COUNTS, loops=1_000, threads=1) == 0


def test_a_loop_longer_than_one_ticket_holds() -> None:
    # pool.h publishes at most 2**20 - 1 chunks at a time and splits longer loops.
    assert pool_check([(1 << 20) + 5, 3], loops=4, threads=2) == 0


@pytest.mark.parametrize(
    "counts, loops, threads, spin, field",
    [([], 1, 1, 0, "counts"), ([0], 1, 1, 0, "counts"), ([1], 0, 1, 0, "loops"),
     ([1], 1, 0, 0, "threads"), ([1], 1, 1, -1, "spin")],
)  # fmt: skip
def test_bad_arguments_name_their_field(
    counts: list[int], loops: int, threads: int, spin: int, field: str
) -> None:
    with pytest.raises(KernelArgumentError) as error:
        pool_check(counts, loops, threads, spin)
    assert error.value.name == field
