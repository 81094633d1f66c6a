"""An in-process engine over a real worker: the scheduler's LLMEngine driving a `Worker`
directly, for tests that compare outputs without the services around them."""

from __future__ import annotations

from typing import Any

from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.config import PreemptionMode
from worker_service.worker import Worker


def engine_on_worker(
    worker: Worker,
    *,
    gpu_blocks: int,
    cpu_blocks: int,
    batched_tokens: int,
    max_model_len: int,
    chunked: bool = True,
    prefix: bool = True,
    preemption: PreemptionMode | None = None,
    **scheduler: Any,
) -> LLMEngine:
    """Initialize the worker's cache with the memory of these block counts and return an
    engine over it (max_num_seqs 16, no watermark, the worker's block size); `scheduler`: more
    `SchedulerConfig` fields. The counts are of blocks holding every layer: a model laid out in
    KV groups (`llmserve.kv_layout`) gets as many of its smaller blocks as fit the same memory."""
    layout = worker.model_info.kv_layout
    num_layers = sum(len(g.layers) for g in layout.groups)
    gpu_blocks = gpu_blocks * num_layers // layout.slots
    cpu_blocks = cpu_blocks * num_layers // layout.slots
    worker.initialize_cache(gpu_blocks, cpu_blocks)
    return LLMEngine(
        SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            preemption_mode=preemption,
            **scheduler,
        ),
        CacheConfig(
            worker.config.block_size,
            gpu_blocks,
            cpu_blocks,
            watermark=0.0,
            enable_prefix_caching=prefix,
            kv_windows=worker.model_info.kv_layout.windows,
            num_state_slots=worker.num_state_slots,
        ),
        worker,
    )
