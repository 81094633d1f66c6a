"""Which matmul implementation a worker runs (`WorkerConfig.linear_impl`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmserve.model_spec import ModelSource
from worker_service.config import WorkerConfigError
from worker_service.models import ModelArchConfig
from worker_service.models.gguf_weights import holds_blocks
from worker_service.models.gguf_weights import unsupported_reason as gguf_reason
from worker_service.models.linear import packed_linear_available
from worker_service.models.native import native_linear_unsupported_reason
from worker_service.models.quantize_at_load import unsupported_reason as quantize_reason


def choose_linear_impl(
    requested: str,
    attention_backend: str,
    arch: ModelArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    source: Callable[[], ModelSource],
    quantization: str = "none",
) -> str:
    """`requested` if it can run this model here (else `WorkerConfigError` naming
    `linear_impl` and why), or what `auto` picks with the native `cpu` attention backend:
    gguf for a GGUF file with blocks that the kernels read here, else onednn where oneDNN runs
    the dtype, else native; torch with any other backend. A `quantization` other than none
    multiplies on blocks: gguf (else `WorkerConfigError` naming `quantization`;
    WorkerConfig refused linear_impls other than auto and gguf)."""
    if quantization != "none":
        if reason := quantize_reason(source(), device, dtype):
            raise WorkerConfigError(
                "quantization", f"{quantization} cannot run this model: {reason}"
            )
        return "gguf"
    onednn = packed_linear_available(device, dtype)
    native_reason = (
        f"it runs on the CPU only, not {device}"
        if device.type != "cpu"
        else native_linear_unsupported_reason(arch, dtype)
    )
    if requested == "onednn" and not onednn:
        raise WorkerConfigError(
            "linear_impl",
            f"onednn needs the CPU and float32 or bfloat16 that oneDNN supports here, not "
            f"{device} {dtype}",
        )
    if requested == "gguf" and (reason := gguf_reason(source(), device, dtype)):
        raise WorkerConfigError("linear_impl", f"gguf cannot run this model: {reason}")
    if requested == "native" and native_reason is not None:
        raise WorkerConfigError("linear_impl", f"native cannot run this model: {native_reason}")
    if requested != "auto":
        return requested
    if attention_backend != "cpu":
        return "torch"
    model = source()
    if gguf_reason(model, device, dtype) is None and holds_blocks(model):
        return "gguf"
    return "onednn" if onednn else "torch" if native_reason is not None else "native"
