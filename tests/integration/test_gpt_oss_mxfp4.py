"""A gpt-oss checkpoint with MXFP4 experts (tests/support/mxfp4.py packs a tiny model's):
the worker's dequantization equals transformers' own MXFP4 helper bit for bit, and the
worker's greedy tokens equal HF generate's on those dequantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler_service.engine.offline import generate
from tests.integration.test_worker_engine_tiny import (
    GREEDY,
    NEW_TOKENS,
    PROMPTS,
    hf_greedy,
    make_engine,
)
from tests.support.models import load_hf, save_tiny_model
from tests.support.mxfp4 import quantize, save_mxfp4_copy
from worker_service.config import WorkerConfig
from worker_service.models import mxfp4
from worker_service.worker import Worker

mxfp4_helpers = pytest.importorskip("transformers.integrations.mxfp4")


def oracle(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequantization of [experts, out, groups, 16] blocks, which it returns
    transposed ([experts, in, out]), put back in the checkpoint's order."""
    return mxfp4_helpers.convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # Magnitudes over many binades, so that groups get very different scales.
    weight = torch.randn(3, 40, 96, generator=gen) * torch.logspace(-6, 3, 40)[None, :, None]
    blocks, scales = quantize(weight)
    ours = mxfp4.dequantize(blocks, scales, dtype)
    assert ours.shape == weight.shape
    assert torch.equal(ours, oracle(blocks, scales, dtype))
    # The packing is a real quantization, not the identity, and within half of e2m1's largest
    # step (2) at the group's scale, which is at most a third of the group's largest weight.
    error = (ours.float() - weight).abs()
    assert (
        error <= weight.reshape(3, 40, 3, 32).abs().amax(-1).repeat_interleave(32, -1) / 3
    ).all()
    assert error.max() > 0


def test_every_code_and_a_wide_range_of_scales() -> None:
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)  # each byte once
    scales = torch.tensor(
        [[[0, 1, 100, 126, 127, 128, 130, 150, 200, 254, 5, 60, 120, 125, 129, 140]]],
        dtype=torch.uint8,
    )
    assert torch.equal(
        mxfp4.dequantize(blocks, scales, torch.float32), oracle(blocks, scales, torch.float32)
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    plain = save_tiny_model("gpt_oss", root / "plain")
    return plain, save_mxfp4_copy(plain, root / "mxfp4")


def hf_on_dequantized(plain: Path, packed: Path) -> Any:
    """The plain tiny model in transformers with its experts replaced by transformers'
    dequantization of the packed checkpoint's."""
    from safetensors.torch import load_file

    hf = load_hf(plain)
    tensors = load_file(str(packed / "model.safetensors"))
    for key in tensors:
        if key.endswith("_blocks"):
            name = key.removesuffix("_blocks")
            weight = oracle(tensors[key], tensors[f"{name}_scales"], torch.float32)
            module_name, _, attr = name.rpartition(".")
            with torch.no_grad():
                getattr(hf.get_submodule(module_name), attr).copy_(weight.transpose(1, 2))
    return hf


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_worker_on_mxfp4_checkpoint_matches_hf_on_its_dequantized_weights(
    checkpoints: tuple[Path, Path], backend: str
) -> None:
    plain, packed = checkpoints
    assert mxfp4.is_mxfp4_checkpoint(str(packed)) and not mxfp4.is_mxfp4_checkpoint(str(plain))
    hf = hf_on_dequantized(plain, packed)
    original = load_hf(plain)
    worker = Worker(
        WorkerConfig(model=str(packed), block_size=4, num_threads=1, attention_backend=backend)
    )
    worker.load_model()
    # The worker holds transformers' dequantized experts (gate and up taken apart).
    experts = hf.model.layers[1].mlp.experts
    moe = worker.model.layers[1].moe
    assert moe is not None
    gate_up = experts.gate_up_proj.transpose(1, 2)
    assert torch.equal(moe.gate_up, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(moe.down, experts.down_proj.transpose(1, 2))
    outputs = generate(make_engine(worker), PROMPTS, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    # Quantization changed the model enough to change some greedy tokens: the comparison
    # above is against the dequantized weights, not the originals.
    assert got != [hf_greedy(original, p, NEW_TOKENS) for p in PROMPTS]
