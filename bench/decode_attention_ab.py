"""A decode step's paged attention in two builds (two checkouts), in one process (issue #52).

The step is bench/decode_attention.py's (`--seqs` sequences of each `--contexts` length through
`--layers` layers, SmolLM2-135M's heads by default). As in bench/kernel_ab.py, both builds'
libraries are loaded here and called in turn on the same caches, the order reversed every
other pass, each thread pool left to fall asleep before the other's pass, since separate
processes drift with the VM's neighbours by more than a kernel change moves. A pass times
`--steps` steps back to back. Prints the median ms a step per build, B / A, and each build's
range over the passes; says whether their outputs' bits are the same.

    .venv/bin/python bench/decode_attention_ab.py --a /tmp/base --b . --seqs 1 --contexts 400 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

import torch  # noqa: E402

import llmserve_kernels.cpu.attention as cpu_attention  # noqa: E402
from bench.decode_attention import add_shape_arguments, make_step  # noqa: E402
from bench.kernel_ab import SLEEP_S  # noqa: E402
from bench.kernel_ab import library as checkout_library  # noqa: E402
from bench.machine import describe  # noqa: E402
from llmserve_kernels.cpu import build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    add_shape_arguments(parser)
    parser.add_argument("--passes", type=int, default=11)
    parser.add_argument("--steps", type=int, default=5, help="steps a pass, timed together")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    args = parser.parse_args()
    libs = [build._declare(checkout_library(path)) for path in (args.a, args.b)]
    torch.set_num_threads(args.threads)
    for lib in libs:
        lib.llmserve_set_num_threads(args.threads)
    print(describe())
    print(f"{args.seqs} sequences, {args.layers} layers, {args.threads} threads, "
          f"median of {args.passes} passes of {args.steps} steps")  # fmt: skip
    print("| context | cache | A, ms | B, ms | B / A | A's range | B's range | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for context in args.contexts:
        for dtype in (getattr(torch, name) for name in args.dtypes):
            step = make_step(args, context, dtype)
            times: list[list[float]] = [[], []]
            outputs = []
            for p in range(args.passes + 1):  # pass 0 warms each build up, untimed
                for k in (0, 1) if p % 2 == 0 else (1, 0):
                    cpu_attention.library = lambda lib=libs[k]: lib  # type: ignore[misc]
                    time.sleep(SLEEP_S)
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        out = step()
                    if p:
                        times[k].append((time.perf_counter() - start) / args.steps * 1e3)
                    else:
                        outputs.append(out.clone())
            a, b = (statistics.median(t) for t in times)
            print(f"| {context} | {str(dtype).removeprefix('torch.')} | {a:.2f} | {b:.2f} "
                  f"| {b / a:.2f} | {min(times[0]):.2f}-{max(times[0]):.2f} "
                  f"| {min(times[1]):.2f}-{max(times[1]):.2f} "
                  f"| {'yes' if torch.equal(*outputs) else 'no'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
