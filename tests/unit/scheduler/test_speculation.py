"""Speculative decoding through the engine on the fake model: drafts never change what is
streamed. A proposer that always drafts the model's next tokens has every draft kept and
takes fewer steps; one that always drafts wrong tokens has none kept; both stream exactly
what a run without drafts streams, under preemption, stop tokens, min_tokens, logprobs and
asynchronous scheduling; aborted streams are prefixes of the full ones; every block comes
back (`drive` checks)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest

from llmserve.sampling_params import SamplingParams
from llmserve.steps import StepInput, StepResult
from scheduler_service.engine import LLMEngine
from scheduler_service.engine.proposer import DraftProposer, DraftState
from scheduler_service.engine.speculation import Speculator
from tests.support.drafts import TokenList

from .fake_model import FakeModel
from .test_async_scheduling import PipelinedEngineMachine, drive
from .test_stateful import EngineMachine

K = 4


class OracleProposer(DraftProposer):
    """Drafts what the fake model will sample next (`wrong`: one token off, never kept)."""

    def __init__(self, model: FakeModel, wrong: bool = False) -> None:
        self.model = model
        self.wrong = wrong
        self.states: list[TokenList] = []

    def new_state(self, tokens: Sequence[int]) -> TokenList:
        self.states.append(TokenList(tokens))
        return self.states[-1]

    def propose(self, state: DraftState, max_tokens: int, assumed: Sequence[int] = ()) -> list[int]:
        assert isinstance(state, TokenList)
        tokens = [*state.tokens, *assumed]
        drafts = []
        for _ in range(min(K, max_tokens)):
            token = self.model.next_token(tokens)
            if self.wrong:
                token = (token + 1) % self.model.vocab_size
            drafts.append(token)
            tokens.append(token)
        return drafts


def with_oracle(wrong: bool):
    def setup(engine: LLMEngine, model: FakeModel) -> None:
        scheduler = engine.scheduler
        scheduler.speculator = Speculator(
            scheduler.scheduler_config, scheduler.block_manager, OracleProposer(model, wrong)
        )

    return setup


def recorded(engine: LLMEngine) -> tuple[int, int]:
    """Drafts and kept drafts as the proposer's states were told of them (`record`)."""
    proposer = engine.scheduler.speculator.proposer
    assert isinstance(proposer, OracleProposer)
    records = [r for state in proposer.states for r in state.records]
    return sum(d for d, _ in records), sum(k for _, k in records)


