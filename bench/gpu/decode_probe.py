"""Where a decode-attention call's time goes on CUDA, and which launch configuration is fastest.

1. Host cost per call (batch 1, context 512): the wrapper `paged_attention_decode` called in a
   loop without synchronizing (host-bound: the device finishes each call before the next is
   launched), the same with the split-K reduction forced off, and torch.empty alone.
2. Device time of the same call, replayed from a CUDA graph of 20 calls (no host cost).
3. A sweep of tile tokens x warps x pipeline stages x partition size for the shapes the issue
   names as weak, device time from CUDA-graph replays (`triton.testing.do_bench_cudagraph`),
   each variant checked against the torch reference first.

    PYTHONPATH=$PWD python3 bench/gpu/decode_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

from llmserve_kernels import reference  # noqa: E402
from llmserve_kernels.paged_attention import DecodeLaunchConfig, paged_attention_decode  # noqa: E402

# (batch, context, heads, kv heads, block size)
SWEEP_SHAPES = [
    (128, 2048, 16, 2, 16),
    (128, 512, 16, 2, 16),
    (64, 2048, 16, 2, 16),
    (8, 8192, 32, 8, 16),
    (8, 2048, 32, 32, 16),
    (1, 512, 32, 8, 16),
    (64, 512, 32, 8, 16),
]


def inputs(batch: int, context: int, heads: int, kv: int, bs: int) -> dict[str, torch.Tensor]:
    blocks = -(-context // bs)
    n = batch * blocks
    shape = (n, bs, kv, 128)
    return dict(
        query=torch.randn(batch, heads, 128, dtype=torch.bfloat16, device="cuda"),
        key_cache=torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
        value_cache=torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
        block_tables=torch.randperm(n, device="cuda").view(batch, blocks).int(),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
    )


def host_us(fn: Any, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / n * 1e6


def graph_us(fn: Any, calls: int = 20, reps: int = 50) -> float:
    """Device time per call: a graph of `calls` calls, replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * reps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}

    x = inputs(1, 512, 32, 8, 16)
    scale = 128**-0.5
    out = torch.empty_like(x["query"])
    call_args = (*x.values(), scale)

    def wrapper() -> None:
        paged_attention_decode(*call_args, out=out, max_seq_len=512)

    def single_pass() -> None:
        paged_attention_decode(*call_args, out=out, max_seq_len=512, partition_size=512)

    def empty() -> None:
        torch.empty((1, 32, 4, 128), dtype=torch.float32, device="cuda")

    host = {
        "wrapper_split": host_us(wrapper),
        "wrapper_single_pass": host_us(single_pass),
        "torch_empty": host_us(empty),
    }
    device = {"wrapper_split": graph_us(wrapper), "wrapper_single_pass": graph_us(single_pass)}
    result["batch1_ctx512_host_us"] = host
    result["batch1_ctx512_device_us"] = device
    print("batch 1, context 512, 32/8: host us per call", host, "device us", device, flush=True)

    sweep = []
    shapes = SWEEP_SHAPES[:2] if args.quick else SWEEP_SHAPES
    for batch, context, heads, kv, bs in shapes:
        x = inputs(batch, context, heads, kv, bs)
        out = torch.empty_like(x["query"])
        call_args = (*x.values(), scale)
        want = reference.paged_attention_decode(*call_args).float()
        kv_bytes = 2 * batch * context * kv * 128 * 2
        rows = []
        for tile, warps, stages, part in itertools.product(
            (32, 64, 128), (2, 4, 8), (None, 4), (None,)
        ):
            launch = DecodeLaunchConfig(tile, warps, stages)

            def call(
                launch: DecodeLaunchConfig = launch,
                part: int | None = part,
                call_args: tuple[Any, ...] = call_args,
                out: torch.Tensor = out,
                context: int = context,
            ) -> None:
                paged_attention_decode(
                    *call_args, out=out, max_seq_len=context, partition_size=part, launch=launch
                )

            try:
                out.fill_(float("nan"))
                call()
                err = ((out.float() - want).norm() / want.norm()).item()
                if not err < 1e-2:
                    rows.append(dict(tile=tile, warps=warps, stages=stages, part=part, err=err))
                    continue
                us = graph_us(call, calls=5, reps=20)
            except Exception as exc:  # a configuration Triton cannot compile
                rows.append(
                    dict(tile=tile, warps=warps, stages=stages, part=part, error=str(exc)[:200])
                )
                continue
            rows.append(
                dict(
                    tile=tile,
                    warps=warps,
                    stages=stages,
                    part=part,
                    us=us,
                    gbps=kv_bytes / us / 1e3,
                    err=err,
                )
            )
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        default = next(
            (
                r
                for r in ok
                if (r["tile"], r["warps"], r["stages"], r["part"]) == (64, 4, None, None)
            ),
            None,
        )
        sweep.append(
            dict(
                shape=[batch, context, heads, kv, bs],
                kv_mb=kv_bytes / 1e6,
                rows=rows,
                best=best,
                default=default,
            )
        )
        print(
            f"{batch}x{context} {heads}/{kv} bs{bs} ({kv_bytes / 1e6:.0f} MB): default {default and round(default['us'], 1)} us "
            f"({default and round(default['gbps'])} GB/s), best {best}",
            flush=True,
        )
    result["sweep"] = sweep
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
