"""The C++ kernels' thread pool (pool.h; its entry points: pool.cpp) from Python: its thread
count, and a check of its loops for tests."""

from __future__ import annotations

import ctypes

from llmserve_kernels._checks import KernelArgumentError
from llmserve_kernels.cpu.build import library


def set_num_threads(threads: int) -> None:
    """Threads of every parallel loop of the C++ kernels (default: every core of the
    machine). They split work without waiting for a thread that another process keeps off
    its core (see pool.h), unlike torch's OpenMP loops."""
    if threads < 1:
        raise KernelArgumentError("threads", f"must be positive, got {threads}")
    library().llmserve_set_num_threads(threads)


def pool_check(counts: list[int], loops: int, threads: int, spin: int = 0) -> int:
    """Runs `loops` parallel loops of the kernels' thread pool (pool.h) on `threads` threads,
    loop l of counts[l % len(counts)] chunks, each chunk busy for `spin` pause instructions;
    returns how many loops returned before each of their chunks had run exactly once (0 for
    a correct pool). For tests."""
    if not counts or min(counts) < 1:
        raise KernelArgumentError("counts", f"must be positive chunk counts, got {counts}")
    for name, value in (("loops", loops), ("threads", threads)):
        if value < 1:
            raise KernelArgumentError(name, f"must be positive, got {value}")
    if spin < 0:
        raise KernelArgumentError("spin", f"must not be negative, got {spin}")
    array = (ctypes.c_int64 * len(counts))(*counts)
    return int(library().llmserve_pool_check(array, len(counts), loops, threads, spin))
