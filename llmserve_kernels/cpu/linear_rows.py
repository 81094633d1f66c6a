"""The native decode step's projection kernel on its own (decode.cpp's `llmserve_linear_rows`),
for the model's per-layer path, tests and benchmarks: `x @ weight.T + bias`, reading each
weight row once for all rows of x."""

from __future__ import annotations

import torch

from llmserve_kernels._checks import KernelArgumentError
from llmserve_kernels.cpu.attention import DTYPE_CODES
from llmserve_kernels.cpu.build import library


def linear_rows(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,  # [out]
    check: bool = True,
) -> torch.Tensor:  # [n, out] = x @ weight.T + bias, in x's dtype
    """`check=False` skips the argument checks, for the model's per-layer path, whose
    weights were checked at load (`native_linear_unsupported_reason`) and whose activations
    it makes itself."""
    if check:
        _check_linear(x, weight, bias)
    out = x.new_empty(x.shape[0], weight.shape[0])
    library().llmserve_linear_rows(
        DTYPE_CODES[x.dtype],
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        weight.shape[0],
    )
    return out


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, tensor, ndim in (("x", x, 2), ("weight", weight, 2), ("bias", bias, 1)):
        if tensor is None:
            continue
        if tensor.dim() != ndim or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise KernelArgumentError(name, f"expected a contiguous {ndim}-d CPU tensor")
        if tensor.dtype != x.dtype or x.dtype not in DTYPE_CODES:
            raise KernelArgumentError(name, f"dtype {tensor.dtype}: expected float32 or bfloat16")
    if weight.shape[1] != x.shape[1] or x.shape[1] % 8:
        raise KernelArgumentError(
            "weight", f"in features {weight.shape[1]} vs x's {x.shape[1]} (a multiple of 8)"
        )
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise KernelArgumentError("bias", f"size {bias.shape[0]} != {weight.shape[0]} outputs")
