"""Outputs must not depend on memory pressure: a tiny cache (many swap and recompute
preemptions) gives exactly the outputs of an ample one, as seen by a fake model that reads
its context back from a simulated paged cache."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from llmserve.kv_layout import NULL_BLOCK, first_live_block
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import generate
from scheduler_service.engine.sequence import SequenceStatus
from scheduler_service.engine.speculation import Speculator

from .fake_model import FakeModel
from .test_speculation import K, MixedProposer

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
    windows: tuple[int | None, ...] = (None,),
    state_slots: int = 0,
    setup: Callable[[LLMEngine, FakeModel], None] | None = None,
    **scheduler: int,
):
    cache = CacheConfig(
        BLOCK,
        num_gpu_blocks,
        num_cpu_blocks,
        watermark=0.0,
        enable_prefix_caching=caching,
        kv_windows=windows,
        num_state_slots=state_slots,
    )
    sched = SchedulerConfig(
        max_num_seqs=48,
        max_num_batched_tokens=96 if chunked else 128,
        max_model_len=128,
        enable_chunked_prefill=chunked,
        **scheduler,
    )
    model = FakeModel(
        num_gpu_blocks, num_cpu_blocks, BLOCK, windows=windows, num_state_slots=state_slots
    )
    engine = LLMEngine(sched, cache, model)
    if setup is not None:
        setup(engine, model)
    if windows != (None,):
        execute = model.execute

        def checked(step):  # type: ignore[no-untyped-def]
            assert_windows_hold_nothing_before(engine)
            return execute(step)

        model.execute = checked  # type: ignore[method-assign]
    prompts, params = workload(num)
    # With priorities, requests of higher priority also preempt running ones of lower.
    levels = [(i * 7) % 3 - 1 for i in range(num)] if priorities else None
    outputs = generate(engine, prompts, params, eos_token_id=EOS, priorities=levels)
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == num_gpu_blocks - bm.num_reserved
    assert bm.get_num_free_cpu_blocks() == num_cpu_blocks
    if bm.states is not None:
        assert bm.states.num_free() == state_slots
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


def assert_windows_hold_nothing_before(engine: LLMEngine) -> None:
    """Every running sequence's windowed tables hold no block before the window of its next
    computed position: those went back to the pool (or the evictor)."""
    bm = engine.scheduler.block_manager
    for seq_group in engine.scheduler.running:
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            for g, window in enumerate(bm.windows):
                if window is None:
                    continue
                first = first_live_block(seq.num_computed_tokens, window, BLOCK)
                held = bm.get_block_table(seq, g)[:first]
                assert set(held) <= {NULL_BLOCK}, f"seq {seq.seq_id} group {g} holds {held}"


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


# KV groups as a hybrid model lays them out: full attention beside two window sizes, one of
# them not a multiple of the block size (three groups, each block a third of the layers, so
# the tiny cache has three times the blocks of the tests above); and a model whose every
# layer slides (one group).
@pytest.mark.parametrize("windows", [(None, 6, 9), (7,)], ids=["full-and-windows", "windows"])
def test_tiny_cache_equals_ample_cache_with_sliding_windows(windows):
    ample, ample_stats, _, _ = run(4000, 8, chunked=True, caching=True, num=120, windows=windows)
    assert ample_stats.num_preemptions_swap == ample_stats.num_preemptions_recompute == 0
    blocks = 40 * len(windows)
    tiny, stats, _, _ = run(
        blocks, 10 * blocks, chunked=True, caching=True, num=120, windows=windows
    )
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute >= 10
    assert stats.prefix_cache_hits > 0
    assert tiny == ample


def test_windows_change_what_the_fake_model_reads():
    """The windowed runs above compare something: the same workload with other windows
    gives other outputs (the fake model reads only the window back)."""
    full, _, _, _ = run(4000, 8, chunked=True, caching=True, num=40)
    windowed, _, _, _ = run(4000, 8, chunked=True, caching=True, num=40, windows=(None, 6, 9))
    assert full != windowed


# A model with recurrent layers (a state slot per sequence): a swap moves each state to a
# host slot and back (maybe to another device slot), a prefix hit starts from the state snapshot kept at its last block (the
# snapshots share the slots, evicted when requests need them), and a request takes the slots
# its forks will need at admission. Few slots (beam search of width 3 needs 6 of the 8) make
# admissions wait for slots as well as for blocks.
# The block counts are the smallest that hold the workload's largest request.
@pytest.mark.parametrize(
    ("windows", "blocks"), [((None,), 32), ((None, 6), 48)], ids=["full", "full-and-window"]
)
def test_tiny_cache_and_few_state_slots_equal_an_ample_cache(windows, blocks):
    ample, ample_stats, _, _ = run(
        4000, 8, chunked=True, caching=True, num=120, windows=windows, state_slots=200
    )
    assert ample_stats.num_preemptions_swap == ample_stats.num_preemptions_recompute == 0
    tiny, stats, _, _ = run(
        blocks, 400, chunked=True, caching=True, num=120, windows=windows, state_slots=8
    )
    assert stats.num_preemptions_swap >= 5
    assert stats.prefix_cache_hits > 0
    assert tiny == ample
    # Nothing cached, every state computed from the first token: the same outputs.
    uncached, _, _, _ = run(
        4000, 8, chunked=True, caching=False, num=120, windows=windows, state_slots=200
    )
    assert uncached == ample


def ample_single_steps(windows: tuple[int | None, ...], state_slots: int):
    """The 120-request workload with room for every request, one token a step: the outputs a
    tiny cache must give."""
    outputs, _, _, _ = run(
        4000,
        8,
        chunked=True,
        caching=True,
        num=120,
        windows=windows,
        state_slots=state_slots,
        decode_steps=1,
    )
    return outputs


# Multi-step decoding under pressure: the sequences decoding four tokens a step grow faster,
# so preemptions fall elsewhere, and a child forked at a first sample may be swapped out (or
# its parent) by the step that carries the fork (`llmserve.steps`, step 5). Steps that compute
# a prompt take no passes, and in this cache most steps of two sequences admit or recompute
# one: the smallest case is 3.
@pytest.mark.parametrize(
    ("windows", "blocks", "state_slots", "max_seqs"),
    [((None,), 40, 0, 8), ((None,), 40, 0, 48), ((None, 6), 48, 8, 3), ((None, 6), 48, 8, 8)],
    ids=["full-8", "full-48", "window-states-3", "window-states-8"],
)
def test_multi_step_decoding_in_a_tiny_cache_equals_an_ample_cache(
    windows, blocks, state_slots, max_seqs
):
    tiny, stats, model, _ = run(
        blocks,
        400,
        chunked=True,
        caching=True,
        num=120,
        windows=windows,
        state_slots=state_slots,
        decode_steps=4,
        decode_steps_max_seqs=max_seqs,
    )
    assert model.num_own_steps > 10
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute >= 5
    assert tiny == ample_single_steps(windows, 200 if state_slots else 0)


def with_mixed_drafts(engine: LLMEngine, model: FakeModel) -> None:
    scheduler = engine.scheduler
    config, bm = scheduler.scheduler_config, scheduler.block_manager
    scheduler.speculator = Speculator(config, bm, MixedProposer(model))


# Drafts (right ones, then wrong ones from a position on) of a model with recurrent layers:
# the worker verifies each sequence's drafts from one state and puts back the state after the
# ones it keeps, and the outputs are those of a run without drafts, under preemption.
@pytest.mark.parametrize(("windows", "blocks"), [((None,), 32), ((None, 6), 48)])
def test_drafts_with_state_slots_in_a_tiny_cache_equal_an_ample_cache_without(windows, blocks):
    tiny, stats, model, _ = run(
        blocks,
        400,
        chunked=True,
        caching=True,
        num=120,
        windows=windows,
        state_slots=8,
        setup=with_mixed_drafts,
        num_speculative_tokens=K,
        speculative_max_seqs=48,
        speculative_max_batch=96,
    )
    assert model.num_drafts_kept > 0
    assert stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens  # some dropped
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute >= 5
    assert tiny == ample_single_steps(windows, 200)


def test_state_slots_change_what_the_fake_model_samples():
    """The runs above compare something: the same workload with states gives other outputs
    (every sample depends on the slot's running state)."""
    plain, _, _, _ = run(4000, 8, chunked=True, caching=True, num=40)
    with_states, _, _, _ = run(4000, 8, chunked=True, caching=True, num=40, state_slots=200)
    assert plain != with_states
