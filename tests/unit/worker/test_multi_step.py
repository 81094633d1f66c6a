"""Multi-step decoding on the tiny Llama worker: drafts that are all SAMPLED_TOKEN stand for the
worker's own samples (`llmserve.steps`), a forward pass each. A run of such steps equals HF
greedy, and a seeded one equals single steps with the tokens sent explicitly, also beside a
sequence prefilling in the same step; placeholders mixed with real drafts, or a mask for a
multi-step sequence, fail the step naming the sequence. A run the scheduler ends early
(`end_passes`) keeps the passes it ran, as if its later drafts were rejected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import SAMPLED_TOKEN, CachedSequence, MaskKind, StepInput, TokenMask
from worker_service.model_runner import StateError

from .factories import blocks_for, hf_greedy, make_worker, new_seq

PROMPT = [5, 17, 33, 2, 9, 41, 77, 12, 3, 99, 64]
OTHER = [8, 1, 30, 44, 6, 19, 2, 70, 13]
OWN = 3  # placeholder drafts per step: four tokens a step
STEPS = 3


def decode(
    path: Path, params: SamplingParams | None, own: int, beside: bool = False
) -> tuple[list[int], list[int]]:
    """Prefill, then STEPS steps computing 1 + `own` tokens each (`own` = 0: one token a step,
    sent explicitly). With `beside`, a second sequence prefills its prompt in two chunks
    during the first two steps. Returns the first sequence's tokens and the second's."""
    worker = make_worker(path)
    total = len(PROMPT) + STEPS * (1 + OWN) + 1
    blocks = blocks_for(0, total)
    other_blocks = blocks_for(len(blocks), len(OTHER) + 1)
    out = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks, params=params)]))
    tokens = [out.outputs[0].samples[0].token_id]
    other: list[int] = []
    step_id = 1
    while len(tokens) < 1 + STEPS * (1 + OWN):
        new_seqs = []
        cached = []
        if beside and step_id == 1:
            new_seqs.append(new_seq(2, OTHER, other_blocks, scheduled=5, params=params))
        elif beside and step_id == 2:
            cached.append(CachedSequence(2, [], len(other_blocks), [], len(OTHER) - 5))
        if own:
            drafts = [SAMPLED_TOKEN] * own
            cached.insert(0, CachedSequence(1, [SAMPLED_TOKEN], len(blocks), [], 1 + own, drafts))
        else:
            cached.insert(0, CachedSequence(1, tokens[-1:], len(blocks), [], 1))
        result = worker.execute(StepInput(step_id, new_seqs=new_seqs, cached_seqs=cached))
        mine = [o for o in result.outputs if o.seq_id == 1]
        assert len(mine) == 1 + own
        tokens += [o.samples[0].token_id for o in mine]
        other += [o.samples[0].token_id for o in result.outputs if o.seq_id == 2]
        step_id += 1
    state = worker.runner.states[1]
    assert state.token_ids == PROMPT + tokens[:-1]
    assert state.num_computed == len(state.token_ids)
    return tokens, other


def test_multi_step_decode_equals_hf_greedy(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    tokens, _ = decode(path, None, OWN)
    assert tokens == hf_greedy(hf, PROMPT, 1 + STEPS * (1 + OWN))


def test_multi_step_equals_single_steps_when_seeded_beside_a_prefill(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=64)
    single, single_other = decode(path, params, 0, beside=True)
    multi, multi_other = decode(path, params, OWN, beside=True)
    assert multi == single
    assert multi_other == single_other and len(single_other) == 1
    assert len(set(single)) > 1  # really sampled, not a constant


def test_a_run_ended_early_skips_the_update_built_past_it(tiny_llama: tuple[Path, Any]) -> None:
    """`passes_end` answers yes after the second pass: the step gives 2 of its 1 + OWN tokens
    and holds the first as computed; the continuation built assuming all OWN were kept
    (`after_drafts`) computes nothing; the scheduler then sends the run's last token, and the
    tokens equal HF greedy."""
    path, hf = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 4 * (1 + OWN))
    out = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, blocks)]))
    tokens = [out.outputs[0].samples[0].token_id]
    asked: list[int] = []
    end_at = [2]  # the ask that answers yes

    def passes_end() -> bool:  # asked before each pass after the first
        asked.append(len(asked))
        return len(asked) == end_at[0]

    drafts = [SAMPLED_TOKEN] * OWN

    def run(step_id: int, new: list[int], **kwargs: Any) -> list[int]:
        update = CachedSequence(1, new, len(blocks), [], 1 + OWN, drafts, **kwargs)
        result = worker.execute(StepInput(step_id, cached_seqs=[update]), passes_end=passes_end)
        return [o.samples[0].token_id for o in result.outputs]

    ended = run(1, [SAMPLED_TOKEN])
    assert len(ended) == 2 and len(asked) == 2
    tokens += ended
    state = worker.runner.states[1]
    assert state.token_ids == PROMPT + tokens[:-1]
    assert state.num_computed == len(state.token_ids)
    end_at[0] = 0  # from here on every run goes to its end
    assert run(2, [SAMPLED_TOKEN], after_drafts=True) == []
    assert state.token_ids == PROMPT + tokens[:-1]
    tokens += run(3, tokens[-1:])
    assert len(tokens) == 3 + 1 + OWN
    tokens += run(4, [SAMPLED_TOKEN], after_drafts=True)  # a run that ended: not skipped
    assert tokens == hf_greedy(hf, PROMPT, len(tokens))
    assert len(tokens) == 3 + 2 * (1 + OWN)


def test_placeholders_mixed_with_drafts_fail_the_step(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 8)
    worker.execute(StepInput(0, new_seqs=[new_seq(4, PROMPT, blocks)]))
    drafts = [SAMPLED_TOKEN, 17]
    step = StepInput(
        1, cached_seqs=[CachedSequence(4, [SAMPLED_TOKEN], len(blocks), [], 3, drafts)]
    )
    with pytest.raises(StateError, match="seq 4: 1 of 2 drafts are the sampled-token placeholder"):
        worker.execute(step)


def test_a_mask_for_a_multi_step_sequence_fails_the_step(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 8)
    worker.execute(StepInput(0, new_seqs=[new_seq(6, PROMPT, blocks)]))
    update = CachedSequence(6, [SAMPLED_TOKEN], len(blocks), [], 3, [SAMPLED_TOKEN] * 2)
    mask = TokenMask(6, MaskKind.ALLOW, 128, [1, 2])
    with pytest.raises(StateError, match="seq 6: a token mask for multi-step decoding"):
        worker.execute(StepInput(1, cached_seqs=[update], token_masks=[mask]))


def test_multi_step_past_the_block_table_fails_the_step(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 1)  # room for the next token, not three more
    worker.execute(StepInput(0, new_seqs=[new_seq(8, PROMPT, blocks)]))
    update = CachedSequence(8, [SAMPLED_TOKEN], len(blocks), [], 4, [SAMPLED_TOKEN] * 3)
    with pytest.raises(StateError, match="seq 8: scheduled past its block table"):
        worker.execute(StepInput(1, cached_seqs=[update]))
