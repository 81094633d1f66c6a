"""Benchmark the Triton paged-attention kernels on CUDA.

For each (batch, context, heads, block size) it times the kernel, reports achieved memory
bandwidth (the bytes the kernel must move: the K/V context, the queries and the output), the
percentage of the device's peak bandwidth, and the speed-up over the torch reference
(llmserve_kernels.reference) and over `scaled_dot_product_attention` on an equivalent contiguous
cache. Prints a markdown table (append it to bench/RESULTS.md). Without CUDA it says so and exits 0.

Decode times are device times: the calls are captured in a CUDA graph and replayed, so the
host's launch cost is left out, and a graph cycles through enough copies of the inputs
(at least 256 MB of K/V in all) that small shapes are read from HBM, not from the 50 MB L2.
The host's cost per call is reported beside them: the checked wrapper
(`paged_attention_decode`, which plans and launches) and a layer's launch from a plan made
once per step (`DecodePlan.run`, what the worker does), each called in a loop without
synchronizing at batch 1 (the device finishes each call before the next launch, so the loop
runs at the host's pace).

    python bench/triton_kernels.py [--dtype bf16] [--quick] [--peak-gbps 3350]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Run as a script, this file's folder comes first on sys.path: put the repository root, where
# the packages are, there instead.
_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Peak HBM bandwidth in GB/s by device-name fragment, when the driver does not report it.
KNOWN_PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
}


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


def peak_gbps(override: float | None) -> float | None:
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    for fragment, gbps in KNOWN_PEAK_GBPS.items():
        if fragment in props.name:
            return gbps
    return None


def time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


# Bytes of K/V that one timed graph reads, at least (copies of small inputs; see the docstring).
MIN_GRAPH_KV_BYTES = 256 << 20
MAX_COPIES = 64


def device_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median device time of one call: `calls` captured in one graph, replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def host_us(fn: Callable[[], object], n: int = 1000) -> float:
    """Host time per call, `fn` called `n` times back to back without synchronizing."""
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def make_decode_inputs(shape: Shape, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    blocks_per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return dict(
        query=torch.randn(shape.batch, shape.num_heads, shape.head_dim, dtype=dtype, device="cuda"),
        key_cache=torch.randn(cache_shape, dtype=dtype, device="cuda"),
        value_cache=torch.randn(cache_shape, dtype=dtype, device="cuda"),
        # Shuffled so that a sequence's blocks are scattered as in a real cache.
        block_tables=torch.randperm(num_blocks, device="cuda")
        .view(shape.batch, blocks_per_seq)
        .int(),
        seq_lens=torch.full((shape.batch,), shape.context, dtype=torch.int32, device="cuda"),
    )


def contiguous_kv(inputs: dict[str, torch.Tensor], shape: Shape) -> tuple[torch.Tensor, ...]:
    """The same context as [batch, num_kv_heads, context, head_dim] tensors, for SDPA."""
    out = []
    for name in ("key_cache", "value_cache"):
        blocks = inputs[name][inputs["block_tables"].long()]  # [batch, blocks, bs, kvh, d]
        seq = blocks.flatten(1, 2)[:, : shape.context]  # [batch, context, kvh, d]
        out.append(seq.transpose(1, 2).contiguous())
    return tuple(out)


def bench_decode(shape: Shape, dtype: torch.dtype, peak: float | None, with_ref: bool) -> str:
    import llmserve_kernels
    from llmserve_kernels import reference
    from llmserve_kernels.paged_attention import DecodePlan

    element = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * shape.batch * shape.context * shape.num_kv_heads * shape.head_dim * element
    io_bytes = 2 * shape.batch * shape.num_heads * shape.head_dim * element
    copies = max(1, min(MAX_COPIES, -(-MIN_GRAPH_KV_BYTES // kv_bytes)))
    sets = [make_decode_inputs(shape, dtype) for _ in range(copies)]
    scale = shape.head_dim**-0.5
    outs = [torch.empty_like(x["query"]) for x in sets]

    def call(x: dict[str, torch.Tensor], out: torch.Tensor) -> Callable[[], object]:
        args = (*x.values(), scale)
        return lambda: llmserve_kernels.paged_attention_decode(
            *args, out=out, max_seq_len=shape.context
        )

    triton_us = device_us([call(x, out) for x, out in zip(sets, outs, strict=True)])
    inputs, out = sets[0], outs[0]
    args = (*inputs.values(), scale)
    key, value = contiguous_kv(inputs, shape)
    query = inputs["query"].unsqueeze(2)  # [batch, num_heads, 1, head_dim]
    sdpa_us = device_us(
        [lambda: F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=True)]
    )
    ref_us = time_ms(lambda: reference.paged_attention_decode(*args)) * 1e3 if with_ref else None
    host = "-"
    if shape.batch == 1:
        plan = DecodePlan(
            inputs["block_tables"], inputs["seq_lens"], num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            block_size=shape.block_size, dtype=dtype, scale=scale, max_seq_len=shape.context,
        )  # fmt: skip
        cache = (inputs["key_cache"], inputs["value_cache"])
        wrapper = host_us(call(inputs, out))
        planned = host_us(lambda: plan.run(inputs["query"], *cache, out))
        host = f"{wrapper:.0f} / {planned:.0f}"

    gbps = (kv_bytes + io_bytes) / (triton_us * 1e-6) / 1e9
    pct = f"{100 * gbps / peak:.0f}%" if peak else "n/a"
    ref = f"{ref_us / triton_us:.1f}x" if ref_us is not None else "-"
    return (
        f"| decode | {shape.batch} | {shape.context} | {shape.num_heads}/{shape.num_kv_heads} "
        f"| {shape.block_size} | {triton_us:.1f} | {gbps:.0f} | {pct} | {host} | {ref} "
        f"| {sdpa_us / triton_us:.2f}x |"
    )


def bench_prefill(shape: Shape, dtype: torch.dtype, with_ref: bool) -> str:
    """A batch of `batch` chunks of 512 new tokens after a cached prefix of `context - 512`."""
    import llmserve_kernels
    from llmserve_kernels import reference

    chunk = min(512, shape.context)
    inputs = make_decode_inputs(shape, dtype)
    query = torch.randn(
        shape.batch * chunk, shape.num_heads, shape.head_dim, dtype=dtype, device="cuda"
    )
    starts = torch.arange(shape.batch + 1, dtype=torch.int32, device="cuda") * chunk
    scale = shape.head_dim**-0.5
    args = (
        query,
        inputs["key_cache"],
        inputs["value_cache"],
        inputs["block_tables"],
        starts,
        inputs["seq_lens"],
        scale,
    )
    triton_ms = time_ms(lambda: llmserve_kernels.prefill_attention(*args, max_query_len=chunk))
    key, value = contiguous_kv(inputs, shape)
    q = query.view(shape.batch, chunk, shape.num_heads, shape.head_dim).transpose(1, 2)
    prefix = shape.context - chunk
    mask = torch.ones(chunk, shape.context, dtype=torch.bool, device="cuda").tril(prefix)
    sdpa_ms = time_ms(
        lambda: F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
    )
    ref_ms = time_ms(lambda: reference.prefill_attention(*args)) if with_ref else None
    # Causal FLOPs: QK^T and PV over the visible keys of each new token.
    visible = shape.batch * (chunk * prefix + chunk * (chunk + 1) / 2)
    tflops = 4 * visible * shape.num_heads * shape.head_dim / (triton_ms * 1e-3) / 1e12
    ref = f"{ref_ms / triton_ms:.1f}x" if ref_ms is not None else "-"
    return (
        f"| prefill | {shape.batch}x{chunk} | {shape.context} "
        f"| {shape.num_heads}/{shape.num_kv_heads} | {shape.block_size} "
        f"| {triton_ms * 1e3:.1f} | {tflops:.1f} TFLOP/s | - | - | {ref} "
        f"| {sdpa_ms / triton_ms:.2f}x |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--peak-gbps", type=float, default=None, help="device peak bandwidth")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip timing the slow torch reference"
    )
    options = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench/triton_kernels.py: no CUDA device; the Triton kernels are benchmarked on GPUs only."
        )
        return 0

    dtype = DTYPES[options.dtype]
    peak = peak_gbps(options.peak_gbps)
    name = torch.cuda.get_device_name(0)
    print(f"## Kernels on {name} ({options.dtype}, peak {peak or 'unknown'} GB/s)\n")
    print(
        "| kernel | batch | context | heads q/kv | block | time us | achieved | % peak "
        "| host us: call / planned | vs reference | vs SDPA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    batches = [1, 64] if options.quick else [1, 8, 64, 128]
    contexts = [2048] if options.quick else [512, 2048, 8192]
    heads = [(32, 8)] if options.quick else [(32, 8), (32, 32), (16, 2)]
    block_sizes = [16] if options.quick else [8, 16, 32]
    for batch, context, (num_heads, num_kv_heads), block_size in itertools.product(
        batches, contexts, heads, block_sizes
    ):
        shape = Shape(batch, context, num_heads, num_kv_heads, 128, block_size)
        if batch * context * num_kv_heads * 128 * 2 * 2 > 8 * 2**30:
            continue  # keep the cache under 8 GiB
        with_ref = not options.no_reference and batch * context <= 64 * 2048
        print(bench_decode(shape, dtype, peak, with_ref), flush=True)
    for batch, context in itertools.product([1, 8], [512, 4096]):
        shape = Shape(batch, context, 32, 8, 128, 16)
        print(bench_prefill(shape, dtype, not options.no_reference), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
