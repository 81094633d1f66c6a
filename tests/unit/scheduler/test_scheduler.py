from __future__ import annotations

from llmserve.limits import prompt_too_long
from scheduler_service.engine import (
    CacheConfig,
    PreemptionMode,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SequenceStatus,
)

from .factories import make_seq_group


def make_scheduler(
    gpu=16, cpu=16, max_seqs=8, batched_tokens=64, max_len=64, chunked=True, mode=None
):
    return Scheduler(
        SchedulerConfig(max_seqs, batched_tokens, max_len, chunked, mode),
        CacheConfig(
            block_size=4,
            num_gpu_blocks=gpu,
            num_cpu_blocks=cpu,
            watermark=0.0,
            enable_prefix_caching=False,
        ),
    )


def run_step(s, out, token=7):
    """Pretend the worker ran the step: advance computed counts, append a token where sampled."""
    s.on_step_executed(out)
    for sg in out.scheduled:
        for seq in sg.seq_group.get_seqs(SequenceStatus.RUNNING):
            if seq.num_computed_tokens == seq.get_len():
                seq.append_token_id(token, {token: -0.5})
                sg.seq_group.has_sampled = True


def chunks(out):
    """(request id, tokens scheduled) of each scheduled group, in schedule order."""
    return [(x.seq_group.request_id, x.token_chunk_size) for x in out.scheduled]


def test_prompt_over_max_model_len_is_ignored_with_a_reason():
    s = make_scheduler(max_len=8)
    g = make_seq_group("long", list(range(9)))
    s.add_seq_group(g)
    out = s.schedule()
    assert out.ignored == [g]
    assert g.seqs[0].status is SequenceStatus.IGNORED
    assert g.error.field == "prompt" and "max_model_len" in g.error.message
    assert not s.has_unfinished_seqs()


def test_a_prompt_must_leave_room_for_one_generated_token():
    """llmserve.limits.prompt_too_long is the engine's rule too: a prompt of exactly
    max_model_len is ignored with its reason, one token shorter runs."""
    s = make_scheduler(max_len=8)
    full = make_seq_group("full", list(range(8)))
    fits = make_seq_group("fits", list(range(7)))
    s.add_seq_group(full)
    s.add_seq_group(fits)
    out = s.schedule()
    assert out.ignored == [full]
    assert (full.error.field, full.error.detail) == ("prompt", prompt_too_long(8, 8))
    assert chunks(out) == [("fits", 7)]


def test_prompt_larger_than_the_cache_is_ignored():
    s = make_scheduler(gpu=2, max_len=64)
    g = make_seq_group("big", list(range(12)))  # 3 blocks > 2
    ok = make_seq_group("ok", [1, 2, 3])
    s.add_seq_group(g)
    s.add_seq_group(ok)
    out = s.schedule()
    assert out.ignored == [g]
    assert g.error.field == "prompt" and "KV blocks" in g.error.message
    assert [x.seq_group for x in out.scheduled] == [ok]


def test_chunked_prefill_splits_a_long_prompt_and_decodes_go_first():
    s = make_scheduler(gpu=32, batched_tokens=8)
    short = make_seq_group("short", [1, 2, 3])
    long = make_seq_group("long", list(range(20)))
    s.add_seq_group(short)
    s.add_seq_group(long)
    out = s.schedule()
    assert chunks(out) == [("short", 3), ("long", 5)]
    assert out.num_batched_tokens == 8
    run_step(s, out)
    out = s.schedule()
    # The decode of "short" first, then the next 7 prompt tokens of "long".
    assert chunks(out) == [("short", 1), ("long", 7)]
    run_step(s, out)
    out = s.schedule()
    assert chunks(out) == [("short", 1), ("long", 7)]
    run_step(s, out)
    out = s.schedule()
    assert chunks(out) == [("short", 1), ("long", 1)]
    assert long.seqs[0].get_output_len() == 0  # the last prompt token, then it samples
    run_step(s, out)
    assert long.seqs[0].get_output_len() == 1


def test_prefill_first_policy_runs_prompts_alone():
    s = make_scheduler(gpu=32, batched_tokens=64, chunked=False)
    a = make_seq_group("a", [1, 2, 3])
    s.add_seq_group(a)
    out = s.schedule()
    run_step(s, out)
    b = make_seq_group("b", [4, 5])
    s.add_seq_group(b)
    out = s.schedule()
    assert chunks(out) == [("b", 2)]
    run_step(s, out)
    out = s.schedule()
    assert chunks(out) == [("a", 1), ("b", 1)]


