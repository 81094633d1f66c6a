"""The worker with `--attention-backend triton` (interpreted on CPU) samples the same greedy
tokens as with the torch backend, through batched prefill, chunked prefill mixed with decodes,
a prefix-cache hit and shuffled block ids; the tiny models of the families with sliding
windows shorter than the sequences (and Gemma 2's soft-capped scores, gpt-oss's attention
sinks, Gemma 4's KV-shared layers) and of the hybrid families (Gated DeltaNet layers on
their state slots beside the attention layers) sample HF's greedy tokens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.steps import CachedSequence, NewSequence, StepInput
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.offline import generate
from tests.integration.test_speculative_tiny import make_engine as drafting_engine
from tests.integration.test_worker_engine_tiny import PROMPTS as ENGINE_PROMPTS
from tests.integration.test_worker_engine_tiny import (
    assert_all_free,
    hf_beam_best,
    hf_greedy,
    make_engine,
)
from tests.support.drafts import ScriptProposer
from tests.support.models import HYBRID_KINDS, WINDOW, load_hf, save_tiny_model
from worker_service.attention import AttentionBackendError, AttentionSpec, get_backend_class
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

BLOCK_SIZE = 8
NUM_BLOCKS = 48
# Unset on a CUDA host (tests/conftest.py sets it only where there is no CUDA device).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PROMPTS = {
    0: [5, 17, 33, 2, 9, 41, 77, 12, 3, 99, 64],
    1: [8, 8, 21],
    2: [100, 3, 55, 6, 19, 27, 31, 90, 14, 66, 70, 71, 72, 11, 4, 38, 45, 20, 21],
}
# A prompt sharing seq 2's first two blocks (16 tokens): admitted as a prefix-cache hit.
PREFIX_HIT = PROMPTS[2][:16] + [60, 61, 62]


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # LlamaConfig's own special token ids, as this test has always used.
    return save_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", bos_token_id=1, eos_token_id=2
    )


def make_worker(path: Path, backend: str) -> Worker:
    config = WorkerConfig(
        model=str(path), block_size=BLOCK_SIZE, num_threads=1, attention_backend=backend
    )
    worker = Worker(config)
    worker.load_model()
    worker.initialize_cache(NUM_BLOCKS, 4)
    return worker


def new_seq(
    seq_id: int, tokens: list[int], blocks: list[int], scheduled: int, computed: int = 0
) -> NewSequence:
    return NewSequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        seq_index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        num_computed_tokens=computed,
        block_ids=blocks,
        num_scheduled_tokens=scheduled,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=64),
    )


def run_script(worker: Worker, max_new_tokens: int = 6) -> tuple[dict[int, list[int]], list[float]]:
    """A fixed schedule; returns the greedy tokens per sequence and every sample's logprob."""
    free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    blocks = {seq_id: [free.pop() for _ in range(4)] for seq_id in PROMPTS}
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in [*PROMPTS, 3]}
    logprobs: list[float] = []

    def execute(step_id: int, **parts: list) -> None:
        for out in worker.execute(StepInput(step_id, **parts)).outputs:
            outputs[out.seq_id].append(out.samples[0].token_id)
            logprobs.append(out.samples[0].logprob)

    # Step 0: whole prompts 0 and 1, first chunk (10 tokens) of prompt 2.
    execute(
        0,
        new_seqs=[
            new_seq(0, PROMPTS[0], blocks[0], len(PROMPTS[0])),
            new_seq(1, PROMPTS[1], blocks[1], len(PROMPTS[1])),
            new_seq(2, PROMPTS[2], blocks[2], 10),
        ],
    )
    # Step 1: the rest of prompt 2 alongside decodes of 0 and 1, and a prefix-cache hit that
    # reuses prompt 2's first two blocks (written in step 0 and this step) and adds its own.
    hit_blocks = blocks[2][:2] + [free.pop() for _ in range(2)]
    execute(
        1,
        cached_seqs=[
            CachedSequence(0, outputs[0][-1:], 4, [], 1),
            CachedSequence(1, outputs[1][-1:], 4, [], 1),
            CachedSequence(2, [], 4, [], len(PROMPTS[2]) - 10),
        ],
    )
    execute(2, new_seqs=[new_seq(3, PREFIX_HIT, hit_blocks, 3, computed=16)])
    # Decodes of everyone.
    for step_id in range(3, 3 + max_new_tokens):
        execute(
            step_id,
            cached_seqs=[
                CachedSequence(seq_id, tokens[-1:], 4, [], 1)
                for seq_id, tokens in outputs.items()
                if tokens
            ],
        )
    return outputs, logprobs