# How steps run: one at a time; one ahead (a step with drafts waits for its result); one
# ahead also after drafts (`continue_after_drafts`: assumed kept).
MODES = {"sync": (False, False), "async": (True, False), "async-after-drafts": (True, True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
def test_right_drafts_are_all_kept_in_fewer_steps(num_gpu_blocks: int, mode: str) -> None:
    pipelined, after_drafts = MODES[mode]
    plain, _, plain_model = drive(num_gpu_blocks, pipelined)
    spec, engine, model = drive(
        num_gpu_blocks,
        pipelined,
        setup=with_oracle(wrong=False),
        num_speculative_tokens=K,
        speculative_max_batch=64,
        speculative_max_seqs=64,
        continue_after_drafts=after_drafts,
    )
    assert spec == plain
    stats = engine.get_stats()
    assert stats.num_spec_drafts > 50
    # A draft is dropped only where the run stops (a stop token, max_tokens, an abort).
    assert stats.num_spec_accepted_tokens == model.num_drafts_kept
    assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_draft_tokens
    assert recorded(engine) == (stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens)
    assert list(stats.spec_accepted_per_position) == sorted(
        stats.spec_accepted_per_position, reverse=True
    )
    assert model.num_skipped_after_drafts == 0  # none assumed kept drafts in vain
    assert (model.num_after_drafts > 0) == after_drafts
    assert model.num_steps < 0.8 * plain_model.num_steps
    if num_gpu_blocks == 60:
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap >= 5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
def test_wrong_drafts_are_never_kept_and_change_nothing(num_gpu_blocks: int, mode: str) -> None:
    pipelined, after_drafts = MODES[mode]
    plain, _, _ = drive(num_gpu_blocks, pipelined)
    spec, engine, model = drive(
        num_gpu_blocks,
        pipelined,
        setup=with_oracle(wrong=True),
        num_speculative_tokens=K,
        speculative_max_batch=64,
        speculative_max_seqs=64,
        continue_after_drafts=after_drafts,
    )
    assert spec == plain
    stats = engine.get_stats()
    assert stats.num_spec_draft_tokens > 100
    assert stats.num_spec_accepted_tokens == model.num_drafts_kept == 0
    assert recorded(engine) == (stats.num_spec_draft_tokens, 0)
    assert model.num_after_drafts == 0  # every update that assumed kept drafts was skipped
    assert (model.num_skipped_after_drafts > 0) == after_drafts


@pytest.mark.parametrize("num_gpu_blocks", [400, 60])
def test_continuations_chain_drafts_and_drop_the_ones_that_assumed_wrong(
    num_gpu_blocks: int,
) -> None:
    """Asynchronous scheduling with drafts that are sometimes right: a continuation built
    while a step with drafts runs assumes they are all kept; where they are, it runs (with
    drafts of its own), where they are not, the worker skips it and the scheduler drops it.
    Same streams as without drafts, every block back (`drive`). Four single-sequence
    requests (greedy, seeded sampling, stop tokens, logprobs): a continuation needs every
    running sequence's step to go on, so few sequences make long chains."""

    def single(num: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
        rng = random.Random(seed)
        prompts = [[rng.randrange(1, 64) for _ in range(rng.randrange(2, 24))] for _ in range(num)]
        params = [
            SamplingParams(
                temperature=0.0 if i % 3 else 1.0,
                seed=i,
                max_tokens=rng.randrange(20, 60),
                stop_token_ids=[5] if i % 4 == 1 else [],
                logprobs=1 if i % 5 == 2 else None,
            )
            for i in range(num)
        ]
        return prompts, params

    plain, _, _ = drive(num_gpu_blocks, True, num=4, make_workload=single)

    def setup(engine: LLMEngine, model: FakeModel) -> None:
        scheduler = engine.scheduler
        scheduler.speculator = Speculator(
            scheduler.scheduler_config, scheduler.block_manager, MixedProposer(model)
        )

    spec, engine, model = drive(
        num_gpu_blocks,
        True,
        num=4,
        make_workload=single,
        setup=setup,
        num_speculative_tokens=K,
        speculative_max_batch=64,
        speculative_max_seqs=64,
        continue_after_drafts=True,
    )
    assert spec == plain
    # All of a step's drafts right: about one in five (fewer steps continue under preemption).
    assert model.num_after_drafts >= (4 if num_gpu_blocks == 400 else 1)
    assert model.num_skipped_after_drafts > 10
    stats = engine.get_stats()
    # Each update sent assuming kept drafts ran or was skipped; the running ones skipped were
    # dropped (one whose run ended in a stop is skipped, not dropped: it is finished).
    assert stats.num_spec_after_drafts == model.num_after_drafts + model.num_skipped_after_drafts
    assert 0 < stats.num_spec_after_drafts_dropped <= model.num_skipped_after_drafts
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


def test_drafts_keep_a_step_within_the_row_limit() -> None:
    """A step's sequences plus its drafts never pass `speculative_max_batch`."""
    plain, _, _ = drive(400, False)
    limit = 12
    rows: list[int] = []  # per step with drafts: sequences + draft tokens

    def setup(engine: LLMEngine, model: FakeModel) -> None:
        with_oracle(wrong=False)(engine, model)
        execute = model.execute

        def counting(step: StepInput) -> StepResult:
            if step.num_draft_tokens:
                rows.append(len(step.new_seqs) + len(step.cached_seqs) + step.num_draft_tokens)
            return execute(step)

        model.execute = counting  # type: ignore[method-assign]

    spec, _, _ = drive(
        400,
        False,
        setup=setup,
        num_speculative_tokens=K,
        speculative_max_batch=limit,
        speculative_max_seqs=64,
    )
    assert spec == plain
    assert len(rows) > 5
    assert max(rows) == limit


def test_aborted_streams_are_prefixes_and_free_their_blocks() -> None:
    full, _, _ = drive(60, True)
    aborts = {5: 2, 6: 4, 7: 1, 9: 5, 14: 7, 24: 3}
    spec, _, _ = drive(
        60,
        True,
        abort_after=aborts,
        setup=with_oracle(wrong=False),
        num_speculative_tokens=K,
        speculative_max_batch=64,
        speculative_max_seqs=64,
    )
    for request_id, choices in spec.items():
        for index, (tokens, reason) in choices.items():
            whole, whole_reason = full[request_id][index]
            assert tokens == whole[: len(tokens)]
            if reason is not None:
                assert (tokens, reason) == (whole, whole_reason)
    assert any(
        len(spec[f"r{i}"][0][0]) < len(full[f"r{i}"][0][0]) for i in aborts if f"r{i}" in spec
    )


class MixedProposer(OracleProposer):
    """Right drafts, except at positions a hash picks (about one in three), where the draft
    and the ones after it are off by one."""

    def propose(self, state: DraftState, max_tokens: int, assumed: Sequence[int] = ()) -> list[int]:
        assert isinstance(state, TokenList)
        tokens = [*state.tokens, *assumed]
        drafts: list[int] = []
        wrong = False
        for _ in range(min(K, max_tokens)):
            token = self.model.next_token(tokens)
            wrong = wrong or hash((len(tokens), tokens[-1])) % 3 == 0
            drafts.append((token + 1) % self.model.vocab_size if wrong else token)
            tokens.append(drafts[-1])
        return drafts


class SpeculatingEngineMachine(EngineMachine):
    """The stateful add / step / abort machine (forks, beam search, preemption by memory
    pressure and priority) with drafts on: the blocks stay consistent after every step and
    all come back."""

    def __init__(self) -> None:
        super().__init__()
        scheduler = self.engine.scheduler
        config = replace(
            scheduler.scheduler_config, num_speculative_tokens=K, speculative_max_seqs=64
        )
        model = self.engine.executor
        assert isinstance(model, FakeModel)
        scheduler.speculator = Speculator(config, scheduler.block_manager, MixedProposer(model))


SpeculatingEngineMachine.TestCase.settings = EngineMachine.TestCase.settings
TestSpeculatingEngineMachine = SpeculatingEngineMachine.TestCase


class PipelinedSpeculatingEngineMachine(PipelinedEngineMachine):
    """The same machine one step ahead: continuations assume the drafts in flight are kept
    and carry drafts of their own; the blocks stay consistent after every step, all come
    back, and the worker holds nothing at the end (`PipelinedEngineMachine.teardown`)."""

    def __init__(self) -> None:
        super().__init__()
        scheduler = self.engine.scheduler
        config = replace(
            scheduler.scheduler_config,
            num_speculative_tokens=K,
            continue_after_drafts=True,
            speculative_max_seqs=64,
        )
        scheduler.scheduler_config = config
        model = self.engine.executor
        assert isinstance(model, FakeModel)
        scheduler.speculator = Speculator(config, scheduler.block_manager, MixedProposer(model))


PipelinedSpeculatingEngineMachine.TestCase.settings = PipelinedEngineMachine.TestCase.settings
TestPipelinedSpeculatingEngineMachine = PipelinedSpeculatingEngineMachine.TestCase
