"""Tiny random models of the other families on a CUDA device (Triton attention, float32)
against HF `generate` on the same device: sliding windows shorter than prompt + output (Gemma
2 and 3, Qwen3, Phi-3, OLMo 3), soft-capped scores (Gemma 2), attention sinks (gpt-oss), two
head sizes and K/V shared across layers (Gemma 4), experts (Mixtral, Qwen3-MoE, gpt-oss: their
decode graphs run every expert, see worker_service/models/moe.py), Gated DeltaNet state
(Qwen3.5, Qwen3-Next). Greedy tokens equal HF's eagerly and with decode CUDA graphs where the
model's layout allows them (which must then serve decode steps; the others decode eagerly,
`cuda_graphs.layout_allows_graphs`); and drafts verified in multi-row steps (speculative
decoding) change no token on the GPU either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine.offline import generate
from tests.integration.test_speculative_tiny import PROMPTS as SPEC_PROMPTS
from tests.integration.test_speculative_tiny import make_engine as spec_engine
from tests.integration.test_worker_engine_tiny import PROMPTS
from tests.support.engines import engine_on_worker
from tests.support.models import load_hf, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
KINDS = ["gemma3", "gemma2", "qwen3", "phi3", "olmo3", "mixtral", "qwen3_moe", "gpt_oss", "gemma4"]
KINDS += ["qwen3_5", "qwen3_next"]
# Several KV groups (windows beside full layers, shared K/V) or a state pool: no graphs.
EAGER_LAYOUTS = {"gemma3", "gemma2", "qwen3", "olmo3", "gpt_oss", "gemma4", "qwen3_5", "qwen3_next"}


def hf_greedy_cuda(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def cuda_worker(path: Path, enforce_eager: bool) -> Worker:
    worker = Worker(
        WorkerConfig(
            model=str(path),
            block_size=4,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            max_num_seqs=16,
            enforce_eager=enforce_eager,
        )
    )
    worker.load_model()
    return worker


@pytest.fixture(scope="module", params=KINDS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(kind, model path, HF's greedy tokens for PROMPTS on the GPU)."""
    path = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "model")
    hf = load_hf(path).to("cuda")
    expected = hf_greedy_cuda(hf, PROMPTS, NEW_TOKENS)
    del hf
    return request.param, path, expected


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_family_greedy_equals_hf_on_the_gpu(family: tuple, enforce_eager: bool) -> None:
    kind, path, expected = family
    worker = cuda_worker(path, enforce_eager)
    assert worker.model_info.attention_backend == "triton"
    # Chunked prefill (16 tokens a step) mixed with decodes, then decode-only steps.
    engine = engine_on_worker(
        worker, gpu_blocks=256, cpu_blocks=0, batched_tokens=16, max_model_len=256
    )
    outputs = generate(engine, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    graphs = worker.runner.decode_graphs
    if enforce_eager or kind in EAGER_LAYOUTS:
        assert graphs is None
    else:
        assert graphs is not None and graphs.replays > 0
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks - bm.num_reserved


def test_drafts_verified_on_the_gpu_change_no_token(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "llama")
    expected = hf_greedy_cuda(load_hf(path).to("cuda"), SPEC_PROMPTS, NEW_TOKENS)
    worker = cuda_worker(path, enforce_eager=False)
    engine = spec_engine(worker, None)  # n-gram prompt lookup, up to 4 drafts
    outputs = generate(engine, SPEC_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = engine.get_stats()
    assert stats.num_spec_accepted_tokens > 0  # the repeating prompts repeat
