"""Requests moved between engines (a drained or lost replica) finish exactly as if they had
never moved: same tokens, logprobs, finish reasons, prompt logprobs once per position. Each
engine runs its own FakeModel over its own simulated cache, so a moved sequence's context is
really recomputed from its tokens on the target."""

from __future__ import annotations

import random

import pytest

from llmserve.errors import FieldError
from llmserve.limits import prompt_too_long
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import accumulate as _accumulate
from scheduler_service.engine.offline import generate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from scheduler_service.engine.snapshots import SequenceSnapshot, snapshot_from_choices

from .fake_model import FakeModel
from .test_preemption_equivalence import BLOCK, EOS, workload


def make_engine(
    num_gpu_blocks: int,
    num_cpu_blocks: int,
    caching: bool = True,
    windows: tuple[int | None, ...] = (None,),
) -> LLMEngine:
    cache = CacheConfig(
        BLOCK,
        num_gpu_blocks,
        num_cpu_blocks,
        watermark=0.0,
        enable_prefix_caching=caching,
        kv_windows=windows,
    )
    sched = SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=96, max_model_len=128)
    model = FakeModel(num_gpu_blocks, num_cpu_blocks, BLOCK, windows=windows)
    return LLMEngine(sched, cache, model)


def summarize(outputs: list[RequestOutput]) -> list[tuple]:
    return [
        (
            o.request_id,
            [
                (
                    c.index,
                    c.token_ids,
                    round(c.cumulative_logprob, 9),
                    c.finish_reason,
                    c.stop_token_id,
                    None if c.logprobs is None else [lp.token.token_id for lp in c.logprobs],
                )
                for c in o.outputs
            ],
            None if o.prompt_logprobs is None else [p.position for p in o.prompt_logprobs],
        )
        for o in outputs
    ]


