"""Quantization at load (`--quantization`): the quantizer against a torch transcription of
ggml's reference (ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q4_1_ref) byte for
byte, what its blocks dequantize to, and the options' refusals, each naming `quantization`."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType

from llmserve.model_spec import ModelSource
from llmserve_kernels.cpu import quant
from tests.support.models import tiny_config
from worker_service.config import WorkerConfig, WorkerConfigError
from worker_service.linear_impl import choose_linear_impl
from worker_service.models import read_arch
from worker_service.models.quantize_at_load import quantize_rows, quantize_weight

Q8_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1
TYPES = [pytest.param(Q8_0, id="q8_0"), pytest.param(Q4_1, id="q4_1")]


def ggml_q8_0(w: torch.Tensor) -> torch.Tensor:  # [rows, cols] float32 -> [rows, cols/32*34]
    """ggml's reference: d = amax / 127, q = roundf(x * (1 / d)) (half away from zero)."""
    blocks = w.reshape(-1, 32)  # [n, 32]
    d = blocks.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = blocks * inv  # float32, as ggml multiplies
    q = (x.double().abs() + 0.5).floor() * x.sign()  # exact in float64
    scale = d.half().view(torch.uint8).reshape(-1, 2)
    return torch.cat([scale, q.to(torch.int8).view(torch.uint8)], 1).reshape(w.shape[0], -1)


def ggml_q4_1(w: torch.Tensor) -> torch.Tensor:  # [rows, cols] float32 -> [rows, cols/32*20]
    """ggml's reference: d = (max - min) / 15, q = (int8)((x - min) * (1 / d) + 0.5) up to
    15; weights 0-15 in the low nibbles, 16-31 in the high ones."""
    blocks = w.reshape(-1, 32)
    lo, hi = blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = ((blocks - lo) * inv + 0.5).trunc().clamp(max=15).to(torch.uint8)
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    scales = torch.cat([d.half(), lo.half()], 1).view(torch.uint8)
    return torch.cat([scales, nibbles], 1).reshape(w.shape[0], -1)


REFERENCE = {Q8_0: ggml_q8_0, Q4_1: ggml_q4_1}


