"""ModelRunner through hand-built StepInputs on a tiny Llama, against HF greedy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.steps import CachedSequence, Fork, StepInput
from worker_service.model_runner import StateError

from .factories import (
    BLOCK_SIZE,
    GreedyDriver,
    blocks_for,
    hf_greedy,
    hf_logprobs,
    make_worker,
    new_seq,
)

PROMPTS = {
    0: [5, 17, 33, 2, 9, 41, 77, 12, 3, 99, 64],
    1: [8, 8, 21],
    2: [100, 3, 55, 6, 19, 27, 31, 90, 14, 66, 70, 71, 72, 11, 4, 38, 45],
    3: [7],
}


def test_batched_prefill_then_decodes_match_hf(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    outputs = GreedyDriver(make_worker(path)).run_greedy(PROMPTS, max_new_tokens=12)
    for seq_id, prompt in PROMPTS.items():
        assert outputs[seq_id] == hf_greedy(hf, prompt, 12), seq_id


def test_chunked_prefill_mixed_with_decode(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    worker = make_worker(path)
    long_prompt, short_prompt = PROMPTS[2], PROMPTS[0]
    long_blocks, short_blocks = blocks_for(0, 40), blocks_for(10, 40)
    # Step 0: first chunk (7 tokens) of the long prompt, the whole short prompt.
    first = worker.execute(
        StepInput(
            0,
            new_seqs=[
                new_seq(1, long_prompt, long_blocks, scheduled=7),
                new_seq(2, short_prompt, short_blocks),
            ],
        )
    )
    assert [o.seq_id for o in first.outputs] == [2]  # the chunk that stops short samples nothing
    short_out = [first.outputs[0].samples[0].token_id]
    # Step 1: second chunk (6), a decode of the short one. Step 2: the rest (4) + decode.
    second = worker.execute(
        StepInput(
            1,
            cached_seqs=[
                CachedSequence(1, [], 10, [], 6),
                CachedSequence(2, short_out[-1:], 10, [], 1),
            ],
        )
    )
    assert [o.seq_id for o in second.outputs] == [2]
    short_out.append(second.outputs[0].samples[0].token_id)
    third = worker.execute(
        StepInput(
            2,
            cached_seqs=[
                CachedSequence(1, [], 10, [], 4),
                CachedSequence(2, short_out[-1:], 10, [], 1),
            ],
        )
    )
    by_id = {o.seq_id: o.samples[0].token_id for o in third.outputs}
    short_out.append(by_id[2])
    assert by_id[1] == hf_greedy(hf, long_prompt, 1)[0]
    assert short_out == hf_greedy(hf, short_prompt, 3)


def test_prefix_cache_hit_computes_only_the_suffix(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    worker = make_worker(path)
    shared = PROMPTS[2][:12]  # 3 full blocks
    a, b = shared + [1, 2, 3], shared + [60, 61]
    worker.execute(StepInput(0, new_seqs=[new_seq(1, a, [0, 1, 2, 3])]))
    # b reuses blocks 0-2 (12 cached tokens) and gets its own block 4.
    out = worker.execute(StepInput(1, new_seqs=[new_seq(2, b, [0, 1, 2, 4], computed=12)]))
    assert out.outputs[0].samples[0].token_id == hf_greedy(hf, b, 1)[0]
    expected = hf_logprobs(hf, b)[-1]
    assert out.outputs[0].samples[0].logprob == pytest.approx(expected.max().item(), abs=1e-4)


def test_fork_then_copy_on_write_continues_both(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    worker = make_worker(path)
    prompt = PROMPTS[0]  # 11 tokens: blocks 0,1,2 (last one partly full)
    first = worker.execute(StepInput(0, new_seqs=[new_seq(1, prompt, [0, 1, 2])]))
    t = first.outputs[0].samples[0].token_id
    # Fork 1 -> 2; the child's last block is copied to block 7 before either writes to it.
    step = StepInput(
        1,
        forks=[Fork(1, 2, 1)],
        cached_seqs=[CachedSequence(1, [t], 3, [], 1), CachedSequence(2, [t], 2, [7], 1)],
        blocks_to_copy=[(2, 7)],
    )
    out = worker.execute(step)
    expected = hf_greedy(hf, prompt, 2)
    assert [o.samples[0].token_id for o in out.outputs] == [expected[1], expected[1]]


def test_swap_out_and_in_to_new_blocks_keeps_generation(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    worker = make_worker(path)
    prompt = PROMPTS[2]  # 17 tokens: 5 blocks
    out = worker.execute(StepInput(0, new_seqs=[new_seq(1, prompt, [0, 1, 2, 3, 4])]))
    tokens = [out.outputs[0].samples[0].token_id]
    # Swap out to host blocks 10-14, clobber the device blocks, swap back into blocks 20-24.
    worker.execute(StepInput(1, blocks_to_swap_out=[(i, 10 + i) for i in range(5)]))
    worker.cache_engine.device_cache[:5] = 7.0  # type: ignore[union-attr]
    out = worker.execute(
        StepInput(
            2,
            cached_seqs=[CachedSequence(1, tokens[-1:], 0, [20, 21, 22, 23, 24], 1)],
            blocks_to_swap_in=[(10 + i, 20 + i) for i in range(5)],
        )
    )
    tokens.append(out.outputs[0].samples[0].token_id)
    assert tokens == hf_greedy(hf, prompt, 2)


def test_recompute_after_free_reprefills_prompt_and_outputs(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    worker = make_worker(path)
    prompt = PROMPTS[0]
    expected = hf_greedy(hf, prompt, 4)
    worker.execute(StepInput(0, new_seqs=[new_seq(1, prompt, [0, 1, 2])]))
    # Preempted by recompute: freed, then re-sent with its first output as a new sequence.
    redo = new_seq(1, prompt + expected[:1], [5, 6, 7], num_prompt_tokens=len(prompt))
    out = worker.execute(StepInput(1, freed_seq_ids=[1], new_seqs=[redo]))
    assert out.outputs[0].samples[0].token_id == expected[1]
    assert worker.num_sequences == 1
    worker.execute(StepInput(2, freed_seq_ids=[1]))
    assert worker.num_sequences == 0


def test_block_size_covers_boundaries(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    prompt = list(range(3, 3 + 2 * BLOCK_SIZE))  # exactly two full blocks
    outputs = GreedyDriver(make_worker(path)).run_greedy(
        {0: prompt}, max_new_tokens=2 * BLOCK_SIZE + 1
    )
    assert outputs[0] == hf_greedy(hf, prompt, 2 * BLOCK_SIZE + 1)


def test_block_ids_outside_the_cache_are_refused(tiny_llama: tuple[Path, Any]) -> None:
    """The native kernels index the cache unchecked: the runner must refuse a bad table."""
    path, _ = tiny_llama
    worker = make_worker(path)
    worker.initialize_cache(16, 0)
    with pytest.raises(StateError, match="block id 99 is outside the cache"):
        worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPTS[0], [3, 99, 4])]))


def test_positions_past_the_rotary_table_are_refused(tiny_llama: tuple[Path, Any]) -> None:
    """The native rotary op reads its tables unchecked: the model checks positions per step."""
    path, _ = tiny_llama
    worker = make_worker(path, max_model_len=8)
    prompt = PROMPTS[2]  # 17 tokens, past the 8 positions of the table
    with pytest.raises(ValueError, match=r"positions: must lie in \[0, 8\)"):
        worker.execute(StepInput(0, new_seqs=[new_seq(1, prompt, blocks_for(0, len(prompt)))]))
    # Nothing was half-applied: a valid sequence still runs on the same worker.
    out = worker.execute(StepInput(1, new_seqs=[new_seq(2, PROMPTS[1], blocks_for(8, 3))]))
    assert [o.seq_id for o in out.outputs] == [2]


def test_a_worker_called_from_a_second_thread_warns_once(tiny_llama: tuple[Path, Any]) -> None:
    # On CPU a second thread that runs parallel regions brings a second OpenMP team, and
    # libgomp then sleeps at every barrier instead of spinning (steps ~20% slower).
    import concurrent.futures

    from structlog.testing import capture_logs

    path, _ = tiny_llama
    worker = make_worker(path)
    step = StepInput(0, new_seqs=[new_seq(0, PROMPTS[0], blocks_for(0, len(PROMPTS[0])))])
    with capture_logs() as same_thread:
        worker.execute(step)
    assert not [e for e in same_thread if e["log_level"] == "warning"]
    step = StepInput(1, new_seqs=[new_seq(1, PROMPTS[1], blocks_for(4, len(PROMPTS[1])))])
    again = StepInput(2, cached_seqs=[CachedSequence(1, [5], 1, [], 1)])
    with capture_logs() as other_thread, concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(worker.execute, step).result()
        pool.submit(worker.execute, again).result()
    warnings = [e for e in other_thread if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert "thread other than the one that constructed it" in warnings[0]["event"]
