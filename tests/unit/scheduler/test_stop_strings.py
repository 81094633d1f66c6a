"""Stop strings stop sequences inside the scheduler (FakeModel tokens, SmolLM2's tokenizer).

Each test first runs the request without stop strings (the reference), picks a stop string
from the reference text, then runs it again with that stop string.
"""

from __future__ import annotations

from typing import Any

import pytest

from llmserve.detokenizer import IncrementalDetokenizer
from llmserve.model_spec import load_tokenizer, resolve_model
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import generate
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.sequence import FinishReason
from scheduler_service.engine.text_stops import StopStrings

from .fake_model import FakeModel

PROMPT = [1500, 1600, 1700, 1800, 1900]
VOCAB = 4000  # FakeModel samples ids below this: ordinary SmolLM2 BPE pieces
BLOCK = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("smollm2"))


def make_engine(tokenizer: Any) -> tuple[LLMEngine, FakeModel]:
    model = FakeModel(64, 32, BLOCK, vocab_size=VOCAB)
    engine = LLMEngine(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=32),
        model,
        lambda: tokenizer,
    )
    return engine, model


def texts_by_token(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """The text after each output token, as the scheduler decodes it."""
    detok = IncrementalDetokenizer(tokenizer, PROMPT)
    texts, text = [], ""
    for token in token_ids:
        text += detok.add([token])
        texts.append(text)
    return texts


def reference(tokenizer: Any, params: SamplingParams) -> RequestOutput:
    engine, _ = make_engine(tokenizer)
    return generate(engine, [PROMPT], params)[0]


def pick_stop(
    tokenizer: Any, choices: list[list[int]], index: int, min_position: int = 2
) -> tuple[str, int] | None:
    """A stop string that first completes at some token k >= min_position of choice `index`
    and appears in no other choice: (stop, k)."""
    texts = texts_by_token(tokenizer, choices[index])
    others = [
        "".join(texts_by_token(tokenizer, c)[-1:]) for i, c in enumerate(choices) if i != index
    ]
    for k in range(min_position, len(texts) - 2):
        new = texts[k][len(texts[k - 1]) :].strip()
        for stop in (new, texts[k][-3:]):
            if len(stop) < 2 or stop in texts[k - 1] or any(stop in o for o in others):
                continue
            return stop, k
    return None


def test_n3_a_stopped_choice_frees_its_blocks_within_one_step_the_others_complete(tokenizer):
    params = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    ref = reference(tokenizer, params)
    choices = [c.token_ids for c in ref.outputs]
    assert all(len(c) == MAX_TOKENS for c in choices)
    picked = next((p, i) for i in range(3) if (p := pick_stop(tokenizer, choices, i)) is not None)
    (stop, k), stopped_index = picked

    engine, model = make_engine(tokenizer)
    engine.add_request("r", PROMPT, params, stop_strings=StopStrings((stop,)))
    bm = engine.scheduler.block_manager
    group = engine.scheduler.get_seq_group("r")
    assert group is not None
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finish: dict[int, FinishReason | None] = {}
    stopped_seq_id = None
    told_worker = False
    while engine.has_unfinished_requests():
        for delta in engine.step():
            for choice in delta.outputs:
                tokens[choice.index].extend(choice.token_ids)
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
                    if choice.index == stopped_index:
                        seq = next(s for s in group.seqs if s.seq_index == stopped_index)
                        stopped_seq_id = seq.seq_id
                        # Its blocks are free in the step it stopped in ...
                        assert not bm.has_table(seq)
                        steps_before = model.num_steps
        if stopped_seq_id is not None and model.num_steps == steps_before + 1:
            # ... and the next step tells the worker, which then holds it no more.
            assert engine.last_step_input is not None
            assert stopped_seq_id in engine.last_step_input.freed_seq_ids
            assert stopped_seq_id not in model.seqs
            told_worker = True
    assert told_worker
    assert finish[stopped_index] is FinishReason.STOP
    assert tokens[stopped_index] == choices[stopped_index][: k + 1]
    for i in range(3):
        if i != stopped_index:
            assert tokens[i] == choices[i]
            assert finish[i] is FinishReason.LENGTH
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_best_of_4_ranks_candidates_on_their_stopped_text(tokenizer):
    # The candidates are those of n=4 (FakeModel samples by sequence index), with logprobs.
    all4 = reference(
        tokenizer, SamplingParams(n=4, max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0)
    )
    candidates = [c.token_ids for c in all4.outputs]
    logprobs = [[lp.token.logprob for lp in c.logprobs or ()] for c in all4.outputs]
    full_scores = [sum(lps) for lps in logprobs]
    best_full = max(range(4), key=lambda i: full_scores[i])
    params = SamplingParams(n=1, best_of=4, max_tokens=MAX_TOKENS, temperature=1.0)
    assert reference(tokenizer, params).outputs[0].token_ids == candidates[best_full]

    # A stop string that cuts another candidate so early that its stopped text scores better
    # than every other candidate's whole text (ranked on text past the stop, it would lose).
    chosen = None
    for i in range(4):
        picked = pick_stop(tokenizer, candidates, i, min_position=1)
        if i == best_full or picked is None:
            continue
        stop, k = picked
        stopped_score = sum(logprobs[i][: k + 1])
        if stopped_score > max(full_scores[j] for j in range(4) if j != i):
            chosen = (i, stop, k, stopped_score)
            break
    assert chosen is not None, "no usable stop string in the reference text"
    index, stop, k, stopped_score = chosen

    engine, _ = make_engine(tokenizer)
    engine.add_request("b", PROMPT, params, stop_strings=StopStrings((stop,)))
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    # best_of > n: one delta, at the end, with the whole returned output.
    assert len(deltas) == 1 and deltas[0].finished and len(deltas[0].outputs) == 1
    out = deltas[0].outputs[0]
    assert out.token_ids == candidates[index][: k + 1]
    assert out.finish_reason is FinishReason.STOP and out.stop_token_id is None
    assert out.cumulative_logprob == pytest.approx(stopped_score)
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_beam_search_beams_stop_at_the_token_that_completes_a_stop_string(tokenizer):
    params = SamplingParams(n=2, use_beam_search=True, max_tokens=MAX_TOKENS, temperature=0.0)
    ref = reference(tokenizer, params)
    picked = pick_stop(tokenizer, [c.token_ids for c in ref.outputs], 0, min_position=3)
    assert picked is not None
    stop, _ = picked
    engine, _ = make_engine(tokenizer)
    out = None
    engine.add_request("beam", PROMPT, params, stop_strings=StopStrings((stop,)))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out = delta
    assert out is not None and out.finished and len(out.outputs) == 2
    stopped = 0
    for choice in out.outputs:
        texts = texts_by_token(tokenizer, choice.token_ids)
        # No beam runs past the stop string; a beam that holds it ends with the token that
        # completed it (forked beams carry their parent's text state).
        assert all(stop not in t for t in texts[:-1])
        if stop in texts[-1]:
            stopped += 1
            assert choice.finish_reason is FinishReason.STOP
    assert stopped >= 1
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks


def test_requests_without_stop_strings_never_load_the_tokenizer():
    def refuse() -> Any:
        raise AssertionError("tokenizer loaded without stop strings")

    model = FakeModel(16, 8, BLOCK, vocab_size=VOCAB)
    engine = LLMEngine(
        SchedulerConfig(max_model_len=64),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
        model,
        refuse,
    )
    out = generate(engine, [PROMPT], SamplingParams(n=2, max_tokens=4))[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]


def test_a_tokenizer_that_cannot_load_refuses_the_request_naming_stop():
    from llmserve.errors import FieldError

    def broken() -> Any:
        raise OSError("no tokenizer files here")

    engine = LLMEngine(
        SchedulerConfig(max_model_len=64),
        CacheConfig(block_size=BLOCK, num_gpu_blocks=16),
        FakeModel(16, 8, BLOCK, vocab_size=VOCAB),
        broken,
    )
    with pytest.raises(FieldError) as info:
        engine.add_request("x", PROMPT, SamplingParams(), stop_strings=StopStrings(("a",)))
    assert info.value.field == "stop" and "no tokenizer files" in str(info.value)
    assert not engine.has_unfinished_requests()
