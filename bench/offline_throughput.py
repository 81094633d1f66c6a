"""Offline throughput: scheduler + worker in one process vs HF `generate` with static batches.

Workload: a fixed seeded list of requests with varied prompt and output lengths (random token
ids, EOS ignored). The engine runs them all with continuous batching; HF runs them in arrival
order in static left-padded batches (best of the given batch sizes), counting only useful
tokens (a request's tokens past its own max_tokens do not count). Also measures decode
efficiency: one decode step at batch 64 against the model's linear layers alone on the same
shapes.

    .venv/bin/python bench/offline_throughput.py --dtype float32 --dtype bfloat16
    .venv/bin/python bench/offline_throughput.py --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from serve_compare import dense_linear_impl

from llmserve.batch_limits import BatchLimits
from llmserve.model_spec import resolve_model
from llmserve.sampling_params import SamplingParams
from llmserve.steps import CachedSequence, NewSequence, StepInput
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.offline import generate
from worker_service.config import WorkerConfig
from worker_service.models.held_weights import linear_layers_only
from worker_service.worker import Worker


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int


def make_workload(
    n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))],
            rng.randint(*out_range),
        )
        for _ in range(n)
    ]


def run_engine(
    worker: Worker, workload: list[Request], max_num_seqs: int, budget: int
) -> tuple[float, int]:
    # The engine's batch limits size the worker's profile run and CUDA graphs.
    gpu, cpu = worker.use_batch_limits(BatchLimits(max_num_seqs, budget))
    worker.initialize_cache(gpu, min(cpu, 256))
    engine = LLMEngine(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=2048
        ),
        CacheConfig(worker.config.block_size, gpu, min(cpu, 256), enable_prefix_caching=False),
        worker,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload
    ]
    start = time.perf_counter()
    outputs = generate(engine, [r.prompt for r in workload], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(r.max_tokens for r in workload)
    return elapsed, tokens


def run_hf(hf: Any, workload: list[Request], batch_size: int) -> tuple[float, int]:
    start, useful = time.perf_counter(), 0
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(r.max_tokens for r in batch)
    return time.perf_counter() - start, useful


def decode_efficiency(
    worker: Worker, batch: int, context: int, repeats: int = 9
) -> tuple[float, float]:
    """(median decode step ms, median linear-layers-only ms) at `batch` sequences of `context`.

    Steps and linear-only passes alternate, so that a slow stretch of this shared machine
    slows both sides of the ratio alike.
    """
    bs = worker.config.block_size
    per_seq = -(-(context + repeats + 2) // bs)
    worker.initialize_cache(batch * per_seq, 0)
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=repeats + 2, ignore_eos=True)
    last: dict[int, int] = {}
    for first in range(0, batch, 8):  # prefill in slices to bound memory
        news = [
            NewSequence(
                i,
                f"d{i}",
                0,
                [rng.randrange(100, 40000) for _ in range(context)],
                context,
                0,
                list(range(i * per_seq, (i + 1) * per_seq)),
                context,
                greedy,
            )
            for i in range(first, min(first + 8, batch))
        ]
        last.update(
            {
                o.seq_id: o.samples[0].token_id
                for o in worker.execute(StepInput(0, new_seqs=news)).outputs
            }
        )
    step_ms, linear_ms = [], []
    for _ in range(repeats + 1):
        cached = [CachedSequence(i, [last[i]], per_seq, [], 1) for i in range(batch)]
        t = time.perf_counter()
        out = worker.execute(StepInput(1, cached_seqs=cached))
        step_ms.append((time.perf_counter() - t) * 1e3)
        last = {o.seq_id: o.samples[0].token_id for o in out.outputs}
        with torch.inference_mode():
            t = time.perf_counter()
            linear_layers_only(worker.model, batch)
            linear_ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(step_ms[1:]), statistics.median(linear_ms[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quick", action="store_true", help="a small workload (minutes, not an hour)"
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="the engine's running-sequence cap (its default); --quick uses 32",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        n, in_range, out_range, batches, max_seqs = 32, (32, 128), (16, 64), [16, 32], 32
    else:
        n, in_range, out_range, batches, max_seqs = (
            args.num_prompts,
            (32, 512),
            (16, 256),
            [16, 32, 64],
            args.max_num_seqs,
        )
    from transformers import AutoModelForCausalLM

    src = resolve_model(args.model)
    for dtype_name in args.dtype or ["float32"]:
        dtype = getattr(torch, dtype_name)
        hf = AutoModelForCausalLM.from_pretrained(
            src.path, **src.pretrained_kwargs(), dtype=dtype
        ).eval()
        hf.generation_config.eos_token_id = None  # ignore EOS, as the engine run does
        config = WorkerConfig(
            model=args.model,
            dtype=dtype_name,
            num_threads=args.threads,
            linear_impl=dense_linear_impl(dtype_name),  # type: ignore[arg-type]
        )
        worker = Worker(config)
        worker.load_from_hf(hf)
        info = worker.model_info
        print(
            f"[{dtype_name}] engine: attention backend {info.attention_backend}, "
            f"matmuls {info.linear_impl}, max_num_seqs {max_seqs}, {torch.get_num_threads()} threads"
        )
        workload = make_workload(n, in_range, out_range, worker.model_info.vocab_size, args.seed)
        eng_s, eng_tokens = run_engine(worker, workload, max_seqs, 2048)
        print(
            f"[{dtype_name}] engine: {eng_tokens} tokens in {eng_s:.1f} s = {eng_tokens / eng_s:.1f} tok/s"
        )
        best = None
        if not args.skip_hf:
            for b in batches:
                hf_s, hf_tokens = run_hf(hf, workload, b)
                print(
                    f"[{dtype_name}] HF batch {b}: {hf_tokens} useful tokens in {hf_s:.1f} s = {hf_tokens / hf_s:.1f} tok/s"
                )
                best = max(best or 0.0, hf_tokens / hf_s)
            print(f"[{dtype_name}] engine / best HF = {eng_tokens / eng_s / best:.2f}x")
        context = (in_range[0] + in_range[1]) // 2 + out_range[1] // 2
        for ctx in sorted({64, context}):
            step, linear = decode_efficiency(worker, 64, ctx)
            print(
                f"[{dtype_name}] decode batch 64, context {ctx}: step {step:.1f} ms, linear layers {linear:.1f} ms, ratio {step / linear:.2f}"
            )
        del worker, hf


if __name__ == "__main__":
    main()
