"""The block manager over KV groups: a full group beside a windowed one (window 6, blocks of
4). Exact block ids, as the single-group tests assert them."""

from __future__ import annotations

from llmserve.kv_layout import NULL_BLOCK
from scheduler_service.engine import AllocStatus, BlockSpaceManager, SequenceStatus

from .factories import make_seq_group

WINDOWS = (None, 6)


def _manager(num_blocks: int = 32, caching: bool = True) -> BlockSpaceManager:
    return BlockSpaceManager(
        4, num_blocks, 8, watermark=0.0, enable_caching=caching, windows=WINDOWS
    )


def _run(bm: BlockSpaceManager, prompt: list[int], chunk: int):
    """Admit a prompt and compute it in chunks of `chunk` tokens, as the scheduler would."""
    group = make_seq_group(f"r{prompt[0]}", prompt)
    seq = group.seqs[0]
    bm.allocate(group)
    seq.num_computed_tokens = bm.get_num_computed_tokens(seq)
    seq.status = SequenceStatus.RUNNING
    while seq.num_computed_tokens < seq.get_len():
        step = min(chunk, seq.get_len() - seq.num_computed_tokens)
        assert bm.can_append_slots(group, step)
        bm.append_slots(seq, chunk=step)
        seq.num_computed_tokens += step
        bm.mark_computed(seq)
        bm.check_invariants()
    return group, seq


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    bm = _manager(8)
    assert bm.num_reserved == 1
    assert bm.get_num_free_gpu_blocks() == 7
    _, seq = _run(bm, list(range(1, 9)), chunk=8)
    assert NULL_BLOCK not in bm.get_block_table(seq, 0)
    assert bm.can_allocate(make_seq_group("big", list(range(40))), 4) is AllocStatus.NEVER


def test_the_windowed_table_keeps_only_the_window_and_grows_with_each_chunk() -> None:
    bm = _manager()
    _, seq = _run(bm, list(range(1, 25)), chunk=8)  # 24 tokens, 6 blocks in the full group
    assert bm.get_block_table(seq, 0) == [1, 2, 3, 4, 5, 6]
    # Next position 24 reads keys from 19 on: blocks 4 and 5 of the windowed table; 0-3 left.
    windowed = bm.get_block_table(seq, 1)
    assert windowed[:4] == [NULL_BLOCK] * 4
    assert len(windowed) == 6 and NULL_BLOCK not in windowed[4:]
    assert bm.resident_blocks(seq) == [6, 2]
    assert bm.group_usage() == [6, 2]


def test_a_prefix_hit_needs_every_full_block_but_only_the_windows_last_blocks() -> None:
    bm = _manager()
    prompt = list(range(1, 25))
    _, seq = _run(bm, prompt, chunk=8)
    bm.free(seq)
    # The same prompt and more: the 24 tokens' 6 full blocks hit; the windowed group takes
    # the two cached blocks its window reads at position 24 (evicted ones are not needed).
    _, again = _run(bm, prompt + [99, 98], chunk=8)
    assert bm.prefix.hits == 6
    assert again.num_computed_tokens == 26
    bm.check_invariants()


def test_a_hit_stops_where_the_windows_blocks_were_evicted() -> None:
    bm = _manager(num_blocks=14)  # 13 usable: the second prompt's blocks evict the first's
    prompt = list(range(1, 25))
    _, seq = _run(bm, prompt, chunk=8)
    bm.free(seq)
    _, other = _run(bm, list(range(100, 132)), chunk=8)  # 32 tokens: 8 + 3 blocks
    bm.free(other)
    _, again = _run(bm, prompt + [7], chunk=8)
    # Some of the first prompt's blocks were evicted for the second: the hit is only what
    # both groups still hold, and the rest was computed again.
    assert bm.prefix.hits < 6
    assert again.num_computed_tokens == 25
    bm.check_invariants()


def test_swap_moves_only_the_live_blocks_and_keeps_the_null_entries() -> None:
    bm = _manager()
    group, seq = _run(bm, list(range(1, 25)), chunk=8)
    mapping = bm.swap_out(group)
    assert len(mapping) == 6 + 2
    assert bm.get_block_table(seq, 1)[:4] == [NULL_BLOCK] * 4
    for s in group.seqs:
        s.status = SequenceStatus.SWAPPED
    assert bm.can_swap_in(group)
    back = bm.swap_in(group)
    assert sorted(back) == sorted(mapping.values())
    assert bm.pop_dirty_from(seq.seq_id, 1) == 4  # the worker rewrites the live part only
    bm.check_invariants()


def test_fork_shares_the_live_blocks_of_every_group() -> None:
    bm = _manager()
    group, parent = _run(bm, list(range(1, 25)), chunk=8)
    child = parent.fork(999, 1)
    bm.fork(parent, child)
    for g in range(2):
        assert bm.get_block_table(child, g) == bm.get_block_table(parent, g)
    live = bm.get_block_table(parent, 1)[4:]
    assert all(bm.gpu.ref_counts[b] == 2 for b in live)
    bm.check_invariants()