def test_triton_backend_matches_torch_greedy(tiny_llama_dir: Path) -> None:
    torch_worker = make_worker(tiny_llama_dir, "torch")
    triton_worker = make_worker(tiny_llama_dir, "triton")
    assert torch_worker.model_info.attention_backend == "torch"
    assert triton_worker.model_info.attention_backend == "triton"

    torch_tokens, torch_logprobs = run_script(torch_worker)
    triton_tokens, triton_logprobs = run_script(triton_worker)

    assert all(len(tokens) >= 6 for tokens in torch_tokens.values())
    assert triton_tokens == torch_tokens
    assert triton_logprobs == pytest.approx(torch_logprobs, abs=1e-4)


def test_auto_picks_the_native_kernels_on_cpu_and_triton_when_interpreted() -> None:
    cpu = AttentionSpec(torch.device("cpu"), torch.float32, 4, 2, 32)
    assert get_backend_class("auto", cpu).name == "cpu"
    if INTERPRETED:
        assert get_backend_class("triton", cpu).name == "triton"
    else:  # a CUDA host: compiled kernels refuse CPU tensors
        with pytest.raises(AttentionBackendError, match="TRITON_INTERPRET=1"):
            get_backend_class("triton", cpu)


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda() -> None:
    cuda = AttentionSpec(torch.device("cuda"), torch.bfloat16, 4, 2, 32)
    assert get_backend_class("auto", cuda).name == "triton"


# Gemma 2 (every other layer windowed, scores soft-capped), Gemma 3 (two windowed layers in
# three, query_pre_attn_scalar), gpt-oss (every other layer windowed, attention sinks) and
# Gemma 4 (layers that read other layers' K/V and write none) run in the default suite; the
# other windowed families (tests/support/models.py) are slow. Gemma 3's and Gemma 4's
# multimodal checkpoints are left out: their attention layers are gemma3's and gemma4's (the
# second's MoE blocks run no kernel of the backend), and the CPU family tests load them.
WINDOWED_KINDS = [
    "gemma2",
    "gemma3",
    "gpt_oss",
    "gemma4",
    *(
        pytest.param(kind, marks=pytest.mark.slow)
        for kind in ("qwen3", "phi3", "smollm3", "olmo3", "mixtral")
    ),
]


@pytest.mark.parametrize("kind", WINDOWED_KINDS)
def test_windowed_families_match_hf_greedy(kind: str, tmp_path: Path) -> None:
    """Through the engine with chunked prefill mixed with decodes, greedy tokens equal HF's
    in float32."""
    path = save_tiny_model(kind, tmp_path / kind)
    hf = load_hf(path)
    worker = Worker(
        WorkerConfig(model=str(path), block_size=4, num_threads=1, attention_backend="triton")
    )
    worker.load_model()
    assert worker.model_info.attention_backend == "triton"
    window = worker.model.arch.sliding_window
    assert window in (WINDOW, 12)  # phi3's is 12
    prompts = ENGINE_PROMPTS[:3]  # 13, 3 and 21 tokens
    new_tokens = 8
    # Prompts of 13 and 21 tokens outgrow either window.
    assert sum(len(p) > window for p in prompts) == 2
    engine = make_engine(worker, batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = generate(engine, prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(hf, p, new_tokens) for p in prompts
    ]


@pytest.fixture(scope="module", params=HYBRID_KINDS)
def triton_hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Worker, Any]:
    """A hybrid family's worker with its gated attention layers on the Triton kernels (the
    linear-attention layers on their state slots), and its HF model."""
    kind = request.param
    path = save_tiny_model(kind, tmp_path_factory.mktemp(kind) / kind)
    worker = Worker(
        WorkerConfig(model=str(path), block_size=4, num_threads=1, attention_backend="triton")
    )
    worker.load_model()
    assert worker.model_info.attention_backend == "triton"
    return worker, load_hf(path)


