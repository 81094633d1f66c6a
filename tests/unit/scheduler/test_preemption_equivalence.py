"""Outputs must not depend on memory pressure: a tiny cache (many swap and recompute
preemptions) gives exactly the outputs of an ample one, as seen by a fake model that reads
its context back from a simulated paged cache."""

from __future__ import annotations

import random

from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import generate

from .fake_model import FakeModel

BLOCK = 4
EOS = 0


def workload(num: int, seed: int = 1234):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 64) for _ in range(12)]  # a common prefix for cache hits
    prompts, params = [], []
    for i in range(num):
        body = [rng.randrange(1, 64) for _ in range(rng.randrange(1, 24))]
        prompts.append(shared + body if i % 3 == 0 else body)
        max_tokens = rng.randrange(1, 20)
        kind = i % 5
        if kind == 0:
            p = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, logprobs=1)
        elif kind == 1:
            p = SamplingParams(n=2, max_tokens=max_tokens, prompt_logprobs=1)
        elif kind == 2:
            p = SamplingParams(n=4, max_tokens=max_tokens, min_tokens=min(2, max_tokens))
        elif kind == 3:
            p = SamplingParams(n=2, best_of=4, max_tokens=max_tokens)
        else:
            p = SamplingParams(
                n=2,
                best_of=3,
                use_beam_search=True,
                temperature=0.0,
                max_tokens=rng.randrange(1, 10),
                early_stopping=[True, False, "never"][i % 3],
            )
        params.append(p)
    return prompts, params


def run(
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    chunked: bool,
    caching: bool,
    num: int = 200,
    priorities: bool = False,
):
    cache = CacheConfig(
        BLOCK, num_gpu_blocks, num_cpu_blocks, watermark=0.0, enable_prefix_caching=caching
    )
    sched = SchedulerConfig(
        max_num_seqs=48,
        max_num_batched_tokens=96 if chunked else 128,
        max_model_len=128,
        enable_chunked_prefill=chunked,
    )
    model = FakeModel(num_gpu_blocks, num_cpu_blocks, BLOCK)
    engine = LLMEngine(sched, cache, model)
    prompts, params = workload(num)
    # With priorities, requests of higher priority also preempt running ones of lower.
    levels = [(i * 7) % 3 - 1 for i in range(num)] if priorities else None
    outputs = generate(engine, prompts, params, eos_token_id=EOS, priorities=levels)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == num_cpu_blocks
    assert not engine.has_unfinished_requests()
    summary = [
        (
            [
                (
                    c.index,
                    c.token_ids,
                    round(c.cumulative_logprob, 9),
                    c.finish_reason,
                    None if c.logprobs is None else [lp.token.token_id for lp in c.logprobs],
                )
                for c in o.outputs
            ],
            None if o.prompt_logprobs is None else [p.position for p in o.prompt_logprobs],
        )
        for o in outputs
    ]
    return summary, engine.get_stats(), model, prompts


def test_tiny_cache_equals_ample_cache_with_chunked_prefill_and_prefix_caching():
    ample, ample_stats, _, prompts = run(4000, 8, chunked=True, caching=True)
    assert ample_stats.num_preemptions_swap == ample_stats.num_preemptions_recompute == 0
    tiny, stats, model, _ = run(40, 400, chunked=True, caching=True)
    assert stats.num_preemptions_swap >= 10
    assert stats.num_preemptions_recompute >= 10
    assert stats.prefix_cache_hits > 0
    assert tiny == ample
    # Every request finished and prompt logprobs came once per prompt position.
    for (choices, prompt_positions), prompt in zip(ample, prompts, strict=True):
        assert choices and all(c[3] is not None for c in choices)
        if prompt_positions is not None:
            assert prompt_positions == list(range(1, len(prompt)))


def test_tiny_cache_equals_ample_cache_prefill_first_without_caching():
    ample, _, _, _ = run(4000, 8, chunked=False, caching=False, num=120)
    tiny, stats, _, _ = run(40, 400, chunked=False, caching=False, num=120)
    assert stats.num_preemptions_swap >= 5
    assert stats.num_preemptions_recompute >= 5
    assert tiny == ample


def test_tiny_cache_with_priorities_equals_ample_cache_without():
    ample, _, _, _ = run(4000, 8, chunked=True, caching=True, num=120)
    tiny, stats, _, _ = run(40, 400, chunked=True, caching=True, num=120, priorities=True)
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute >= 10
    assert tiny == ample
