"""The running and swapped queues stay in arrival order, so preemption always takes the
latest arrival, however the groups came back (swap-in, re-admission after recompute)."""

from __future__ import annotations

from scheduler_service.engine import CacheConfig, LLMEngine, PreemptionMode, SchedulerConfig

from .factories import make_seq_group
from .fake_model import FakeModel
from .test_preemption_equivalence import EOS, workload
from .test_scheduler import make_scheduler, run_step


def step_until_preemption(s, limit=20):
    for _ in range(limit):
        out = s.schedule()
        if out.preempted:
            return out
        run_step(s, out)
    raise AssertionError(f"no preemption within {limit} steps")


def summary(out):
    return (
        [(p.request_id, p.mode) for p in out.preempted],
        [(x.seq_group.request_id, x.token_chunk_size) for x in out.scheduled],
    )


def test_arrival_order_survives_swap_in_plus_recompute_the_latest_arrival_is_preempted():
    # 5 blocks of 4 tokens. a and b hold one sequence each (recomputed when preempted); c
    # holds two (swapped). A group needs a free block per running sequence to decode.
    s = make_scheduler(gpu=5, cpu=8)
    a = make_seq_group("a", [1, 2, 3], arrival_time=0.0)
    b = make_seq_group("b", [4, 5, 6, 7], arrival_time=1.0)
    c = make_seq_group("c", [8, 9], arrival_time=2.0)
    for g in (a, b, c):
        s.add_seq_group(g)
    run_step(s, s.schedule())  # one block each; 2 free
    parent = c.seqs[0]
    child = parent.fork(999, 1)
    c.add(child)
    s.fork_seq(parent, child, [])

    # b takes a block for its 5th token; c (last, wanting one per sequence) is swapped out.
    out = step_until_preemption(s)
    assert summary(out) == ([("c", PreemptionMode.SWAP)], [("a", 1), ("b", 1)])
    run_step(s, out)
    # c cannot come back (1 block + 2 > the free blocks). When a needs its third block and
    # none is free, b (now last) is recomputed: it holds 10 tokens.
    out = step_until_preemption(s)
    assert summary(out) == ([("b", PreemptionMode.RECOMPUTE)], [("a", 1)])
    assert (list(s.running), list(s.swapped), list(s.waiting)) == ([a], [c], [b])
    run_step(s, out)

    # a leaves: 5 blocks free. c swaps in (its block, and one copy-on-write block), then b's
    # 10 tokens are prefilled again (3 blocks). c came back first, but b arrived first.
    s.abort_seq_group("a")
    out = s.schedule()
    assert summary(out) == ([], [("c", 1), ("b", 10)])
    assert len(out.blocks_to_swap_in) == 1 and len(out.blocks_to_copy) == 1
    assert list(s.running) == [b, c]
    run_step(s, out)

    # No block is free; when c's sequences both need a new block (b does not), c, the
    # latest arrival, is preempted and b runs.
    out = step_until_preemption(s)
    assert summary(out) == ([("c", PreemptionMode.SWAP)], [("b", 1)])
    assert (list(s.running), list(s.swapped)) == ([b], [c])
    s.block_manager.check_invariants()


def test_queues_stay_in_arrival_order_under_heavy_preemption():
    num_gpu_blocks, num_cpu_blocks = 40, 400
    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=96, max_model_len=128),
        CacheConfig(4, num_gpu_blocks, num_cpu_blocks, watermark=0.0),
        FakeModel(num_gpu_blocks, num_cpu_blocks, 4),
    )
    prompts, params = workload(60)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        # Arrival times out of id order, so that order by id proves nothing.
        engine.add_request(f"r{i}", prompt, p, arrival_time=float((i * 7) % 60), eos_token_id=EOS)
    scheduler = engine.scheduler
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for queue in (scheduler.running, scheduler.swapped):
            arrivals = [g.arrival_time for g in queue]
            assert arrivals == sorted(arrivals)
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_preemptions_swap >= 5 and stats.num_preemptions_recompute >= 5
