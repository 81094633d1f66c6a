"""Float checkpoints quantized at load (`--quantization q8_0|q4_1`) onto the GGUF blocks' kernels.

Once the model is loaded (dense, float32), every projection (each layer's fused q/k/v,
o, gate/up and down), the embedding and the LM head (a tied head is the embedding's one
weight) is quantized per row in blocks of 32 weights with ggml's own layouts, the bytes
`gguf.quants.quantize` (ggml's reference quantizer) writes:
- Q8_0: an fp16 scale d and 32 int8 q, w = q * d (34 bytes per block);
- Q4_1: fp16 d and min m, 32 nibbles, w = q * d + m (20 bytes).
`gguf_weights.install_blocks` then swaps them in for the dense weights, which are dropped,
and rebuilds the native decode step on them: from there the model runs as one loaded from a
GGUF file with `--linear-impl gguf`, in the worker's `--quant-mode`. A weight whose rows are
not a multiple of 32 weights stays dense, with a warning.

The quantizer is gguf's numpy one (its time on SmolLM2: bench/RESULTS.md, "Figures moved out
of code comments").
"""

from __future__ import annotations

import time

import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType

from llmserve.logs import get_logger
from llmserve.model_spec import ModelSource
from llmserve_kernels.cpu import quant
from llmserve_kernels.cpu.quant import QuantMode, QuantWeight
from worker_service.config import WorkerConfigError
from worker_service.models.decoder import DecoderModel
from worker_service.models.gguf_weights import install_blocks, keep_gguf_blocks

log = get_logger("worker.quantize")

# `--quantization` values that quantize, and the ggml type each writes.
GGML_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_1": GGMLQuantizationType.Q4_1}
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def unsupported_reason(source: ModelSource, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this model cannot be quantized at load here, or None."""
    if source.gguf_file is not None:
        return (
            f"the model {source.spec!r} is a GGUF file, already quantized: keep its blocks "
            f"with --linear-impl gguf"
        )
    if device.type != "cpu" or dtype != torch.float32:
        return f"its kernels run on the CPU in float32, not {device} {dtype}"
    return None


def quantize_rows(
    weight: torch.Tensor,  # [out_features, in_features] float32, in_features a multiple of 32
    ggml_type: int,
) -> torch.Tensor:  # [out_features, in_features / 32 * block bytes] uint8
    """The weight's rows in blocks of `ggml_type` (Q8_0 or Q4_1), byte for byte ggml's."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"expected a 2-d float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    if weight.shape[1] % quant.BLOCK:
        raise ValueError(f"{weight.shape[1]} weights per row, not a multiple of {quant.BLOCK}")
    rows = weight.detach().cpu().contiguous().numpy()
    return torch.from_numpy(quants.quantize(rows, GGMLQuantizationType(ggml_type)))


def quantize_weight(weight: torch.Tensor, ggml_type: int) -> QuantWeight | None:
    """`weight` [out, in] as blocks of `ggml_type`, or None when its rows are not a multiple
    of 32 weights (it stays dense)."""
    if weight.shape[1] % quant.BLOCK:
        return None
    return QuantWeight(int(ggml_type), quantize_rows(weight, ggml_type), int(weight.shape[1]))


def quantize_model(model: DecoderModel, quantization: str, mode: QuantMode = "exact") -> int:
    """Quantize `model`'s projections, embedding and LM head (a dense float32 model on the
    CPU) to `quantization` (q8_0 or q4_1), install the blocks (multiplied in `mode`) in place
    of the dense weights and rebuild its native decode step on them. Returns the bytes of
    blocks installed."""
    ggml_type = GGML_TYPES[quantization]
    dense: list[tuple[str, torch.Tensor]] = []  # (name, weight) left dense

    def blocks(name: str, weight: torch.Tensor | None) -> QuantWeight | None:
        if weight is None:  # e.g. the MLP of an MoE layer, which stays dense
            return None
        quantized = quantize_weight(weight, ggml_type)
        if quantized is None:
            dense.append((name, weight))
        return quantized

    projections = [
        {name: blocks(f"layers.{i}.{name}", getattr(layer, name)) for name in _PROJECTIONS}
        for i, layer in enumerate(model.layers)
    ]
    embed = blocks("embed", model.embed)
    tied = model.lm_head.data_ptr() == model.embed.data_ptr()
    head = embed if tied else blocks("lm_head", model.lm_head)
    if all(w is None for w in (embed, head)) and not any(
        w is not None for swaps in projections for w in swaps.values()
    ):
        raise WorkerConfigError(
            "quantization", f"no weight of this model has rows of a multiple of {quant.BLOCK}"
        )
    for name, weight in dense:
        log.warning(
            "weight left dense: its rows are not a multiple of 32 weights",
            weight=name,
            shape=list(weight.shape),
            dense_bytes=weight.numel() * weight.element_size(),
        )
    return install_blocks(
        model, projections, embed, head, mode, weight_format=f"{quantization} {mode}"
    )


def load_blocks(
    model: DecoderModel, quantization: str, mode: QuantMode, source: ModelSource
) -> None:
    """Put `model`'s weights in blocks multiplied in `mode`: quantized at load when
    `quantization` is not `none`, else its GGUF file's (`source`) as they are."""
    if quantization != "none":
        start = time.perf_counter()
        kept = quantize_model(model, quantization, mode)
        seconds = round(time.perf_counter() - start, 2)
        log.info("weights quantized at load", to=quantization, bytes=kept, seconds=seconds)
    else:
        kept = keep_gguf_blocks(model, source, mode)
        log.info("weights kept in GGUF blocks", bytes=kept, mode=mode)