HYBRID_TOKENS = 8
HYBRID_GREEDY = SamplingParams(temperature=0.0, max_tokens=HYBRID_TOKENS, ignore_eos=True)


def test_hybrid_families_match_hf_greedy(triton_hybrid: tuple[Worker, Any]) -> None:
    """Through the engine with prompts in several chunks, then again with drafts (every third
    one wrong): greedy tokens equal HF's in float32, and every block and slot comes back."""
    worker, hf = triton_hybrid
    prompts = ENGINE_PROMPTS[:3]
    engine = make_engine(worker, batched_tokens=16)
    outputs = generate(engine, prompts, HYBRID_GREEDY)
    expected = [hf_greedy(hf, p, HYBRID_TOKENS) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_free(engine, worker)
    script = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    proposer = ScriptProposer(script, 3, worker.model_info.vocab_size, off=lambda p: p % 3 == 2)
    drafting = drafting_engine(worker, proposer, k=3, batched_tokens=16)
    assert [o.outputs[0].token_ids for o in generate(drafting, prompts, HYBRID_GREEDY)] == expected
    assert drafting.get_stats().num_spec_accepted_tokens > 0
    assert_all_free(drafting, worker)


# Qwen3.5 and Qwen3-Next: their MoE and multimodal variants add nothing these paths touch
# (the MLP and the vision tower hold no state), and test_hybrid_families_match_hf_greedy above
# runs them on the Triton kernels.
@pytest.mark.parametrize("triton_hybrid", ["qwen3_5", "qwen3_next"], indirect=True)
def test_hybrid_families_keep_their_states_through_the_engine(
    triton_hybrid: tuple[Worker, Any],
) -> None:
    """The state's engine paths on the Triton backend: swap and recompute preemption on a
    small cache, a prefix-cache hit (the state from its snapshot), n = 2 forks under top-k 1
    (greedy) and beam search: tokens equal HF's."""
    worker, hf = triton_hybrid
    # Every prompt at once on 10 blocks of 4: the running ones outgrow the cache.
    expected = [hf_greedy(hf, p, HYBRID_TOKENS) for p in ENGINE_PROMPTS]
    for mode in (PreemptionMode.SWAP, PreemptionMode.RECOMPUTE):
        engine = make_engine(worker, gpu_blocks=10, batched_tokens=64, preemption=mode)
        outputs = generate(engine, ENGINE_PROMPTS, HYBRID_GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == expected, mode
        stats = engine.get_stats()
        assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0, mode
        assert_all_free(engine, worker)
    shared = ENGINE_PROMPTS[2] + ENGINE_PROMPTS[0]  # the state is kept after 32 tokens
    engine = make_engine(worker, batched_tokens=16)
    generate(engine, [shared + [7, 8]], HYBRID_GREEDY)
    (hit,) = generate(engine, [shared + [100]], HYBRID_GREEDY)
    assert engine.get_stats().prefix_cache_hits > 0
    assert hit.outputs[0].token_ids == hf_greedy(hf, shared + [100], HYBRID_TOKENS)
    top1 = SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=HYBRID_TOKENS, ignore_eos=True)
    beam = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=6, ignore_eos=True
    )
    forked, beamed = generate(engine, [ENGINE_PROMPTS[0], ENGINE_PROMPTS[4]], [top1, beam])
    assert [c.token_ids for c in forked.outputs] == [expected[0]] * 2
    assert beamed.outputs[0].token_ids == hf_beam_best(hf, ENGINE_PROMPTS[4], 6, 2)
    assert_all_free(engine, worker)
