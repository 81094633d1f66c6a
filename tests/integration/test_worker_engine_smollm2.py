"""SmolLM2-135M (fp32) through LLMEngine + Worker against HF generate, token for token."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine import LLMEngine
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from tests.support.engines import engine_on_worker
from tests.support.models import SMOLLM2_EXACTNESS_NEW, load_smollm2, smollm2_exactness
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

pytestmark = pytest.mark.slow

NEW = SMOLLM2_EXACTNESS_NEW
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def smol() -> tuple[Worker, Any, list[list[int]]]:
    torch.set_num_threads(2)
    _, hf = load_smollm2()
    # Dense float32 weights, prepacked by oneDNN (the GGUF blocks' own test:
    # test_worker_gguf_blocks.py).
    config = WorkerConfig(model="smollm2", dtype="float32", num_threads=2, linear_impl="onednn")
    worker = Worker(config)
    worker.load_from_hf(hf)
    return worker, hf, smollm2_exactness()[0]


def hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return smollm2_exactness()[1]


def make_engine(
    worker: Worker,
    gpu: int = 256,
    cpu: int = 128,
    budget: int = 2048,
    preemption: PreemptionMode | None = None,
    **scheduler: Any,
) -> LLMEngine:
    return engine_on_worker(
        worker,
        gpu_blocks=gpu,
        cpu_blocks=cpu,
        batched_tokens=budget,
        max_model_len=2048,
        preemption=preemption,
        **scheduler,
    )


def finish(engine: LLMEngine, worker: Worker) -> None:
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    engine.step()
    assert worker.num_sequences == 0


def test_batched_greedy_with_chunked_prefill_and_logprobs(
    smol: Any, expected: list[list[int]]
) -> None:
    worker, hf, prompts = smol
    engine = make_engine(worker, budget=32)  # the long prompt is split and mixed with decodes
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    outputs = generate(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(prompts[:3], outputs[:3], strict=True):
        full = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], dim=-1)
        got = [s.token.logprob for s in out.outputs[0].logprobs or []]
        want = ref[len(prompt) - 1 : -1].gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])[
            :, 0
        ]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)
        got_prompt = [e.token.logprob for e in out.prompt_logprobs or []]
        want_prompt = ref[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got_prompt), want_prompt, atol=1e-4, rtol=0)
    finish(engine, worker)


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_greedy_under_preemption(
    smol: Any, expected: list[list[int]], mode: PreemptionMode
) -> None:
    worker, _, prompts = smol
    engine = make_engine(worker, gpu=24, preemption=mode)
    outputs = generate(engine, prompts, GREEDY)
    stats = engine.get_stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    finish(engine, worker)


def test_greedy_with_prefix_cache_hits(smol: Any, expected: list[list[int]]) -> None:
    worker, hf, prompts = smol
    engine = make_engine(worker)
    long = prompts[4]  # > 2 full blocks
    first = generate(engine, [long], GREEDY)
    variant = long[:-3] + prompts[0][-3:]
    second = generate(engine, [variant, long], GREEDY)
    assert engine.get_stats().prefix_cache_hits >= 2
    assert first[0].outputs[0].token_ids == expected[4]
    assert second[1].outputs[0].token_ids == expected[4]
    assert second[0].outputs[0].token_ids == hf_greedy(hf, variant)
    finish(engine, worker)


def test_greedy_with_ngram_drafts(smol: Any, expected: list[list[int]]) -> None:
    """Speculative decoding changes no token, and the logprobs are the model's (issue #28):
    prompt chunks beside drafts, and sequences preempted (recomputed) on a small cache."""
    worker, hf, prompts = smol
    engine = make_engine(
        worker,
        gpu=24,
        budget=32,
        preemption=PreemptionMode.RECOMPUTE,
        num_speculative_tokens=5,
        speculative_max_seqs=16,  # drafts beside other sequences' rows too
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    outputs = generate(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    assert stats.num_spec_accepted_tokens > 0
    assert stats.num_preemptions_recompute > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        full = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0], dim=-1)
        got = [s.token.logprob for s in out.outputs[0].logprobs or []]
        want = ref[len(prompt) - 1 : -1].gather(1, torch.tensor(out.outputs[0].token_ids)[:, None])
        torch.testing.assert_close(torch.tensor(got), want[:, 0], atol=1e-4, rtol=0)
    finish(engine, worker)