def test_budgets_max_num_seqs_and_tokens():
    s = make_scheduler(gpu=64, max_seqs=3, batched_tokens=10)
    groups = [make_seq_group(f"r{i}", [1, 2, 3, 4]) for i in range(5)]
    for g in groups:
        s.add_seq_group(g)
    out = s.schedule()
    # 4 + 4 tokens, then 2 of the third prompt; the token budget is full.
    assert chunks(out) == [("r0", 4), ("r1", 4), ("r2", 2)]
    run_step(s, out)
    out = s.schedule()
    # max_num_seqs = 3: r3 waits although tokens are left.
    assert chunks(out) == [("r0", 1), ("r1", 1), ("r2", 2)]
    assert len(s.waiting) == 2
    best_of = make_seq_group("bo", [1], params=SamplingParams(n=2, temperature=1.0))
    s2 = make_scheduler(gpu=64, max_seqs=3, batched_tokens=10)
    s2.add_seq_group(make_seq_group("one", [1]))
    s2.add_seq_group(make_seq_group("two", [1]))
    s2.add_seq_group(best_of)  # needs 2 sequence slots
    assert [x.seq_group.request_id for x in s2.schedule().scheduled] == ["one", "two"]


def test_preemption_recompute_for_single_sequence_groups():
    s = make_scheduler(gpu=3, batched_tokens=16)
    a = make_seq_group("a", [1, 2, 3, 4])  # 1 block
    b = make_seq_group("b", [5, 6, 7, 8])  # 1 block
    s.add_seq_group(a)
    s.add_seq_group(b)
    out = s.schedule()
    run_step(s, out)  # both need a second block now: 4 needed, 1 free
    out = s.schedule()
    assert [(p.request_id, p.mode) for p in out.preempted] == [("b", PreemptionMode.RECOMPUTE)]
    assert [x.seq_group.request_id for x in out.scheduled] == ["a"]
    assert b.seqs[0].status is SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert out.freed_seq_ids == [b.seqs[0].seq_id]
    assert list(s.waiting) == [b]
    assert s.get_stats().num_preemptions_recompute == 1
    s.block_manager.check_invariants()


def test_preemption_swap_for_multi_sequence_groups_and_swapped_first():
    s = make_scheduler(gpu=4, batched_tokens=16)
    a = make_seq_group("a", [1, 2, 3, 4])
    b = make_seq_group("b", [5, 6, 7, 8])
    s.add_seq_group(a)
    s.add_seq_group(b)
    out = s.schedule()
    run_step(s, out)
    parent = b.seqs[0]
    child = parent.fork(999, 1)
    b.add(child)
    s.fork_seq(parent, child, [])
    out = s.schedule()  # a needs 1 block, b needs 2; 2 free -> b is swapped out
    assert [(p.request_id, p.mode) for p in out.preempted] == [("b", PreemptionMode.SWAP)]
    assert out.blocks_to_swap_out == [(1, 0)]  # the shared block moves once
    assert [g.status for g in b.seqs] == [SequenceStatus.SWAPPED] * 2
    run_step(s, out)
    late = make_seq_group("late", [9])
    s.add_seq_group(late)
    out = s.schedule()
    # b cannot come back yet (2 cpu blocks + 2 new > free) and blocks new prompts.
    assert [x.seq_group.request_id for x in out.scheduled] == ["a"]
    s.abort_seq_group("a")
    out = s.schedule()
    assert out.blocks_to_swap_in == [(0, 3)]
    assert [x.seq_group.request_id for x in out.scheduled] == ["b", "late"]
    assert s.block_manager.get_block_table(parent) == [3, 1]
    assert s.block_manager.get_block_table(child) == [3, 2]
    assert s.block_manager.get_block_table(late.seqs[0]) == [0]
    s.block_manager.check_invariants()


def test_abort_frees_blocks_in_every_queue():
    s = make_scheduler(gpu=8)
    a = make_seq_group("a", list(range(8)))
    s.add_seq_group(a)
    s.add_seq_group(make_seq_group("w", [1]))
    s.schedule()
    assert s.block_manager.get_num_free_gpu_blocks() == 5
    assert s.abort_seq_group("a") is a
    assert a.seqs[0].status is SequenceStatus.ABORTED
    assert s.abort_seq_group("w") is not None
    assert s.abort_seq_group("nope") is None
    assert s.block_manager.get_num_free_gpu_blocks() == 8
    assert not s.has_unfinished_seqs()
    s.block_manager.check_invariants()


def test_prefill_first_admits_prompts_only_into_room_left_by_running_groups():
    s = make_scheduler(gpu=32, max_seqs=2, chunked=False)
    a, b = make_seq_group("a", [1, 2, 3]), make_seq_group("b", [4, 5])
    s.add_seq_group(a)
    s.add_seq_group(b)
    run_step(s, s.schedule())
    c, d = make_seq_group("c", [6, 7, 8]), make_seq_group("d", [9])
    s.add_seq_group(c)
    s.add_seq_group(d)
    out = s.schedule()
    # a and b fill max_num_seqs = 2: no prompt is admitted, the running groups decode.
    assert chunks(out) == [("a", 1), ("b", 1)]
    assert list(s.running) == [a, b] and list(s.waiting) == [c, d]
    run_step(s, out)
    s.abort_seq_group("a")
    out = s.schedule()
    # One place is free: c's whole prompt runs alone; d still waits.
    assert chunks(out) == [("c", 3)]
    assert list(s.running) == [b, c] and list(s.waiting) == [d]
