"""A float safetensors checkpoint quantized at load (`--quantization q8_0|q4_1`, exact mode)
against HF's model whose weights were replaced by those blocks dequantized (by the gguf
package), greedy token for token in float32, batched and one sequence at a time (the native
decode step); and the weight bytes the worker reports, from the blocks' sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import quants

from llmserve.sampling_params import SamplingParams
from llmserve_kernels.cpu import quant
from llmserve_kernels.cpu.quant import QuantWeight
from scheduler_service.engine.offline import generate
from tests.support.engines import engine_on_worker
from tests.support.models import hf_greedy_outputs, load_hf, save_tiny_model
from worker_service.config import WorkerConfig
from worker_service.models.quantize_at_load import GGML_TYPES
from worker_service.worker import Worker

PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],
    [2, 71, 82],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31] * 4,
    [99],
    [120, 110, 100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 9, 8, 7, 6, 5],
]
NEW = 24
# untied: every projection quantizes; tied (head = embedding) with an intermediate size of
# 80, not a multiple of 32: `down` stays dense in every layer, and the native decode step,
# which takes blocks on widths of 32s only, is off.
MODELS = {"untied": {}, "tied": {"tie_word_embeddings": True, "intermediate_size": 80}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantize-at-load")
    return {
        name: save_tiny_model("llama", root / name, seed=i, **overrides)
        for i, (name, overrides) in enumerate(MODELS.items())
    }


def hf_on_blocks(path: Path, quantization: str) -> Any:
    """HF's model with each weight whose rows are a multiple of 32 quantized and dequantized
    by the gguf package (a tied matrix once)."""
    model = load_hf(path)
    ggml_type = GGML_TYPES[quantization]
    with torch.no_grad():
        for _, param in model.named_parameters():  # tied parameters come once
            if param.dim() == 2 and param.shape[1] % 32 == 0:
                blocks = quants.quantize(param.numpy(), ggml_type)
                param.copy_(torch.from_numpy(quants.dequantize(blocks, ggml_type)))
    return model


def block_bytes(hf: Any, quantization: str) -> int:
    """What the worker should hold: blocks for quantized weights, float32 for the rest."""
    per_block = quant.block_bytes(GGML_TYPES[quantization])
    total = 0
    for _, param in hf.named_parameters():
        if param.dim() == 2 and param.shape[1] % 32 == 0:
            total += param.shape[0] * param.shape[1] // 32 * per_block
        else:
            total += param.numel() * 4
    return total


@pytest.mark.parametrize("quantization", ["q8_0", "q4_1"])
@pytest.mark.parametrize("model", list(MODELS))
def test_greedy_output_equals_hf_on_the_dequantized_blocks(
    checkpoints: dict[str, Path], model: str, quantization: str
) -> None:
    torch.set_num_threads(1)
    config = WorkerConfig(
        model=str(checkpoints[model]),
        num_threads=1,
        block_size=4,
        quantization=quantization,
        quant_mode="exact",
    )
    worker = Worker(config)
    worker.load_model()
    hf = hf_on_blocks(checkpoints[model], quantization)

    decoder = worker.model
    ggml_type = GGML_TYPES[quantization]
    for layer in decoder.layers:
        for name in ("qkv", "o", "gate_up"):
            weight = getattr(layer, name)
            assert isinstance(weight, QuantWeight) and weight.ggml_type == ggml_type, name
        assert isinstance(layer.down, QuantWeight) == (model == "untied")
    assert isinstance(decoder.embed, QuantWeight) and isinstance(decoder.lm_head, QuantWeight)
    assert (decoder.lm_head is decoder.embed) == (model == "tied")
    step = decoder.decode_step
    if model == "untied":  # the native decode step was rebuilt on the blocks
        assert step is not None
        assert all(isinstance(w, QuantWeight) for lay in step._layers for w in lay.projections())
        assert decoder.native_decode.max_batch == 256  # blocks: native at every batch measured
    else:  # it takes blocks on widths of 32s only: decode steps run per layer
        assert step is None
        assert decoder.native_decode_refused == (
            "on GGUF blocks: intermediate size 80 not a multiple of 32"
        )
    info = worker.model_info
    assert (info.linear_impl, info.weight_format) == ("gguf", f"{quantization} exact")
    assert info.weight_bytes == block_bytes(hf, quantization)

    expected = hf_greedy_outputs(hf, PROMPTS, NEW)
    engine = engine_on_worker(
        worker, gpu_blocks=128, cpu_blocks=0, batched_tokens=64, max_model_len=256
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outputs = generate(engine, PROMPTS, params)  # batched, the long prompt chunked
    assert [o.outputs[0].token_ids for o in outputs] == expected
    single = generate(engine, PROMPTS[:1], params)  # decode steps of one sequence
    assert single[0].outputs[0].token_ids == expected[0]


def test_fast_mode_runs_on_the_same_blocks(checkpoints: dict[str, Path]) -> None:
    """Fast mode (8-bit activations) is not HF's model; it loads and answers, and says so."""
    config = WorkerConfig(
        model=str(checkpoints["untied"]), num_threads=1, quantization="q4_1", quant_mode="fast"
    )
    worker = Worker(config)
    worker.load_model()
    assert worker.model_info.weight_format == "q4_1 fast"
    engine = engine_on_worker(
        worker, gpu_blocks=64, cpu_blocks=0, batched_tokens=64, max_model_len=256
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = generate(engine, PROMPTS[:1], params)
    assert len(out.outputs[0].token_ids) == 8
