"""The hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet layers beside gated
attention) through the scheduler and a real worker, against HF generate in float32.

Each sequence's recurrent layers keep their state in a slot the scheduler gives it
(`scheduler_service.engine.state_slots`); the tests check greedy equality under chunked
prefill (the state carried from chunk to chunk), recompute preemption (the state rebuilt) and
swap preemption (the state moved to a host slot and back, maybe into another slot),
prefix-cache hits (the state starts from the snapshot kept at the hit's last block), forks
that copy the state (n > 1 under top-k 1 sampling, which is greedy, and beam search against
HF's), drafts (the state put back to the one after the last kept draft), and that every block
and state slot comes back."""

from __future__ import annotations

from typing import Any

import pytest

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from tests.integration.test_speculative_tiny import make_engine as drafting_engine
from tests.integration.test_worker_engine_tiny import (
    BLOCK,
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    assert_all_free,
    hf_beam_best,
    hf_greedy,
    make_engine,
)
from tests.support.drafts import ScriptProposer
from tests.support.models import HYBRID_KINDS, load_hf, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

HYBRIDS = [(kind, backend) for kind in HYBRID_KINDS for backend in ("torch", "cpu")]


@pytest.fixture(scope="module", params=HYBRIDS, ids=lambda p: f"{p[0]}-{p[1]}")
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Worker, Any, list[list[int]]]:
    kind, backend = request.param
    path = save_tiny_model(kind, tmp_path_factory.mktemp(kind) / kind)
    hf = load_hf(path)
    worker = Worker(
        WorkerConfig(model=str(path), block_size=BLOCK, num_threads=1, attention_backend=backend)
    )
    worker.load_model()
    layout = worker.model_info.kv_layout
    assert layout.state_layers and layout.groups  # both kinds of layer
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    return worker, hf, expected


@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(batched_tokens=16),  # prompts in several chunks, beside decodes
        dict(gpu_blocks=14, preemption=PreemptionMode.RECOMPUTE),
        dict(gpu_blocks=14, preemption=PreemptionMode.SWAP),
    ],
    ids=["plain", "chunked", "recompute", "swap"],
)
def test_greedy_batch_matches_hf(
    hybrid: tuple[Worker, Any, list[list[int]]], setup: dict[str, Any]
) -> None:
    worker, _, expected = hybrid
    engine = make_engine(worker, **setup)
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    if setup.get("preemption") is PreemptionMode.RECOMPUTE:
        assert stats.num_preemptions_recompute > 0
    if setup.get("preemption") is PreemptionMode.SWAP:
        assert stats.num_preemptions_swap > 0
    assert_all_free(engine, worker)


def test_prefix_cache_hits_start_from_the_kept_state(
    hybrid: tuple[Worker, Any, list[list[int]]],
) -> None:
    worker, hf, _ = hybrid
    shared = PROMPTS[2] + PROMPTS[0]  # 34 tokens: the state is kept after 32
    prompts = [shared + [7, 8, 9], shared + [100], shared[:20] + [3, 3]]
    engine = make_engine(worker, batched_tokens=16)
    first = generate(engine, prompts[:1], GREEDY)
    rest = generate(engine, prompts[1:], GREEDY)
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert_all_free(engine, worker)


def test_forks_copy_the_state(hybrid: tuple[Worker, Any, list[list[int]]]) -> None:
    """n = 3 under top-k 1 sampling: each sequence samples the argmax, so all three equal
    HF's greedy tokens only if every child started from a copy of its parent's state."""
    worker, _, expected = hybrid
    engine = make_engine(worker, batched_tokens=16)
    top1 = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = generate(engine, [PROMPTS[0], PROMPTS[3]], [top1, GREEDY])
    assert [c.token_ids for c in outputs[0].outputs] == [expected[0]] * 3
    assert outputs[1].outputs[0].token_ids == expected[3]
    assert_all_free(engine, worker)


def test_beam_search_matches_hf(hybrid: tuple[Worker, Any, list[list[int]]]) -> None:
    worker, hf, _ = hybrid
    engine = make_engine(worker)
    prompt = PROMPTS[4]
    beam = SamplingParams(
        n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=10, ignore_eos=True
    )
    (beamed,) = generate(engine, [prompt], [beam])
    assert beamed.outputs[0].token_ids == hf_beam_best(hf, prompt, 10, 4)
    assert_all_free(engine, worker)


@pytest.mark.parametrize("drafts", ["ngram", "mixed"])
def test_drafts_change_no_token(hybrid: tuple[Worker, Any, list[list[int]]], drafts: str) -> None:
    """Drafts verified beside chunked prompts: n-gram ones, and the known outputs with every
    third draft wrong, so runs of 0, 1 and 2 kept drafts end in a rejected one and the state
    goes back to the one after the last kept token."""
    worker, _, expected = hybrid
    script = {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)}
    vocab = worker.model_info.vocab_size
    proposer = (
        None if drafts == "ngram" else ScriptProposer(script, 4, vocab, off=lambda p: p % 3 == 2)
    )
    engine = drafting_engine(worker, proposer, batched_tokens=16)
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    assert stats.num_spec_draft_tokens > 0
    if drafts == "mixed":
        assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert_all_free(engine, worker)
