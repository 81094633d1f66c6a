"""The hybrid KV cache on Gemma 3 270M (its shipped GGUF): what keeping only the windows saves.

Gemma 3 270M has 18 layers, 15 of them local (a 512-token window). With KV groups
(llmserve/kv_layout.py) its local layers keep only their windows' blocks; with
`--no-hybrid-kv-cache` every layer keeps every token's K/V, as before groups. Both layouts
come from the same loaded worker, in the same run:

1. Accounting, no forward pass: the real scheduler (LLMEngine) over each layout's block
   count in the worker's default --kv-cache-memory, driven by a bookkeeping-only executor
   that follows the step contract and samples token 1: resident K/V bytes of one sequence at
   1k, 8k and 32k tokens (after its prefill); how many of 64 requests of 8k tokens (7936 +
   256) run at once; whether eight of 32k tokens (32256 + 512) run at once, and preemptions.
2. Serving: 16 streams of 4k-token prompts, 32 greedy tokens each, through the in-process
   engine on the real worker (cpu backend), one run per layout; output tokens per second of
   wall time, prefill included.

    .venv/bin/python bench/hybrid_kv.py
    .venv/bin/python bench/hybrid_kv.py --skip-serving
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import replace

import torch

from llmserve.kv_layout import KvLayout, single_group
from llmserve.model_spec import GEMMA3_270M
from llmserve.sampling_params import SamplingParams
from llmserve.steps import SequenceOutput, StepInput, StepResult, TokenLogprob
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.offline import generate
from worker_service.cache_engine import cache_block_size_bytes
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

MiB = 1 << 20


class BookkeepingExecutor:
    """A worker's bookkeeping only (`llmserve.steps`): known and computed tokens per
    sequence; a sequence that reaches its last known token samples token 1."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}  # seq id -> [known tokens, computed tokens]

    def execute(self, step: StepInput) -> StepResult:
        for seq_id in step.freed_seq_ids:
            self.seqs.pop(seq_id, None)
        for fork in step.forks:
            self.seqs[fork.child_seq_id] = list(self.seqs[fork.parent_seq_id])
        scheduled = []
        for new in step.new_seqs:
            self.seqs[new.seq_id] = [len(new.token_ids), new.num_computed_tokens]
            scheduled.append((new.seq_id, new.num_scheduled_tokens))
        for cached in step.cached_seqs:
            self.seqs[cached.seq_id][0] += len(cached.new_token_ids)
            scheduled.append((cached.seq_id, cached.num_scheduled_tokens))
        outputs = []
        for seq_id, count in scheduled:
            state = self.seqs[seq_id]
            state[1] += count
            if count and state[1] == state[0]:
                outputs.append(SequenceOutput(seq_id, [TokenLogprob(1, 0.0, 1)]))
        return StepResult(step.step_id, outputs)


def layouts(worker: Worker) -> dict[str, KvLayout]:
    hybrid = worker.model_info.kv_layout
    # The layout before groups: every layer of the model's one width keeps every token.
    before = single_group(hybrid.num_layers, hybrid.unit)
    return {"before (one group)": before, "hybrid": hybrid}


def block_bytes(worker: Worker, layout: KvLayout) -> int:
    return cache_block_size_bytes(layout, worker.config.block_size, worker.dtype)


def accounting_engine(worker: Worker, layout: KvLayout, max_model_len: int) -> LLMEngine:
    """The scheduler over as many of `layout`'s blocks as the worker's KV memory holds."""
    num_blocks = worker.config.kv_cache_memory_bytes // block_bytes(worker, layout)
    return LLMEngine(
        SchedulerConfig(max_model_len=max_model_len),
        CacheConfig(
            worker.config.block_size,
            num_blocks,
            0,
            enable_prefix_caching=False,
            kv_windows=layout.windows,
        ),
        BookkeepingExecutor(),  # type: ignore[arg-type]
    )


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def resident_bytes(worker: Worker, layout: KvLayout, num_tokens: int) -> int:
    """K/V bytes one sequence of `num_tokens` holds once its prompt is computed."""
    engine = accounting_engine(worker, layout, num_tokens + 8)
    (prompt,) = prompts(1, num_tokens, worker.model.arch.vocab_size, seed=num_tokens)
    engine.add_request("one", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    group = engine.scheduler.get_seq_group("one")
    assert group is not None
    seq = group.seqs[0]
    while seq.get_output_len() == 0:
        engine.step()
    blocks = sum(engine.scheduler.block_manager.resident_blocks(seq))
    return blocks * block_bytes(worker, layout)


def concurrency(
    worker: Worker, layout: KvLayout, count: int, length: int, max_tokens: int
) -> tuple[int, int]:
    """(most requests running at once, preemptions) for `count` requests of `length` tokens
    submitted together."""
    engine = accounting_engine(worker, layout, length + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts(count, length, worker.model.arch.vocab_size, seed=7)):
        engine.add_request(f"r{i}", prompt, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
    engine.scheduler.block_manager.check_invariants()
    stats = engine.get_stats()
    return most, stats.num_preemptions_recompute + stats.num_preemptions_swap


def serve(worker: Worker, num_streams: int, length: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) for `num_streams` greedy streams of `length`-token prompts."""
    gpu, _ = worker.determine_num_available_blocks()
    worker.initialize_cache(gpu, 0)
    engine = LLMEngine(
        SchedulerConfig(max_model_len=length + max_tokens),
        CacheConfig(
            worker.config.block_size,
            gpu,
            0,
            kv_windows=worker.model_info.kv_layout.windows,
        ),
        worker,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = prompts(num_streams, length, worker.model.arch.vocab_size, seed=11)
    start = time.perf_counter()
    outputs = generate(engine, batch, params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    config = WorkerConfig(model=GEMMA3_270M)
    worker = Worker(config)
    worker.load_model()
    print(f"model {GEMMA3_270M}: {worker.model_info.kv_layout}")
    print(f"KV memory {config.kv_cache_memory_bytes // MiB} MiB, {worker.dtype}")
    for name, layout in layouts(worker).items():
        print(f"\n## {name}: {len(layout.groups)} groups, {layout.slots} slots a block, "
              f"{config.kv_cache_memory_bytes // block_bytes(worker, layout)} blocks")  # fmt: skip
        for tokens in (1024, 8192, 32760):
            print(f"resident K/V at {tokens} tokens: "
                  f"{resident_bytes(worker, layout, tokens) / MiB:.1f} MiB")  # fmt: skip
        # Outputs long enough that the requests admitted first still run when the last are
        # admitted (one 2048-token prefill chunk a step): memory, not the arrival of
        # prefills, bounds how many run at once.
        most, preempted = concurrency(worker, layout, 64, 8192 - 256, 256)
        print(f"64 requests of 8192 tokens (7936 + 256): {most} at once, {preempted} preemptions")
        most, preempted = concurrency(worker, layout, 8, 32768 - 512, 512)
        print(f"8 requests of 32768 tokens (32256 + 512): {most} at once, {preempted} preemptions")
    if args.skip_serving:
        return
    for hybrid in (False, True):
        served = worker if hybrid else Worker(replace(config, hybrid_kv_cache=False))
        if not hybrid:
            served.load_model()
        seconds, tokens = serve(served, args.streams, args.prompt_tokens, args.max_tokens)
        print(
            f"\nserving, hybrid={hybrid}: {args.streams} streams x {args.prompt_tokens}-token "
            f"prompts, {tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.2f} tok/s"
        )
        if not hybrid:
            del served


if __name__ == "__main__":
    main()
