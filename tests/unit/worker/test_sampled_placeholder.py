"""The SAMPLED_TOKEN placeholder (asynchronous scheduling) on the tiny Llama worker: the worker
fills in the token it sampled itself, so a pipelined decode equals HF greedy and a seeded one
equals the same steps with the tokens sent explicitly; a placeholder with nothing sampled
behind it fails the step, naming the sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import SAMPLED_TOKEN, CachedSequence, StepInput
from worker_service.model_runner import StateError

from .factories import blocks_for, hf_greedy, make_worker, new_seq

PROMPT = [5, 17, 33, 2, 9, 41, 77, 12, 3, 99, 64]
STEPS = 9


def decode(path: Path, params: SamplingParams | None, placeholders: bool) -> list[int]:
    """Prefill, then STEPS decode steps; with `placeholders` every decode step names the
    previous sample by SAMPLED_TOKEN instead of sending it."""
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + STEPS + 1)
    seq = new_seq(1, PROMPT, blocks, params=params)
    out = worker.execute(StepInput(0, new_seqs=[seq]))
    tokens = [out.outputs[0].samples[0].token_id]
    for step_id in range(1, STEPS + 1):
        new = [SAMPLED_TOKEN] if placeholders else tokens[-1:]
        out = worker.execute(
            StepInput(step_id, cached_seqs=[CachedSequence(1, new, len(blocks), [], 1)])
        )
        tokens.append(out.outputs[0].samples[0].token_id)
    assert worker.runner.states[1].token_ids == PROMPT + tokens[:-1]
    return tokens


def test_placeholder_decode_equals_hf_greedy(tiny_llama: tuple[Path, Any]) -> None:
    path, hf = tiny_llama
    assert decode(path, None, placeholders=True) == hf_greedy(hf, PROMPT, STEPS + 1)


def test_placeholder_decode_equals_explicit_tokens_when_seeded(
    tiny_llama: tuple[Path, Any],
) -> None:
    path, _ = tiny_llama
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=64)
    explicit = decode(path, params, placeholders=False)
    assert decode(path, params, placeholders=True) == explicit
    assert len(set(explicit)) > 1  # really sampled, not a constant


def test_placeholder_without_a_sample_fails_the_step(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 4)
    # A prefill chunk that stops short of the prompt's end samples nothing.
    worker.execute(StepInput(0, new_seqs=[new_seq(7, PROMPT, blocks, scheduled=4)]))
    step = StepInput(1, cached_seqs=[CachedSequence(7, [SAMPLED_TOKEN], len(blocks), [], 1)])
    with pytest.raises(StateError, match="seq 7: .*sampled nothing"):
        worker.execute(step)


def test_placeholder_is_used_once(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 4)
    worker.execute(StepInput(0, new_seqs=[new_seq(3, PROMPT, blocks)]))
    # An update that computes nothing consumes the placeholder, and samples nothing.
    worker.execute(StepInput(1, cached_seqs=[CachedSequence(3, [SAMPLED_TOKEN], 3, [], 0)]))
    step = StepInput(2, cached_seqs=[CachedSequence(3, [SAMPLED_TOKEN], 3, [], 1)])
    with pytest.raises(StateError, match="seq 3: .*sampled nothing"):
        worker.execute(step)


def test_placeholder_followed_by_known_tokens(tiny_llama: tuple[Path, Any]) -> None:
    # A grammar's forced tokens: the step after the prefill computes the prefill's sample and
    # two tokens the scheduler appended after it, then samples what HF greedy gives there.
    path, hf = tiny_llama
    worker = make_worker(path)
    blocks = blocks_for(0, len(PROMPT) + 4)
    first = worker.execute(StepInput(0, new_seqs=[new_seq(4, PROMPT, blocks)]))
    sampled = first.outputs[0].samples[0].token_id
    step = StepInput(1, cached_seqs=[CachedSequence(4, [SAMPLED_TOKEN, 7, 8], len(blocks), [], 3)])
    out = worker.execute(step)
    assert worker.runner.states[4].token_ids == [*PROMPT, sampled, 7, 8]
    expected = hf_greedy(hf, [*PROMPT, sampled, 7, 8], 1)
    assert [out.outputs[0].samples[0].token_id] == expected


def test_placeholder_must_come_first_and_once(tiny_llama: tuple[Path, Any]) -> None:
    path, _ = tiny_llama
    for new in ([5, SAMPLED_TOKEN], [SAMPLED_TOKEN, SAMPLED_TOKEN]):
        worker = make_worker(path)
        blocks = blocks_for(0, len(PROMPT) + 4)
        worker.execute(StepInput(0, new_seqs=[new_seq(4, PROMPT, blocks)]))
        step = StepInput(1, cached_seqs=[CachedSequence(4, new, 3, [], 2)])
        with pytest.raises(StateError, match="must be the first new token"):
            worker.execute(step)