def assert_empty(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks - bm.num_reserved
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks


def reference(num: int, windows: tuple[int | None, ...] = (None,)) -> list[tuple]:
    engine = make_engine(4000, 8, windows=windows)
    prompts, params = workload(num)
    outputs = generate(engine, prompts, params, eos_token_id=EOS)
    return summarize([_renamed(o, f"r{i}") for i, o in enumerate(outputs)])


def _renamed(output: RequestOutput, request_id: str) -> RequestOutput:
    output.request_id = request_id
    return output


def test_requests_moved_between_engines_mid_run_finish_as_if_they_never_moved():
    """Two small engines (preemptions on both) hand random subsets of their requests to each
    other every few steps, half of the time between begin_step and finish_step (the step's
    results for the moved requests must then be ignored)."""
    num = 120
    engines = [make_engine(48, 64), make_engine(36, 0)]
    prompts, params = workload(num)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engines[i % 2].add_request(f"r{i}", prompt, p, eos_token_id=EOS)
    rng = random.Random(7)
    totals: dict[str, RequestOutput] = {}
    finished: set[str] = set()
    moved = 0
    for step in range(5000):
        if len(finished) == num:
            break
        for side, engine in enumerate(engines):
            other = engines[1 - side]
            sched_out, step_input = engine.begin_step()
            mid_step = step % 7 == 3 and rng.random() < 0.5
            if mid_step:
                moved += _move_some(engine, other, rng)
            result = None if step_input.is_empty() else engine.executor.execute(step_input)
            for delta in engine.finish_step(sched_out, step_input, result):
                totals[delta.request_id] = _accumulate(totals.get(delta.request_id), delta)
                if delta.finished:
                    assert delta.request_id not in finished
                    finished.add(delta.request_id)
            if step % 7 == 3 and not mid_step:
                moved += _move_some(engine, other, rng)
    assert len(finished) == num
    assert moved >= 50
    for engine in engines:
        assert_empty(engine)
    assert engines[1].get_stats().num_preemptions_recompute > 0
    got = summarize([totals[f"r{i}"] for i in range(num)])
    assert got == reference(num)


def _move_some(source: LLMEngine, target: LLMEngine, rng: random.Random) -> int:
    ids = source.unfinished_request_ids()
    chosen = [i for i in ids if rng.random() < 0.4]
    for snapshot in source.export_requests(chosen):
        target.import_request(snapshot)
    return len(chosen)


def test_zero_swap_space_preempts_groups_with_several_sequences_by_recompute():
    """n > 1, best_of and beam groups on a cache too small for them and no host swap space:
    preempted by recompute (siblings together), outputs unchanged."""
    num = 80
    engine = make_engine(40, 0)
    prompts, params = workload(num)
    outputs = generate(engine, prompts, params, eos_token_id=EOS)
    stats = engine.get_stats()
    assert stats.num_preemptions_swap == 0
    assert stats.num_preemptions_recompute >= 10
    assert_empty(engine)
    assert summarize([_renamed(o, f"r{i}") for i, o in enumerate(outputs)]) == reference(num)


def test_a_request_resumed_from_its_streamed_choices_continues_exactly():
    """What a gateway was sent of an n=3 request, turned back into a request on a fresh
    engine, continues with the tokens the uninterrupted run produced."""
    prompt = [5, 9, 13, 2, 7, 31, 8]
    params = SamplingParams(n=3, max_tokens=12, logprobs=1, seed=42)
    full = generate(make_engine(200, 0), [prompt], params, eos_token_id=EOS)[0]

    engine = make_engine(200, 0)
    engine.add_request("a", prompt, params, eos_token_id=EOS)
    sent: dict[int, SequenceSnapshot] = {}
    for _ in range(4):  # the prefill, then three decodes
        for delta in engine.step():
            for c in delta.outputs:
                record = sent.setdefault(
                    c.index, SequenceSnapshot(c.index, [], [], 0.0, None, None)
                )
                record.output_token_ids.extend(c.token_ids)
                record.output_logprobs.extend(c.logprobs or [])
                record.cumulative_logprob = c.cumulative_logprob
                record.finish_reason = c.finish_reason
                record.stop_token_id = c.stop_token_id
    engine.abort_request("a")
    assert_empty(engine)
    assert sorted(sent) == [0, 1, 2] and all(s.output_token_ids for s in sent.values())

    resumed = make_engine(200, 0)
    snapshot = snapshot_from_choices("a", prompt, params, EOS, 0.0, list(sent.values()))
    resumed.import_request(snapshot)
    total = None
    while resumed.has_unfinished_requests():
        for delta in resumed.step():
            total = _accumulate(total, delta)
    assert total is not None and total.finished
    for record in sent.values():  # the resumed run emits only what is new
        choice = next(c for c in total.outputs if c.index == record.seq_index)
        record.output_token_ids.extend(choice.token_ids)
        record.output_logprobs.extend(choice.logprobs or [])
        record.cumulative_logprob = choice.cumulative_logprob
        record.finish_reason = choice.finish_reason
    expected = {c.index: c for c in full.outputs}
    for index, record in sent.items():
        want = expected[index]
        assert record.output_token_ids == want.token_ids
        assert [lp.token.token_id for lp in record.output_logprobs] == want.token_ids
        assert record.cumulative_logprob == pytest.approx(want.cumulative_logprob)
        assert record.finish_reason == want.finish_reason
    assert_empty(resumed)


def test_an_imported_request_with_every_choice_finished_completes_at_the_next_step():
    engine = make_engine(64, 0)
    done = SequenceSnapshot(0, [3, 4], [], -1.5, FinishReason.LENGTH, None)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.import_request(snapshot_from_choices("x", [1, 2, 3], params, EOS, 0.0, [done]))
    assert engine.has_unfinished_requests()
    (output,) = engine.step()
    assert output.finished and output.request_id == "x"
    assert output.outputs[0].token_ids == [3, 4]
    assert output.outputs[0].finish_reason == FinishReason.LENGTH
    assert not engine.has_unfinished_requests()
    assert_empty(engine)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(n=2, best_of=64, max_tokens=4), "sampling_params.best_of"),
        (
            SamplingParams(n=2, best_of=60, use_beam_search=True, temperature=0.0, max_tokens=4),
            "sampling_params.n",
        ),
    ],
)
def test_more_sequences_than_max_num_seqs_is_refused_and_others_run(params, field):
    engine = make_engine(200, 0)  # max_num_seqs=48
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(FieldError) as info:
        engine.add_request("big", [1, 2, 3], params)
    assert info.value.field == field
    with pytest.raises(FieldError):
        engine.import_request(snapshot_from_choices("big", [1, 2, 3], params, None, 0.0, []))
    outputs = generate(engine, [[4, 5]], SamplingParams(max_tokens=2, temperature=0.0))
    assert outputs[0].finished
    while engine.has_unfinished_requests():
        engine.step()
    assert_empty(engine)


def test_import_refuses_what_the_replica_can_never_run():
    engine = make_engine(8, 0)  # 8 blocks of 4 tokens; max_model_len 128
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(FieldError) as info:
        engine.import_request(snapshot_from_choices("long", [1] * 129, params, None, 0.0, []))
    assert info.value.field == "prompt" and "max_model_len" in str(info.value)
    # A prompt must leave room for one generated token (llmserve.limits, the gateway's rule).
    with pytest.raises(FieldError) as info:
        engine.import_request(snapshot_from_choices("full", [1] * 128, params, None, 0.0, []))
    assert (info.value.field, info.value.detail) == ("prompt", prompt_too_long(128, 128))
    with pytest.raises(FieldError) as info:
        engine.import_request(snapshot_from_choices("big", [1] * 40, params, None, 0.0, []))
    assert info.value.field == "prompt" and "KV blocks" in str(info.value)
    uneven = [
        SequenceSnapshot(0, [3, 4], [], -1.0, None, None),
        SequenceSnapshot(1, [3], [], -1.0, None, None),
    ]
    with pytest.raises(FieldError) as info:
        engine.import_request(
            snapshot_from_choices(
                "uneven", [1, 2], SamplingParams(n=2, max_tokens=4), None, 0.0, uneven
            )
        )
    assert info.value.field == "seqs"
    assert not engine.has_unfinished_requests()
    assert_empty(engine)
