"""Draft tokens (speculative decoding) on the tiny Llama worker, driven step by step: the
worker verifies drafts in one pass, returns one output per token produced, keeps what it
kept as known tokens, and refuses drafts the contract does not allow, naming the sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import SAMPLED_TOKEN, CachedSequence, MaskKind, StepInput, TokenMask
from worker_service.model_runner import StateError

from .factories import blocks_for, hf_greedy, make_worker, new_seq

PROMPT = [5, 17, 33, 2, 9, 41, 77, 12, 3, 99, 64]


def test_a_run_of_right_then_wrong_drafts(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    greedy = hf_greedy(hf, PROMPT, 8)
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 10)
    out = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks)]))
    assert out.outputs[0].samples[0].token_id == greedy[0]
    # Two right drafts, then a wrong one, then one never looked at.
    wrong = (greedy[3] + 1) % 128
    drafts = [greedy[1], greedy[2], wrong, greedy[4]]
    step = StepInput(1, cached_seqs=[CachedSequence(1, [greedy[0]], len(blocks), [], 5, drafts)])
    out = worker.execute(step)
    assert [o.seq_id for o in out.outputs] == [1, 1, 1]
    assert [o.samples[0].token_id for o in out.outputs] == greedy[1:4]
    state = worker.runner.states[1]
    assert state.token_ids == PROMPT + greedy[:3]
    assert state.num_computed == len(PROMPT) + 3
    # The next step goes on from the last sample, writing over the rejected drafts' slots.
    step = StepInput(2, cached_seqs=[CachedSequence(1, [greedy[3]], len(blocks), [], 1)])
    assert worker.execute(step).outputs[0].samples[0].token_id == greedy[4]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("after_a_chunk", "drafts follow one known token"),
        ("beam", "beam search cannot have drafts"),
        ("short", "must end the step's scheduled tokens"),
    ],
)
def test_drafts_the_contract_refuses(tiny_llama: tuple[Path, Any], case: str, message: str) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 10)
    params = SamplingParams(use_beam_search=True, n=2, temperature=0.0) if case == "beam" else None
    worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks, params=params)]))
    new, scheduled = [7], 3
    if case == "after_a_chunk":
        new, scheduled = [7, 8], 4  # two known tokens computed before the drafts
    elif case == "short":
        scheduled = 2
    step = StepInput(1, cached_seqs=[CachedSequence(1, new, len(blocks), [], scheduled, [4, 6])])
    with pytest.raises(StateError, match=f"seq 1: .*{message}"):
        worker.execute(step)


def test_each_draft_row_samples_under_its_own_mask(tiny_llama: tuple[Path, Any]) -> None:
    """A constrained sequence's drafts: row i samples under the mask of row i (the grammar
    after the drafts before it). Row 0's mask refuses a token it would not sample; row 2's
    allows one token, not the greedy one, so the third draft is not kept and the run ends
    with that token."""
    path, hf = tiny_llama
    greedy = hf_greedy(hf, PROMPT, 4)
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 10)
    worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks)]))
    other = (greedy[3] + 5) % 128
    drafts = [greedy[1], greedy[2], greedy[3]]
    step = StepInput(
        1,
        cached_seqs=[CachedSequence(1, [greedy[0]], len(blocks), [], 4, drafts)],
        token_masks=[
            TokenMask(1, MaskKind.DENY, 128, [(greedy[1] + 1) % 128], row=0),
            TokenMask(1, MaskKind.ALLOW, 128, [other], row=2),
        ],
    )
    out = worker.execute(step)
    assert [o.samples[0].token_id for o in out.outputs] == [greedy[1], greedy[2], other]
    assert worker.runner.states[1].token_ids == PROMPT + greedy[:3]


@pytest.mark.parametrize("all_right", [True, False], ids=["kept", "cut"])
def test_an_update_after_drafts_runs_only_if_they_were_all_kept(
    tiny_llama: tuple[Path, Any], all_right: bool
) -> None:
    """Asynchronous scheduling sends the next update before the drafts' result: the
    placeholder at the position after every draft, its own drafts, a longer table. The worker
    computes it if the drafts were all kept; otherwise it applies the table alone, returns
    nothing for the sequence, and the next update goes on from what was kept."""
    path, hf = tiny_llama
    greedy = hf_greedy(hf, PROMPT, 10)
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 4)
    more = blocks_for(len(blocks), 12)
    worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks)]))
    drafts = [greedy[1], greedy[2] if all_right else (greedy[2] + 1) % 128]
    step = StepInput(1, cached_seqs=[CachedSequence(1, [greedy[0]], len(blocks), [], 3, drafts)])
    assert len(worker.execute(step).outputs) == (3 if all_right else 2)
    after = CachedSequence(
        1, [SAMPLED_TOKEN], len(blocks), more, 3, [greedy[4], greedy[5]], after_drafts=True
    )
    out = worker.execute(StepInput(2, cached_seqs=[after]))
    state = worker.runner.states[1]
    assert state.block_ids == blocks + more
    if all_right:  # greedy[3] sampled after the drafts, then two right drafts and a sample
        assert [o.samples[0].token_id for o in out.outputs] == greedy[4:7]
        assert state.token_ids == PROMPT + greedy[:6]
        return
    assert out.outputs == []
    assert state.token_ids == PROMPT + greedy[:2]  # what the drafts step kept
    step = StepInput(
        3, cached_seqs=[CachedSequence(1, [greedy[2]], len(blocks) + len(more), [], 1)]
    )
    assert worker.execute(step).outputs[0].samples[0].token_id == greedy[3]
