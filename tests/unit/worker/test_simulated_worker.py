"""The simulated worker of the fleet benchmark (tests/support/simulated_worker.py) follows the
step contract as the real worker does: its tokens come from the sequence it holds, through
the sampled-token placeholder; its forward pass takes what the step-time model says; block
ids outside its cache are refused."""

from __future__ import annotations

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import SAMPLED_TOKEN, CachedSequence, Fork, MaskKind, StepInput, TokenMask
from tests.support.simulated_worker import (
    SimulatedConfig,
    SimulatedWorker,
    StepTimeModel,
    expected_tokens,
)
from worker_service.sequence_state import StateError

from .factories import new_seq

MODEL = StepTimeModel(fixed_ms=0.05, per_token_ms=0.01)
PROMPT = [5, 17, 33, 2, 9]


def make_worker() -> SimulatedWorker:
    worker = SimulatedWorker(SimulatedConfig(MODEL, block_size=4, max_model_len=64))
    worker.initialize_cache(8, 4)
    return worker


def test_tokens_follow_the_sequence_through_placeholders() -> None:
    worker = make_worker()
    first = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1])]))
    assert first.forward_ns >= int(MODEL.step_s(len(PROMPT)) * 1e9)
    decodes = [first.outputs[0].samples[0].token_id]
    for step_id in range(1, 4):
        result = worker.execute(
            StepInput(step_id, cached_seqs=[CachedSequence(1, [SAMPLED_TOKEN], 2, [], 1)])
        )
        assert result.forward_ns >= int(MODEL.step_s(1) * 1e9)
        decodes.append(result.outputs[0].samples[0].token_id)
    assert decodes == expected_tokens(PROMPT, 4)
    stats = worker.take_stats()
    assert (stats.steps, stats.tokens_computed, stats.tokens_sampled) == (4, len(PROMPT) + 3, 4)
    assert len(stats.gaps_ns) == 3


def test_multi_step_drafts_are_a_pass_each() -> None:
    worker = make_worker()
    first = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1, 2])]))
    decodes = [first.outputs[0].samples[0].token_id]
    own = CachedSequence(1, [SAMPLED_TOKEN], 3, [], 4, [SAMPLED_TOKEN] * 3)
    result = worker.execute(StepInput(1, cached_seqs=[own]))
    assert result.forward_ns >= int(4 * MODEL.step_s(1) * 1e9)  # four passes of one token
    decodes += [o.samples[0].token_id for o in result.outputs]
    assert [o.seq_id for o in result.outputs] == [1] * 4
    step = StepInput(2, cached_seqs=[CachedSequence(1, [SAMPLED_TOKEN], 3, [], 1)])
    decodes.append(worker.execute(step).outputs[0].samples[0].token_id)
    assert decodes == expected_tokens(PROMPT, 6)
    assert worker.runner.states[1].num_computed == len(PROMPT) + 5


def test_forks_sample_with_their_own_index() -> None:
    worker = make_worker()
    params = SamplingParams(n=2, temperature=0.8)
    first = worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1], params=params)]))
    a, b = (s.token_id for s in first.outputs[0].samples)
    step = StepInput(
        1,
        forks=[Fork(1, 2, 1)],
        cached_seqs=[CachedSequence(1, [a], 2, [], 1), CachedSequence(2, [b], 1, [2], 1)],
    )
    result = worker.execute(step)
    assert [(o.seq_id, o.samples[0].token_id) for o in result.outputs] == [
        (1, expected_tokens(PROMPT, 2, seq_index=0)[1]),
        (2, expected_tokens(PROMPT, 2, seq_index=1)[1]),
    ]
    assert worker.runner.states[2].block_ids == [0, 2]


def test_masks_sent_with_the_step_constrain_its_sample() -> None:
    worker = make_worker()
    free = expected_tokens(PROMPT, 1)[0]
    only = (free + 1) % worker.config.vocab_size
    mask = TokenMask(1, MaskKind.ALLOW, worker.config.vocab_size, [only])
    step = StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 1])], token_masks=[mask])
    assert worker.execute(step).outputs[0].samples[0].token_id == only


def test_blocks_outside_the_cache_are_refused() -> None:
    worker = make_worker()
    with pytest.raises(StateError, match="block id 99 is outside the cache"):
        worker.execute(StepInput(0, new_seqs=[new_seq(1, PROMPT, [0, 99])]))
    with pytest.raises(StateError, match="blocks_to_swap_out pair 0 -> 4"):
        worker.execute(StepInput(1, blocks_to_swap_out=[(0, 4)]))
