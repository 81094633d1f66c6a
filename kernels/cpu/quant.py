"""Weights kept in GGUF blocks (issue #27): dequantization and the exact-mode linear layer.

A quantized weight is a uint8 tensor [out_features, in_features / 32 * block bytes]: each row
its blocks of 32 weights, as a GGUF file stores them (`quant.cpp` has the layouts). Types are
ggml's codes (`gguf.GGMLQuantizationType`): Q4_0, Q4_1 and Q8_0 have kernels. Dequantized
weights are bit-identical to the gguf package's (what transformers loads); the exact-mode
linear equals x @ dequantize(w).T up to summation order.
"""

from __future__ import annotations

import torch

from kernels._checks import KernelArgumentError
from kernels.cpu.build import library

BLOCK = 32  # weights per block, every type here
MAX_IN_FEATURES = 16384  # the longest row the linear dequantizes at once (quant.cpp)


def block_bytes(ggml_type: int) -> int:
    """Bytes of one block of `ggml_type`; 0 when it has no kernel here."""
    return int(library().llmserve_quant_block_bytes(int(ggml_type)))


def _check_weight(ggml_type: int, weight: torch.Tensor, in_features: int) -> int:
    """The weight's rows (out features), after checking it against `in_features`."""
    size = block_bytes(ggml_type)
    if size == 0:
        raise KernelArgumentError("ggml_type", f"no kernel for ggml type {ggml_type}")
    if in_features % BLOCK:
        raise KernelArgumentError(
            "in_features", f"{in_features} is not a multiple of the block size {BLOCK}"
        )
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.device.type != "cpu":
        raise KernelArgumentError("weight", "expected a 2-d uint8 CPU tensor of blocks")
    if not weight.is_contiguous():
        raise KernelArgumentError("weight", f"must be contiguous, got strides {weight.stride()}")
    row_bytes = in_features // BLOCK * size
    if weight.shape[1] != row_bytes:
        raise KernelArgumentError(
            "weight",
            f"rows of {weight.shape[1]} bytes, expected {row_bytes} for {in_features} weights",
        )
    return int(weight.shape[0])


def dequantize(
    ggml_type: int,
    weight: torch.Tensor,  # [out_features, in_features / 32 * block bytes] uint8
    in_features: int,
) -> torch.Tensor:  # [out_features, in_features] float32
    rows = _check_weight(ggml_type, weight, in_features)
    out = torch.empty(rows, in_features, dtype=torch.float32)
    if rows and in_features:
        library().llmserve_quant_dequantize(
            int(ggml_type), weight.data_ptr(), rows, in_features, out.data_ptr()
        )
    return out


def linear(
    x: torch.Tensor,  # [n, in_features] float32
    ggml_type: int,
    weight: torch.Tensor,  # [out_features, in_features / 32 * block bytes] uint8
) -> torch.Tensor:  # [n, out_features] float32: x @ dequantize(weight).T, exact mode
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelArgumentError("x", "expected a 2-d float32 CPU tensor")
    if not x.is_contiguous():
        raise KernelArgumentError("x", f"must be contiguous, got strides {x.stride()}")
    n, in_features = x.shape
    if in_features > MAX_IN_FEATURES:
        raise KernelArgumentError(
            "x", f"{in_features} input features, over this kernel's {MAX_IN_FEATURES}"
        )
    out_features = _check_weight(ggml_type, weight, in_features)
    out = torch.empty(n, out_features, dtype=torch.float32)
    if n and out_features and in_features:
        library().llmserve_quant_linear(
            int(ggml_type),
            x.data_ptr(),
            n,
            in_features,
            weight.data_ptr(),
            out_features,
            out.data_ptr(),
        )
    elif n and out_features:
        out.zero_()
    return out
