"""A decode step's paged attention on the CPU kernels, per K/V cache dtype (issue #52).

`--seqs` sequences of `--context` cached tokens each, one query token per sequence, through
every layer (`--layers` calls of `llmserve_kernels.cpu.paged_attention_decode`, each layer's blocks
shuffled through one cache): float32 caches with float32 queries, as a float32 model's
worker keeps them (`--kv-cache-dtype model`), against bfloat16 caches with the queries
rounded to bfloat16, as fast mode's default does (`worker_service/attention/base.py`,
`llmserve_kernels/cpu/decode.cpp`). Best of `--repeats` steps; the K/V bytes a step reads per second
and the multiply-adds' rate. SmolLM2-135M's shape by default (9 heads, 3 kv heads of 64).

    .venv/bin/python bench/decode_attention.py --seqs 16 --contexts 128 300 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

import torch  # noqa: E402

from bench.machine import describe  # noqa: E402
from llmserve_kernels.cpu import paged_attention_decode  # noqa: E402
from llmserve_kernels.cpu.pool import set_num_threads  # noqa: E402


def make_step(
    args: argparse.Namespace, context: int, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """A decode step's attention over every layer: `args.seqs` sequences of `context` tokens,
    each layer's blocks shuffled through one cache. Returns the last layer's output."""
    gen = torch.Generator().manual_seed(context)
    block, layers, seqs = args.block_size, args.layers, args.seqs
    per_seq = -(-context // block)
    num_blocks = seqs * per_seq * layers + 1
    shape = (num_blocks, block, args.kv_heads, args.head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = [
        order[i * seqs * per_seq : (i + 1) * seqs * per_seq].view(seqs, per_seq).int()
        for i in range(layers)
    ]
    query = torch.randn(seqs, args.heads, args.head_dim, generator=gen).to(dtype)
    out = torch.empty_like(query)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    scale = args.head_dim**-0.5

    def step() -> torch.Tensor:
        for table in tables:
            paged_attention_decode(
                query,
                key_cache,
                value_cache,
                table,
                lens,
                scale,
                out=out,
                check=False,
                sliding_window=args.window or None,
            )
        return out

    return step


def step_seconds(args: argparse.Namespace, context: int, dtype: torch.dtype) -> float:
    """The best of `args.repeats` steps over every layer, in seconds."""
    step = make_step(args, context, dtype)
    step()
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The step's shape: SmolLM2-135M's by default."""
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 300, 512])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--window", type=int, default=0, help="sliding window, 0 for none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    print(describe())
    print(
        f"{args.seqs} sequences, {args.layers} layers, {args.threads} threads, best of "
        f"{args.repeats}"
    )
    print("| context | cache | ms a step | K/V GB/s | GMAC/s |")
    print("|---|---|---|---|---|")
    for context in args.contexts:
        for dtype in (torch.float32, torch.bfloat16):
            seconds = step_seconds(args, context, dtype)
            elements = args.seqs * context * args.kv_heads * args.head_dim * args.layers
            kv_bytes = 2 * elements * torch.empty((), dtype=dtype).element_size()
            macs = 2 * args.seqs * args.heads * context * args.head_dim * args.layers
            print(
                f"| {context} | {str(dtype).removeprefix('torch.')} | {seconds * 1e3:.2f} | "
                f"{kv_bytes / seconds / 1e9:.1f} | {macs / seconds / 1e9:.1f} |"
            )


if __name__ == "__main__":
    main()
