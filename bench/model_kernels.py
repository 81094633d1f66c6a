"""Fast mode's kernel time per kind of tensor in a GGUF model, interleaved as the worker does.

Every quantized tensor of the file is grouped by (type, name: attn_q, ffn_down, ..., the
embedding), interleaved where this build interleaves it (as `install_blocks` does in fast
mode; each tensor on its own, where the worker fuses q/k/v and gate/up), and each group is
multiplied in turn by random activations of 1 and 16 rows: best of `--repeats` passes, ms
for the whole group, and the bytes per second it read. Small kinds sit
partly in the L3 between passes. Prints a markdown table and the sum over all groups for one
row. Run it in another checkout to compare kernels (bench/RESULTS.md says which).

    .venv/bin/python bench/model_kernels.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from bench.machine import describe  # noqa: E402
from llmserve.gguf_files import open_gguf  # noqa: E402
from llmserve.model_spec import resolve_model  # noqa: E402
from llmserve_kernels.cpu import quant  # noqa: E402


def groups(model: str) -> dict[tuple[str, str], list[quant.QuantWeight]]:
    source = resolve_model(model)
    assert source.gguf_file is not None, f"{model} is not a GGUF file"
    kinds: dict[tuple[str, str], list[quant.QuantWeight]] = {}
    for tensor in open_gguf(Path(source.path) / source.gguf_file).tensors:
        ggml_type = GGMLQuantizationType(int(tensor.tensor_type))
        if quant.block_bytes(ggml_type) == 0:
            continue
        in_features, out_features = (int(d) for d in tensor.shape)
        rows = torch.from_numpy(np.array(tensor.data).reshape(out_features, -1))
        weight = quant.QuantWeight(int(ggml_type), rows, in_features)
        name = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name
        kinds.setdefault((ggml_type.name, name), []).append(quant.interleave(weight) or weight)
    return kinds


def best_ms(weights: list[quant.QuantWeight], x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            quant.linear(x, w.code, w.blocks, "fast")
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    counts = [int(n) for n in args.rows.split(",")]
    print(describe())
    print(
        "| type | tensor | count | interleaved | "
        + " | ".join(f"{n} rows, ms (GB/s)" for n in counts)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(counts))
    one_row = 0.0
    for (type_name, name), weights in sorted(groups(args.model).items()):
        nbytes = sum(w.nbytes for w in weights)
        cells = []
        for n in counts:
            ms = best_ms(weights, torch.randn(n, weights[0].shape[1]), args.repeats)
            one_row += ms if n == 1 else 0.0
            cells.append(f"{ms:.3f} ({nbytes / ms / 1e6:.1f})")
        print(
            f"| {type_name} | {name} | {len(weights)} | {weights[0].interleaved} | "
            + " | ".join(cells)
            + " |"
        )
    if 1 in counts:
        print(f"\nsum over every tensor, 1 row: {one_row:.2f} ms")


if __name__ == "__main__":
    main()
