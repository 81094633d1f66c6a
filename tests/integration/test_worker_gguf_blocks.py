"""SmolLM2 from its shipped Q4_1 file with the projections multiplying on the file's blocks
(`--linear-impl gguf`, exact mode) against HF generate on the dequantized file, token for
token in float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from tests.support.engines import engine_on_worker
from tests.support.models import load_smollm2
from worker_service.config import WorkerConfig, WorkerConfigError
from worker_service.models.gguf_weights import DEQUANTIZE_ROWS, QuantWeight, quant_matmul
from worker_service.worker import Worker

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a small village at the edge of a dark and ancient forest, there lived "
    "an old clockmaker who had never once left the valley. Every morning he",
]
NEW = 32


@pytest.fixture(scope="module")
def loaded() -> tuple[Worker, Any, list[list[int]]]:
    torch.set_num_threads(2)
    tok, hf = load_smollm2()
    worker = Worker(
        WorkerConfig(model="smollm2", dtype="float32", num_threads=2, linear_impl="gguf")
    )
    worker.load_from_hf(hf)
    return worker, hf, [tok(t)["input_ids"] for t in TEXTS]


def test_every_projection_and_the_tied_head_run_on_blocks(loaded: Any) -> None:
    worker = loaded[0]
    model = worker._model
    assert model.linear is quant_matmul and model.native_decode is None
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(getattr(layer, name), QuantWeight), name
    # SmolLM2 ties its head to the embedding, which the file holds as Q8_0.
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.ggml_type == 8


def test_long_row_blocks_take_the_dequantizing_path_with_the_same_product(loaded: Any) -> None:
    """Prefill-sized inputs dequantize the weight whole (DEQUANTIZE_ROWS); the product is the
    kernel's, row by row, up to summation order."""
    weight = loaded[0]._model.layers[0].gate_up
    x = torch.randn(DEQUANTIZE_ROWS, weight.in_features, generator=torch.Generator().manual_seed(3))
    whole = quant_matmul(x, weight)
    rows = torch.cat([quant_matmul(x[i : i + 1], weight) for i in range(x.shape[0])])
    assert whole.shape == rows.shape == (DEQUANTIZE_ROWS, weight.shape[0])
    torch.testing.assert_close(whole, rows, rtol=1e-5, atol=1e-5)


def test_greedy_output_equals_hf_on_the_dequantized_file(loaded: Any) -> None:
    worker, hf, prompts = loaded
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        expected.append(out[0, len(prompt) :].tolist())
    engine = engine_on_worker(
        worker, gpu_blocks=64, cpu_blocks=0, batched_tokens=64, max_model_len=2048
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outputs = engine.generate(prompts, params)  # batched, the long prompt chunked
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


def test_a_model_that_is_not_a_gguf_file_is_refused_by_name(tmp_path: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    worker = Worker(WorkerConfig(model=str(tmp_path), dtype="float32", linear_impl="gguf"))
    with pytest.raises(WorkerConfigError, match="linear_impl.*not a GGUF file"):
        worker.load_model()
