from __future__ import annotations

import pytest

from llmserve.errors import FieldError
from llmserve.steps import SequenceOutput, StepInput, StepResult, TokenLogprob
from scheduler_service.engine import (
    CacheConfig,
    FinishReason,
    LLMEngine,
    SamplingParams,
    SchedulerConfig,
)
from scheduler_service.engine.offline import generate

from .fake_model import FakeModel


class Scripted:
    """Executor returning fixed tokens: token_for(seq_id, step) -> token (logprob -1)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.steps: list[StepInput] = []
        self.computed: dict[int, tuple[int, int]] = {}

    def execute(self, step: StepInput) -> StepResult:
        self.steps.append(step)
        outs = []
        for s in step.new_seqs:
            self.computed[s.seq_id] = (
                s.num_computed_tokens + s.num_scheduled_tokens,
                len(s.token_ids),
            )
        for s in step.cached_seqs:
            done, n = self.computed[s.seq_id]
            self.computed[s.seq_id] = (done + s.num_scheduled_tokens, n + len(s.new_token_ids))
        for seq_id, (done, n) in self.computed.items():
            if done == n and any(x.seq_id == seq_id for x in step.new_seqs + step.cached_seqs):
                tok = self.tokens[(len(self.steps) - 1) % len(self.tokens)]
                outs.append(SequenceOutput(seq_id, [TokenLogprob(tok, -1.0, 1)]))
        return StepResult(step.step_id, outs)


def make_engine(executor, gpu=16, chunked=True, batched_tokens=64):
    return LLMEngine(
        # One token a step (`Scripted` answers no multi-step drafts).
        SchedulerConfig(8, batched_tokens, 64, chunked, decode_steps=1),
        CacheConfig(4, gpu, 8, watermark=0.0),
        executor,
    )


def test_steps_are_diffs():
    ex = Scripted([5, 6, 7, 8])
    engine = make_engine(ex)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3))
    deltas = engine.step()
    first = ex.steps[0]
    assert [
        (s.seq_id, s.token_ids, s.block_ids, s.num_scheduled_tokens) for s in first.new_seqs
    ] == [(0, [1, 2, 3], [0], 3)]
    assert [(d.request_id, d.outputs[0].token_ids, d.finished) for d in deltas] == [
        ("a", [5], False)
    ]
    engine.step()
    second = ex.steps[1].cached_seqs[0]
    assert (
        second.new_token_ids,
        second.block_offset,
        second.block_ids,
        second.num_scheduled_tokens,
    ) == ([5], 1, [], 1)
    deltas = engine.step()
    third = ex.steps[2].cached_seqs[0]
    assert (third.new_token_ids, third.block_offset, third.block_ids) == ([6], 1, [1])
    assert deltas[0].finished and deltas[0].outputs[0].finish_reason is FinishReason.LENGTH
    engine.step()
    assert ex.steps[3].freed_seq_ids == [0]


def test_bad_requests_raise_typed_errors_naming_the_field():
    engine = make_engine(Scripted([1]))
    engine.add_request("a", [1], SamplingParams())
    with pytest.raises(FieldError) as e:
        engine.add_request("a", [1], SamplingParams())
    assert e.value.field == "request_id"
    with pytest.raises(FieldError) as e:
        engine.add_request("b", [], SamplingParams())
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(FieldError) as e:
        engine.add_request("c", [1, -2], SamplingParams())
    assert e.value.field == "prompt_token_ids"
    assert engine.get_num_unfinished_requests() == 1


@pytest.mark.parametrize(
    ("params", "expected", "reason", "stop"),
    [
        (SamplingParams(max_tokens=10), [5, 9], FinishReason.STOP, 9),
        (SamplingParams(max_tokens=4, ignore_eos=True), [5, 9, 4, 5], FinishReason.LENGTH, None),
        (SamplingParams(max_tokens=10, min_tokens=3), [5, 9, 4, 5, 9], FinishReason.STOP, 9),
        (
            SamplingParams(max_tokens=10, stop_token_ids=(4,), ignore_eos=True),
            [5, 9, 4],
            FinishReason.STOP,
            4,
        ),
    ],
)
def test_token_level_stops(params, expected, reason, stop):
    engine = make_engine(Scripted([5, 9, 4]))
    [out] = generate(engine, [[1, 2]], params, eos_token_id=9)
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].finish_reason is reason
    assert out.outputs[0].stop_token_id == stop


def test_n_streams_choices_by_index_and_generate_accumulates():
    engine = make_engine(FakeModel(16, 8, 4))
    engine.add_request("a", [1, 2, 3], SamplingParams(n=3, max_tokens=4, logprobs=2))
    first = engine.step()
    assert [c.index for c in first[0].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 1 and len(c.logprobs[0].top) == 2 for c in first[0].outputs)
    step_input = engine.step() and engine.last_step_input
    assert [(f.parent_seq_id, f.child_seq_index) for f in step_input.forks] == [(0, 1), (0, 2)]
    [total] = generate(engine, [[1, 2, 3]], SamplingParams(n=3, max_tokens=4, logprobs=2))
    assert [len(c.token_ids) for c in total.outputs] == [4, 4, 4]
    assert [c.index for c in total.outputs] == [0, 1, 2]


def test_best_of_returns_top_n_by_cumulative_logprob_at_the_end():
    engine = make_engine(FakeModel(16, 8, 4))
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, best_of=4, max_tokens=3))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert len(deltas) == 1 and deltas[0].finished
    cums = [c.cumulative_logprob for c in deltas[0].outputs]
    assert len(cums) == 2 and cums == sorted(cums, reverse=True)


def test_beam_search_returns_best_beams_by_score_once():
    model = FakeModel(64, 8, 4)
    engine = make_engine(model, gpu=64)
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=5)
    engine.add_request("b", [3, 1, 4], params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert len(deltas) == 1
    outs = deltas[0].outputs
    assert [c.index for c in outs] == [0, 1]
    assert all(len(c.token_ids) == 5 for c in outs)
    scores = [c.cumulative_logprob / 5 for c in outs]
    assert scores[0] >= scores[1]
    engine.step()
    assert model.seqs == {}
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


def test_prompt_logprobs_come_once_across_chunks():
    engine = make_engine(FakeModel(16, 8, 4), batched_tokens=8)
    engine.add_request("p", list(range(1, 13)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    positions = []
    while engine.has_unfinished_requests():
        for d in engine.step():
            positions += [p.position for p in d.prompt_logprobs or []]
    assert positions == list(range(1, 12))


def test_stats_count_waiting_running_and_usage():
    engine = make_engine(FakeModel(16, 8, 4))
    engine.add_request("a", [1] * 8, SamplingParams(max_tokens=4))
    engine.add_request("b", [2] * 4, SamplingParams(max_tokens=4))
    assert engine.get_stats().num_waiting == 2
    engine.step()
    stats = engine.get_stats()
    assert (stats.num_waiting, stats.num_running, stats.num_swapped) == (0, 2, 0)
    assert stats.gpu_kv_usage == pytest.approx(3 / 16)  # 2 + 1 prompt blocks


def test_per_token_logprobs_are_kept_only_when_requested():
    engine = make_engine(Scripted([5, 6, 7]))
    engine.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=3))
    engine.add_request("lp", [1, 2, 4], SamplingParams(max_tokens=3, logprobs=0))
    plain, lp = (engine.scheduler.get_seq_group(r).seqs[0] for r in ("plain", "lp"))
    first = {d.request_id: d.outputs[0] for d in engine.step()}
    second = {d.request_id: d.outputs[0] for d in engine.step()}
    assert plain.output_logprobs == []
    assert [s.token.token_id for s in lp.output_logprobs] == [5, 6]
    assert plain.cumulative_logprob == lp.cumulative_logprob == -2.0
    assert first["plain"].logprobs is None and second["plain"].logprobs is None
    assert [s.token.token_id for s in first["lp"].logprobs + second["lp"].logprobs] == [5, 6]


def test_first_scheduled_time_is_set_on_admission_only():
    engine = make_engine(Scripted([5]), batched_tokens=8)
    engine.add_request("a", [1] * 8, SamplingParams(max_tokens=3))  # the whole token budget
    engine.add_request("b", [2] * 4, SamplingParams(max_tokens=3))
    a, b = (engine.scheduler.get_seq_group(r).metrics for r in ("a", "b"))
    engine.step()
    admitted = a.first_scheduled_time
    assert admitted is not None and b.first_scheduled_time is None
    engine.step()
    assert a.first_scheduled_time == admitted
    assert b.first_scheduled_time is not None and b.first_scheduled_time >= admitted
