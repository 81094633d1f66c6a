"""Decode step time per batch size on CUDA: eager forward vs the captured CUDA graph.

Loads a model into a `Worker` (CUDA, graphs captured up to the largest batch), then for each
batch size times the model's decode forward over `--context` cached tokens per sequence:
eagerly (`LlamaModel.forward`, one launch per op) and through `DecodeGraphs.run` (inputs
copied into the static buffers, then one replay of the padded size). Times are medians of
`--iters` steps, each synchronized (host clock around the step, device idle at the start):
what a step costs the worker, its input building and sampling left out. Prints a markdown
table; `--out` writes the JSON.

    python bench/decode_graphs.py --dtype bfloat16 --context 512 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

from worker_service.attention.base import AttentionMetadata  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.worker import Worker  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def decode_inputs(
    n: int, context: int, block_size: int, device: torch.device, one_sequence: bool = False
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A decode step of `n` sequences, each at position `context` (context + 1 tokens with
    the new one), on disjoint blocks; with `one_sequence`, the rows of one sequence with
    n - 1 drafts instead: positions context .. context + n - 1 on one block table."""
    if one_sequence:
        blocks = -(-(context + n) // block_size)
        tables = torch.arange(blocks, dtype=torch.int32, device=device).expand(n, blocks)
        positions = torch.arange(context, context + n, dtype=torch.int64, device=device)
    else:
        blocks = -(-(context + 1) // block_size)
        tables = torch.arange(n * blocks, dtype=torch.int32, device=device).view(n, blocks)
        positions = torch.full((n,), context, dtype=torch.int64, device=device)
    tables = tables.contiguous()
    slots = tables[torch.arange(n), positions // block_size].long() * block_size + (
        positions % block_size
    )
    seq_lens = (positions + 1).to(torch.int32)
    metadata = AttentionMetadata.for_decodes(
        slot_mapping=slots,
        seq_lens=seq_lens,
        block_tables=tables,
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
    )
    input_ids = torch.randint(0, 1000, (n,), device=device)
    return input_ids, positions, metadata, torch.arange(n, device=device)


def median_ms(fn: Any, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    worker = Worker(
        WorkerConfig(
            model=args.model,
            dtype=args.dtype,
            device="cuda",
            max_num_seqs=max(batches),
            max_model_len=args.max_model_len,
        )
    )
    worker.load_model()
    bs = worker.config.block_size
    blocks = max(batches) * -(-(args.context + 1) // bs)
    start = time.perf_counter()
    worker.initialize_cache(blocks, 0)
    capture_s = time.perf_counter() - start
    runner, model = worker.runner, worker.model
    graphs = runner.decode_graphs
    assert graphs is not None
    rows = []
    for n in batches:
        inputs = decode_inputs(n, args.context, bs, worker.device)

        def eager(inputs: Any = inputs) -> torch.Tensor:
            input_ids, positions, metadata, logit_rows = inputs
            return model.forward(
                input_ids, positions, worker._kv_caches, metadata, runner.backend, logit_rows
            )

        def graph(inputs: Any = inputs) -> torch.Tensor:
            out = graphs.run(*inputs)
            assert out is not None
            return out

        diff = (eager().float() - graph().float()).abs().max().item()
        eager_ms, graph_ms = median_ms(eager, args.iters), median_ms(graph, args.iters)
        rows.append(
            dict(
                batch=n,
                padded=graphs.padded_size(n),
                eager_ms=eager_ms,
                graph_ms=graph_ms,
                speedup=eager_ms / graph_ms,
                max_abs_logit_diff=diff,
            )
        )
    result = dict(
        device=torch.cuda.get_device_name(0),
        torch=torch.__version__,
        model=args.model,
        dtype=args.dtype,
        context=args.context,
        capture_sizes=graphs.sizes,
        capture_seconds=capture_s,
        rows=rows,
    )
    print(
        f"{result['device']}, {args.model} {args.dtype}, context {args.context}, "
        f"{len(graphs.sizes)} graphs captured in {capture_s:.1f} s"
    )
    print("| batch | padded to | eager ms | graph ms | eager / graph | max logit diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['padded']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
            f"{r['speedup']:.2f}x | {r['max_abs_logit_diff']:.2g} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
