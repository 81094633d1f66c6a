"""Scheduler (LLMEngine) + Worker in one process on tiny random checkpoints, against HF."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine import LLMEngine
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from tests.support.engines import engine_on_worker
from tests.support.models import load_hf, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

BLOCK = 4
PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],
    [2, 71, 82],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
    [99],
    [5, 8, 13, 21, 34, 55, 89, 44, 33, 77],
    [60, 61, 62, 63, 64, 65, 66],
    [120, 110, 100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 9, 8, 7, 6, 5],
    [42, 42, 42, 42, 42],
]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=["cpu", "torch"])
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Worker, Any]:
    """A worker on each CPU attention backend (native kernels, plain torch), and HF's model."""
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    hf = load_hf(path)
    worker = Worker(
        WorkerConfig(
            model=str(path), block_size=BLOCK, num_threads=1, attention_backend=request.param
        )
    )
    worker.load_model()
    assert worker.model_info.attention_backend == request.param
    return worker, hf.eval()


def make_engine(
    worker: Worker,
    gpu_blocks: int = 128,
    cpu_blocks: int = 64,
    batched_tokens: int = 256,
    chunked: bool = True,
    prefix: bool = True,
    preemption: PreemptionMode | None = None,
) -> LLMEngine:
    return engine_on_worker(
        worker,
        gpu_blocks=gpu_blocks,
        cpu_blocks=cpu_blocks,
        batched_tokens=batched_tokens,
        max_model_len=256,
        chunked=chunked,
        prefix=prefix,
        preemption=preemption,
    )


def hf_beam_best(hf: Any, prompt: list[int], n: int, width: int) -> list[int]:
    """HF's best beam of `width` for `n` new tokens (no early stop, length penalty 1)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            num_beams=width,
            num_return_sequences=2,
            do_sample=False,
            length_penalty=1.0,
            early_stopping=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(tiny: tuple[Worker, Any]) -> list[list[int]]:
    return [hf_greedy(tiny[1], p, NEW_TOKENS) for p in PROMPTS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def assert_all_free(engine: LLMEngine, worker: Worker) -> None:
    assert not engine.has_unfinished_requests()
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks - bm.num_reserved
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks
    if bm.states is not None:
        assert bm.states.num_unheld() == bm.states.num_slots  # snapshots are cached, not held
    # Finished ids reach the worker with the next step.
    engine.step()
    assert worker.num_sequences == 0


@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(batched_tokens=16),  # chunked prefill mixed with decodes
        dict(chunked=False, batched_tokens=256),
        dict(gpu_blocks=14, preemption=PreemptionMode.RECOMPUTE),
        dict(gpu_blocks=14, preemption=PreemptionMode.SWAP),
    ],
    ids=["plain", "chunked", "unchunked", "recompute", "swap"],
)
def test_greedy_batch_matches_hf(
    tiny: tuple[Worker, Any], expected: list[list[int]], setup: dict[str, Any]
) -> None:
    worker, _ = tiny
    engine = make_engine(worker, **setup)
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    if "preemption" in setup:
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert_all_free(engine, worker)


def test_prefix_cache_hits_keep_greedy_exact(tiny: tuple[Worker, Any]) -> None:
    worker, hf = tiny
    shared = PROMPTS[2] + PROMPTS[0]  # 34 tokens: 8 full blocks shared
    prompts = [shared + [7, 8, 9], shared + [100], shared[:20] + [3, 3]]
    engine = make_engine(worker)
    first = generate(engine, prompts[:1], GREEDY)
    rest = generate(engine, prompts[1:], GREEDY)
    assert engine.get_stats().prefix_cache_hits > 0
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert_all_free(engine, worker)


def test_logprobs_and_prompt_logprobs_match_hf(
    tiny: tuple[Worker, Any], expected: list[list[int]]
) -> None:
    worker, hf = tiny
    engine = make_engine(worker, batched_tokens=16)  # prompt logprobs arrive over chunks
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    outputs = generate(engine, PROMPTS[:4], params)
    for prompt, out, exp in zip(PROMPTS, outputs, expected, strict=False):
        choice = out.outputs[0]
        assert choice.token_ids == exp
        full = prompt + exp
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
        assert choice.logprobs is not None
        assert len(choice.logprobs) == NEW_TOKENS
        for i, step in enumerate(choice.logprobs):
            row = ref[len(prompt) - 1 + i]
            token = full[len(prompt) + i]
            assert (step.token.token_id, step.token.rank) == (token, 1)
            assert step.token.logprob == pytest.approx(row[token].item(), abs=1e-4)
            top = row.topk(3)
            assert [t.token_id for t in step.top] == top.indices.tolist()
            assert [t.rank for t in step.top] == [1, 2, 3]
            for alt, value in zip(step.top, top.values.tolist(), strict=True):
                assert alt.logprob == pytest.approx(value, abs=1e-4)
        entries = out.prompt_logprobs or []  # a one-token prompt has none
        assert [e.position for e in entries] == list(range(1, len(prompt)))
        for entry in entries:
            row = ref[entry.position - 1]
            assert entry.token.token_id == prompt[entry.position]
            assert entry.token.logprob == pytest.approx(
                row[prompt[entry.position]].item(), abs=1e-4
            )
            assert entry.token.rank == int((row > row[prompt[entry.position]]).sum()) + 1
            assert [t.token_id for t in entry.top] == row.topk(2).indices.tolist()
    assert_all_free(engine, worker)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny: tuple[Worker, Any]) -> None:
    worker, _ = tiny
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    alone = generate(make_engine(worker), [PROMPTS[0]], seeded)[0].outputs[0].token_ids
    again = generate(make_engine(worker), [PROMPTS[0]], seeded)[0].outputs[0].token_ids
    crowd = generate(
        make_engine(worker, batched_tokens=16),
        [PROMPTS[2], PROMPTS[0], PROMPTS[4]],
        [other, seeded, other],
    )
    assert alone == again == crowd[1].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {
        tuple(generate(make_engine(worker), [PROMPTS[0]], unseeded)[0].outputs[0].token_ids)
        for _ in range(3)
    }
    assert len(runs) > 1  # the shared stream advances between requests


def test_n4_and_beam4_run_to_the_end_and_free_everything(tiny: tuple[Worker, Any]) -> None:
    worker, hf = tiny
    engine = make_engine(worker, gpu_blocks=40)
    n4 = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    beam = SamplingParams(
        n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=10, ignore_eos=True
    )
    sampled, beamed = generate(engine, [PROMPTS[0], PROMPTS[4]], [n4, beam])
    assert len(sampled.outputs) == 4 and all(len(c.token_ids) == 10 for c in sampled.outputs)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert len(beamed.outputs) == 2
    assert beamed.outputs[0].token_ids == hf_beam_best(hf, PROMPTS[4], 10, 4)
    assert_all_free(engine, worker)
