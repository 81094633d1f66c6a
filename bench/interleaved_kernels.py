"""Fast mode's kernel on the file's layout against the interleaved one (issue #52).

For each type (Q4_1, Q4_0, Q8_0) and SmolLM2 weight shape (gate/up, down, LM head), random
blocks from the gguf package's quantizer, copied enough times to reach past the L3 (the LM
head's two copies only partly), so that the bytes come from memory as in a decode step. Each
round times one pass over every copy per layout, best of 3, the layouts' order reversed every
other round; prints the median of the rounds per row count, ms per weight.

    .venv/bin/python bench/interleaved_kernels.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from bench.machine import describe  # noqa: E402
from llmserve_kernels.cpu import quant  # noqa: E402

# name, out features, in features, copies
SHAPES = (("gate/up 576 -> 3072", 3072, 576, 30), ("down 1536 -> 576", 576, 1536, 40),
          ("LM head 576 -> 49152", 49152, 576, 2))  # fmt: skip
TYPES = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)


def pass_ms(weights: list[quant.QuantWeight], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for w in weights:
        quant.linear(x, w.code, w.blocks, "fast")
    return (time.perf_counter() - start) / len(weights) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,4,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(describe())
    print("| type | weight | rows | file layout, ms | interleaved, ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for ggml_type in TYPES:
        for name, out_features, in_features, copies in SHAPES:
            dense = torch.randn(out_features, in_features) * 0.05
            blocks = torch.from_numpy(quantize(dense.numpy(), ggml_type))
            layouts = {"file": [quant.QuantWeight(int(ggml_type), blocks.clone(), in_features)
                                for _ in range(copies)]}  # fmt: skip
            layouts["interleaved"] = [quant.interleave(w) or w for w in layouts["file"]]
            for rows in (int(n) for n in args.rows.split(",")):
                x = torch.randn(rows, in_features)
                times: dict[str, list[float]] = {key: [] for key in layouts}
                for r in range(args.rounds):
                    for key in sorted(layouts, reverse=r % 2 == 1):
                        times[key].append(min(pass_ms(layouts[key], x) for _ in range(3)))
                file, inter = (statistics.median(times[k]) for k in ("file", "interleaved"))
                print(f"| {ggml_type.name} | {name} | {rows} | {file:.3f} | {inter:.3f} "
                      f"| {file / inter:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
