"""The matmul implementations the decoder can run its projections with: torch's `F.linear`,
oneDNN with weights prepacked at load (`packed_matmul`), or the native C++ kernel that reads
bfloat16 weights as they are (`native_matmul`)."""

from __future__ import annotations

import torch

from llmserve_kernels.cpu.linear_rows import linear_rows

# Rows the packed weights are laid out for: oneDNN picks its blocking by this hint; the packed
# weights serve any number of rows (measured here: packing for 64 runs 1-2048 rows as fast as
# packing for each size).
_PACKED_ROWS_HINT = 64


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN matmuls with prepacked weights can run: CPU, float32 or bfloat16.

    They are faster than F.linear on the 2-core AVX-512 CPU of bench/RESULTS.md ("Offline
    throughput": the 30 layers of SmolLM2), in float32 (F.linear goes to MKL there) and in
    bfloat16, where F.linear re-lays its weights out on every call.
    bfloat16 results are bit-identical to F.linear; float32 ones differ in summation order.

    oneDNN's bfloat16 path needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
    it refuses to pack bfloat16 weights, so bfloat16 keeps F.linear there.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def packed_matmul(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # packed by torch.ops.mkldnn._reorder_linear_weight
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def native_matmul(
    x: torch.Tensor,  # [rows, in]
    weight: torch.Tensor,  # [out, in], checked at load
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [rows, out]
    return linear_rows(x.contiguous(), weight, bias, check=False)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKED_ROWS_HINT)
