"""A GGUF-block kernel in two builds (two checkouts), in one process (issue #52): fast mode's
interleaved one, or exact mode's on the file's layout (`--mode exact`).

Runs in separate processes drift with the VM's neighbours by more than a kernel change moves
(bench/RESULTS.md, "16-bit pair sums on AVX2"), so both builds' libraries are loaded here and
called in turn on the same weights, the order reversed every other pass, each thread pool
left to fall asleep before the other's pass. Shapes and copies are
bench/interleaved_kernels.py's (past the L3, as in a decode step). Checks that both builds
give the same bits; prints the median ms per weight and each build's range.

    .venv/bin/python bench/kernel_ab.py --a /tmp/headwt --b . --types Q4_0 Q8_0
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from bench.interleaved_kernels import SHAPES  # noqa: E402
from bench.machine import describe  # noqa: E402
from llmserve_kernels.cpu import quant  # noqa: E402
from tests.kernels.test_quant_linear import K_QUANTS, quantized  # noqa: E402

KERNELS = {"fast": "llmserve_quant_linear_interleaved", "exact": "llmserve_quant_linear"}
SLEEP_S = 0.003  # longer than a pool's helpers spin before they sleep (pool.h)


def library(checkout: Path) -> ctypes.CDLL:
    """The checkout's kernel library, built by its own build.py."""
    code = "from llmserve_kernels.cpu import build; print(build._build())"
    path = subprocess.run(
        [sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=True
    ).stdout.strip()
    lib = ctypes.CDLL(path)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for kernel in KERNELS.values():  # (type, x, rows, in, blocks, out_features, out)
        getattr(lib, kernel).argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
        getattr(lib, kernel).restype = ctypes.c_int
    return lib


def blocks_of(ggml_type: GGMLQuantizationType, out_features: int, in_features: int):
    if ggml_type in K_QUANTS:  # the gguf package cannot quantize these: the tests' blocks
        return torch.from_numpy(quantized(ggml_type, out_features, in_features, seed=1))
    dense = torch.randn(out_features, in_features) * 0.05
    return torch.from_numpy(quantize(dense.numpy(), ggml_type))


def interleaved(weight: quant.QuantWeight) -> quant.QuantWeight:
    layout = quant.interleave(weight)
    if layout is None:
        raise SystemExit(f"type {weight.ggml_type}: no interleaved layout")
    return layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_1", "Q8_0"])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--passes", type=int, default=11)
    parser.add_argument("--mode", choices=sorted(KERNELS), default="fast")
    args = parser.parse_args()
    libs = [library(args.a), library(args.b)]
    torch.manual_seed(0)
    print(describe())
    print("| type | weight | rows | A, ms | B, ms | B / A | A's range | B's range |")
    print("|---|---|---|---|---|---|---|---|")
    for ggml_type in (GGMLQuantizationType[name] for name in args.types):
        for name, out_features, in_features, copies in SHAPES:
            if ggml_type in K_QUANTS:
                in_features = -(-in_features // 256) * 256  # whole super-blocks
            blocks = blocks_of(ggml_type, out_features, in_features)
            weights = [quant.QuantWeight(int(ggml_type), blocks.clone(), in_features)
                       for _ in range(copies)]  # fmt: skip
            if args.mode == "fast":
                weights = [interleaved(w) for w in weights]
            for rows in (int(n) for n in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                out = torch.empty(rows, out_features)
                times: list[list[float]] = [[], []]
                results = []
                for p in range(args.passes):
                    for k in (0, 1) if p % 2 == 0 else (1, 0):
                        kernel = getattr(libs[k], KERNELS[args.mode])
                        time.sleep(SLEEP_S)
                        start = time.perf_counter()
                        for w in weights:
                            assert not kernel(int(ggml_type), x.data_ptr(), rows, in_features,
                                              w.blocks.data_ptr(), out_features, out.data_ptr())  # fmt: skip
                        times[k].append((time.perf_counter() - start) / copies * 1e3)
                        if p == 0:
                            results.append(out.clone())
                if not torch.equal(results[0], results[1]):
                    raise SystemExit(f"{ggml_type.name} {name} {rows} rows: the builds differ")
                a, b = (statistics.median(t) for t in times)
                print(f"| {ggml_type.name} | {name} | {rows} | {a:.3f} | {b:.3f} | {b / a:.2f} "
                      f"| {min(times[0]):.3f}-{max(times[0]):.3f} "
                      f"| {min(times[1]):.3f}-{max(times[1]):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