def awkward_weights(rows: int, cols: int, seed: int) -> torch.Tensor:  # [rows, cols] float32
    """Random weights at mixed scales, with whole blocks that are zero, negative only,
    positive only, constant, or tiny enough for subnormal fp16 scales, and exact halves."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.1
    w[0, :32] = 0.0
    w[1, 32:64] = -w[1, 32:64].abs() - 0.01
    w[2, :32] = w[2, :32].abs()
    w[3, 32:64] = -0.375
    w[4, :32] *= 1e-6
    w[5, :32] = torch.arange(32, dtype=torch.float32) - 15.5  # (x - min) / d on .5 marks
    w[6, :32] = torch.arange(-16, 16, dtype=torch.float32) * 127 / 16  # q8: x / d on .5 marks
    return w


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("cols", [32, 576, 1536])
def test_blocks_are_ggmls_reference_byte_for_byte(ggml_type: int, cols: int) -> None:
    w = awkward_weights(48, cols, seed=cols)
    blocks = quantize_rows(w, ggml_type)
    assert blocks.dtype == torch.uint8
    assert blocks.shape == (48, cols // 32 * quant.block_bytes(ggml_type))
    assert torch.equal(blocks, REFERENCE[ggml_type](w))


def test_a_zero_block_is_zero_bytes_and_a_negative_one_keeps_its_min() -> None:
    w = awkward_weights(8, 64, seed=1)
    q8 = quantize_rows(w, Q8_0)
    assert not q8[0, :34].any()  # d = 0, q = 0
    q41 = quantize_rows(w, Q4_1)
    d, m = q41[1, 20:24].view(torch.float16).float()
    assert m == w[1, 32:64].min().half().float() and m < 0 and d > 0
    d, m = q41[3, 20:24].view(torch.float16).float()  # constant: d = 0, every q = 0
    assert (d, m) == (0.0, -0.375) and not q41[3, 24:40].any()


@pytest.mark.parametrize("ggml_type", TYPES)
def test_blocks_dequantize_within_half_a_step_of_the_weights(ggml_type: int) -> None:
    w = awkward_weights(64, 256, seed=7)
    blocks = quantize_rows(w, ggml_type)
    back = quant.dequantize(ggml_type, blocks, 256)
    per_block = w.reshape(-1, 32)
    if ggml_type == Q8_0:
        step = per_block.abs().amax(1, keepdim=True) / 127
    else:
        step = (per_block.amax(1, keepdim=True) - per_block.amin(1, keepdim=True)) / 15
    # Half a step, plus the fp16 rounding of the scale (and of Q4_1's min): relative, or
    # half a subnormal's quantum (2**-25) times 127 steps for tiny blocks.
    bound = step * 0.56 + per_block.abs().amax(1, keepdim=True) * 2**-10 + 127 * 2**-25
    error = (back.reshape(-1, 32) - per_block).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert torch.equal(back[0, :32], torch.zeros(32))


def test_rows_not_a_multiple_of_32_stay_dense() -> None:
    w = torch.randn(16, 80)
    assert quantize_weight(w, Q8_0) is None
    with pytest.raises(ValueError, match="80 weights per row"):
        quantize_rows(w, Q8_0)
    kept = quantize_weight(torch.randn(16, 96), Q4_1)
    assert kept is not None and kept.shape == (16, 96) and kept.nbytes == 16 * 3 * 20
    kept.check()
    with pytest.raises(ValueError, match="float32"):
        quantize_rows(torch.randn(16, 96, dtype=torch.bfloat16), Q8_0)


# -- options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "q4_k"}, "must be none|q8_0|q4_1, got q4_k"),
        ({"quantization": "q8_0", "linear_impl": "onednn"}, "auto or gguf, not onednn"),
        ({"quantization": "q4_1", "linear_impl": "torch"}, "auto or gguf, not torch"),
        ({"quantization": "q8_0", "dtype": "bfloat16"}, "CPU in float32, not device auto"),
        ({"quantization": "q4_1", "device": "cuda"}, "CPU in float32, not device cuda"),
    ],
)
def test_options_quantization_cannot_run_with_are_refused_by_name(
    options: dict[str, str], message: str
) -> None:
    with pytest.raises(WorkerConfigError, match=message) as info:
        WorkerConfig(**options)  # type: ignore[arg-type]
    assert info.value.field == "quantization"


def test_linear_impl_gguf_or_auto_and_quantization_none_with_anything_are_accepted() -> None:
    assert WorkerConfig(quantization="q8_0", linear_impl="gguf").quantization == "q8_0"
    assert WorkerConfig(quantization="q4_1", dtype="float32", device="cpu").linear_impl == "auto"
    assert WorkerConfig(linear_impl="onednn", dtype="bfloat16").quantization == "none"


def choose(source: ModelSource, dtype: torch.dtype = torch.float32, quantization: str = "q8_0"):
    arch = read_arch(tiny_config("llama"), "LlamaForCausalLM")
    cpu = torch.device("cpu")
    return choose_linear_impl("auto", "cpu", arch, cpu, dtype, lambda: source, quantization)


def test_a_gguf_file_or_a_dtype_resolved_to_other_than_float32_is_refused_by_name() -> None:
    gguf = ModelSource("smollm2", "/models/smollm2", "SmolLM2.Q4_1.gguf")
    with pytest.raises(WorkerConfigError, match="already quantized.*--linear-impl gguf") as info:
        choose(gguf)
    assert info.value.field == "quantization"
    with pytest.raises(WorkerConfigError, match="not cpu torch.bfloat16") as info:
        choose(ModelSource("tiny", "/models/tiny"), torch.bfloat16, "q4_1")
    assert info.value.field == "quantization"
    # A float checkpoint on CPU float32 multiplies on blocks.
    assert choose(ModelSource("tiny", "/models/tiny")) == "gguf"


def test_the_flag_and_its_variable_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_service.__main__ import build_config, parse_args

    assert build_config(parse_args([])).quantization == "none"
    assert build_config(parse_args(["--quantization", "q4_1"])).quantization == "q4_1"
    monkeypatch.setenv("LLMSERVE_QUANTIZATION", "q8_0")
    assert build_config(parse_args([])).quantization == "q8_0"
