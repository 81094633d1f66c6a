"""Speculative decoding with a real worker (LLMEngine + Worker in one process, a tiny random
Llama): drafts verified in the forward pass change no token. Greedy output equals HF's with
n-gram drafts, with drafts that are always right (all kept, fewer steps) and always wrong
(none kept), under chunked prefill and preemption on a small cache, on the native and the
torch attention backends; seeded sampling gives the same tokens with and without drafts; and
unseeded sampling with drafts draws from the model's distribution (a chi-square test against
probabilities computed with HF)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine import LLMEngine
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from scheduler_service.engine.proposer import DraftProposer
from scheduler_service.engine.speculation import Speculator
from tests.support.drafts import ScriptProposer
from tests.support.engines import engine_on_worker
from tests.support.models import load_hf, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

BLOCK = 4
K = 4
PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],
    [2, 71, 82],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
    [5, 8, 13, 21, 34, 5, 8, 13, 21, 34, 5, 8],
    [42, 42, 42, 42, 42],
]
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["cpu", "torch"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")
    worker = Worker(
        WorkerConfig(
            model=str(path), block_size=BLOCK, num_threads=1, attention_backend=request.param
        )
    )
    worker.load_model()
    return worker, load_hf(path)


@pytest.fixture(scope="module")
def expected(tiny: Any) -> list[list[int]]:
    _, hf = tiny
    with torch.no_grad():
        return [
            hf.generate(
                torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]


def make_engine(
    worker: Worker, proposer: DraftProposer | None, k: int = K, **setup: Any
) -> LLMEngine:
    """An engine drafting up to `k` tokens (0: no drafts) with `proposer` (None: n-gram
    prompt lookup of 1 to 3 tokens)."""
    options: dict[str, Any] = dict(gpu_blocks=128, cpu_blocks=64, batched_tokens=256)
    options.update(setup)
    engine = engine_on_worker(
        worker,
        max_model_len=256,
        num_speculative_tokens=k,
        ngram_min=1,
        ngram_max=3,
        speculative_max_seqs=16,  # drafts in batches too (the default is for a CPU: 2)
        **options,
    )
    if proposer is not None:
        scheduler = engine.scheduler
        scheduler.speculator = Speculator(
            scheduler.scheduler_config, scheduler.block_manager, proposer
        )
    return engine


def assert_all_free(engine: LLMEngine, worker: Worker) -> None:
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks - bm.num_reserved
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks
    engine.step()  # the last frees reach the worker
    assert worker.num_sequences == 0


SETUPS: dict[str, dict[str, Any]] = {
    "plain": dict(),
    "chunked": dict(batched_tokens=16),  # prompt chunks in the same steps as drafts
    "recompute": dict(gpu_blocks=16, preemption=PreemptionMode.RECOMPUTE),
    "swap": dict(gpu_blocks=16, preemption=PreemptionMode.SWAP),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("drafts", ["ngram", "right", "wrong"])
def test_greedy_with_drafts_matches_hf(
    tiny: Any, expected: list[list[int]], setup: str, drafts: str
) -> None:
    worker, _ = tiny
    script = {tuple(p): e for p, e in zip(PROMPTS, expected, strict=True)}
    proposer = (
        None
        if drafts == "ngram"
        else ScriptProposer(script, K, 128, off=lambda _: drafts == "wrong")
    )
    engine = make_engine(worker, proposer, **SETUPS[setup])
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    assert stats.num_spec_draft_tokens > 0
    if drafts == "right":
        # Only the last draft of a request may go unused (max_tokens cuts the run).
        assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens
    elif drafts == "wrong":
        assert stats.num_spec_accepted_tokens == 0
    else:
        assert stats.num_spec_accepted_tokens > 0  # the repeating prompts repeat
    if setup in ("recompute", "swap"):
        assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert_all_free(engine, worker)


def test_right_drafts_take_fewer_steps(tiny: Any, expected: list[list[int]]) -> None:
    worker, _ = tiny
    script = {tuple(PROMPTS[0]): expected[0]}
    steps = {}
    for k in (0, K):
        engine = make_engine(worker, ScriptProposer(script, K, 128), k=k)
        engine.add_request("r", PROMPTS[0], GREEDY)
        tokens: list[int] = []
        count = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.outputs[0].token_ids
            count += 1
        assert tokens == expected[0]
        steps[k] = count
    # A prefill samples the first token; then one token a step, or K + 1.
    assert steps == {0: NEW_TOKENS, K: 1 + -(-(NEW_TOKENS - 1) // (K + 1))}


def test_seeded_sampling_is_the_same_with_drafts(tiny: Any) -> None:
    worker, _ = tiny
    # Penalties see the drafts before a row as outputs.
    params = [
        SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=8, ignore_eos=True),
        SamplingParams(
            temperature=1.0, max_tokens=20, seed=9, ignore_eos=True, frequency_penalty=0.5
        ),
    ]
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    plain = make_engine(worker, None, k=0)
    reference = [o.outputs[0].token_ids for o in generate(plain, prompts, params)]
    script = {tuple(p): r for p, r in zip(prompts, reference, strict=True)}
    for proposer in (ScriptProposer(script, K, 128), None):  # right drafts, then n-gram ones
        engine = make_engine(worker, proposer)
        got = [o.outputs[0].token_ids for o in generate(engine, prompts, params)]
        assert got == reference
        assert engine.get_stats().num_spec_draft_tokens > 0
        assert_all_free(engine, worker)


def test_sampling_with_drafts_draws_from_the_model(tiny: Any) -> None:
    """Unseeded top-3 sampling at temperature 1, three tokens per request, with drafts of the
    greedy continuation (kept whenever the sample agrees): the joint frequency of the three
    tokens over 600 requests against HF's probabilities (chi-square, p > 0.001; the worker's
    sampler is seeded, so the test is deterministic)."""
    worker, hf = tiny
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)

    def top3(tokens: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
        values, ids = logits.topk(3)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist(), strict=True))

    expected: dict[tuple[int, ...], float] = {}
    for t1, p1 in top3(prompt).items():
        for t2, p2 in top3(prompt + [t1]).items():
            for t3, p3 in top3(prompt + [t1, t2]).items():
                expected[(t1, t2, t3)] = p1 * p2 * p3
    greedy = max(expected, key=lambda c: expected[c])
    engine = make_engine(worker, ScriptProposer({tuple(prompt): list(greedy)}, K, 128))
    n = 600
    counts: dict[tuple[int, ...], int] = dict.fromkeys(expected, 0)
    for out in generate(engine, [prompt] * n, params):
        counts[tuple(out.outputs[0].token_ids)] += 1  # KeyError: outside the top 3
    stats = engine.get_stats()
    assert stats.num_spec_accepted_tokens > 0
    # Cells expected under 5 times are pooled, as the test needs.
    small = [c for c in expected if expected[c] * n < 5]
    cells = [([c], expected[c]) for c in expected if c not in small]
    cells.append((small, sum(expected[c] for c in small)))
    chi2 = sum(
        (sum(counts[c] for c in group) - p * n) ** 2 / (p * n) for group, p in cells if p > 0
    )
    dof = len(cells) - 1
    # The chi-square distribution's survival function: the upper regularized gamma.
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(chi2 / 2)))
    assert p_value > 0.001, (chi2, dof, counts)
    assert_all_free(engine, worker)
