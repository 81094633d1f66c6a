"""Decode step time on CPU per family: the per-layer path vs the native step (decode.cpp).

For each model (every family's tiny test model from tests/support/models.py, and real
models given with `--model`, e.g. gemma3-270m) a `Worker` is loaded on the `cpu` backend and
the model's decode forward is timed over `--context` cached tokens per sequence (random
keys and values), at each batch size: once through the native step and once with it switched
off (`DecoderModel.native_decode = None`: the per-layer path, same weights, same caches).
Times are medians of `--iters` steps. Models with experts have no native step: for them the
table gives the share of the per-layer step spent in the expert MLP (`moe_mlp`) instead.
Prints a markdown table; `--out` writes the JSON.

    python bench/native_decode.py --model gemma3-270m --batches 1,16 --context 256
    python bench/native_decode.py --model smollm2 --no-tiny --linear-impl gguf --quant-mode fast
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before torch loads libgomp: its OpenMP threads sleep when a parallel region ends, as they do
# in the served worker (`llmserve worker`, llmserve/cli.py), instead of spinning on the cores
# the kernels' pool needs between the per-layer path's torch ops.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

from bench.decode_graphs import decode_inputs  # noqa: E402
from llmserve_kernels.cpu import build  # noqa: E402
from tests.support.models import FAMILY_KINDS, save_tiny_model  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.models import decoder  # noqa: E402
from worker_service.worker import Worker  # noqa: E402


def median_ms(fn: Any, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class ExpertTimer:
    """Wraps the decoder's `moe_mlp` to add up the time spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = decoder.moe_mlp

    def __call__(self, *args: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = self._inner(*args)
        self.seconds += time.perf_counter() - start
        return out


def measure(name: str, model_path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    batches = [int(b) for b in args.batches.split(",")]
    worker = Worker(
        WorkerConfig(
            model=model_path,
            dtype=args.dtype,
            attention_backend="cpu",
            num_threads=args.threads,
            max_num_seqs=max(batches),
            # Every batch through the native step (past the worker's default limit too).
            native_decode_max_batch=max(batches),
            linear_impl=args.linear_impl,
            quant_mode=args.quant_mode,
        )
    )
    worker.load_model()
    bs = worker.config.block_size
    worker.initialize_cache(max(batches) * -(-(args.context + max(batches)) // bs), 0)
    for key, value in worker._kv_caches:
        key.normal_(0.0, 0.5)
        value.normal_(0.0, 0.5)
    runner, model = worker.runner, worker.model
    native = model.native_decode
    rows = []
    for n in batches:
        _, positions, metadata, logit_rows = decode_inputs(
            n, args.context, bs, worker.device, one_sequence=args.one_sequence
        )
        input_ids = torch.randint(0, model.arch.vocab_size, (n,))
        inputs = (input_ids, positions, worker._kv_caches, metadata, runner.backend, logit_rows)

        def step(inputs: tuple[Any, ...] = inputs) -> torch.Tensor:
            return model.forward(*inputs)

        row: dict[str, Any] = dict(model=name, batch=n)
        model.native_decode = None
        timer = ExpertTimer()
        decoder.moe_mlp = timer  # type: ignore[assignment]
        try:
            reference = step().float()
            timer.seconds = 0.0
            row["per_layer_ms"] = median_ms(step, args.iters)
        finally:
            decoder.moe_mlp = timer._inner
        model.native_decode = native
        if native is None:
            row["refused"] = model.native_decode_refused
            row["expert_share"] = timer.seconds * 1e3 / (args.iters + 1) / row["per_layer_ms"]
        else:
            row["max_abs_logit_diff"] = (step().float() - reference).abs().max().item()
            row["native_ms"] = median_ms(step, args.iters)
            row["ratio"] = row["native_ms"] / row["per_layer_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=[], help="a real model (repeatable)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny family models")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linear-impl", default="auto", help="the worker's --linear-impl")
    parser.add_argument("--quant-mode", default="exact", help="with --linear-impl gguf")
    parser.add_argument(
        "--one-sequence",
        action="store_true",
        help="a batch of n is one sequence's last token and n - 1 drafts (speculation)",
    )
    parser.add_argument(
        "--no-matrix-engine",
        action="store_true",
        help="without AMX tiles (llmserve_kernels/cpu/amx.h): fast mode's linear layers and prompt "
        "attention",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = build.set_matrix_engine(not args.no_matrix_engine)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        kinds = [] if args.no_tiny else list(FAMILY_KINDS)
        for kind in kinds:
            path = save_tiny_model(kind, Path(scratch) / kind, max_position_embeddings=1024)
            rows += measure(f"tiny {kind}", str(path), args)
    for spec in args.model:
        rows += measure(spec, spec, args)
    print(
        f"{args.dtype}, linear {args.linear_impl} ({args.quant_mode}), context {args.context}"
        f"{' (batch n: one sequence with n - 1 drafts)' if args.one_sequence else ''}, "
        f"{args.threads} threads, medians of {args.iters}, matrix engine {'on' if engine else 'off'}"
    )
    print("| model | batch | per-layer ms | native ms | native / per-layer | max logit diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "native_ms" in r:
            print(
                f"| {r['model']} | {r['batch']} | {r['per_layer_ms']:.2f} | {r['native_ms']:.2f}"
                f" | {r['ratio']:.2f} | {r['max_abs_logit_diff']:.2g} |"
            )
        else:
            print(
                f"| {r['model']} | {r['batch']} | {r['per_layer_ms']:.2f} | per layer "
                f"(experts: {r['expert_share']:.0%} of the step) | | |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
