"""Weights kept in GGUF blocks (issue #27): dequantization and the linear layer's two modes.

A quantized weight (`QuantWeight`) is a uint8 tensor [out_features, in_features / block
weights * block bytes]: each row its blocks, as a GGUF file stores them (`quant.cpp` has the
layouts). Types are ggml's codes (`gguf.GGMLQuantizationType`): Q4_0, Q4_1, Q5_0 and Q8_0
(blocks of 32 weights) and Q4_K, Q5_K and Q6_K (256) have kernels. Dequantized weights are
bit-identical to the gguf package's (what transformers loads). The linear layer's modes
(`MODES`):
- exact: x @ dequantize(w).T up to summation order;
- fast: x quantized to 8 bits per block of 32 first (`quantize_activations`), then integer
  dot products: the exact product of those rounded activations with the weights, up to
  summation order.

For fast mode, weights of every type here can be interleaved by groups of `INTERLEAVE_ROWS`
rows (`interleave`, quant_interleaved.cpp and .h): the same bytes regrouped so that one integer
multiply-add serves eight rows, with outputs bit for bit those of the file's layout. Kernels take such a weight's `code`: its type with `INTERLEAVED` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from llmserve_kernels._checks import KernelArgumentError
from llmserve_kernels.cpu.build import library

BLOCK = 32  # weights per block of the 32-weight types, and per block of fast mode's activations
MAX_IN_FEATURES = 16384  # the longest row exact mode dequantizes at once (quant.cpp)
INTERLEAVED = 256  # set in a type code: the weight's rows are interleaved (quant.h kInterleaved)
INTERLEAVE_ROWS = 8  # rows per interleaved group (quant.h kInterleaveRows)
QuantMode = Literal["exact", "fast"]
MODES: tuple[QuantMode, ...] = ("exact", "fast")


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A weight [out_features, in_features] kept as GGUF blocks."""

    ggml_type: int
    blocks: torch.Tensor  # [out_features, in_features / 32 * block bytes] uint8, contiguous
    in_features: int
    interleaved: bool = False  # rows regrouped for fast mode (`interleave`)

    @property
    def code(self) -> int:
        """The type code kernels take: `ggml_type`, with INTERLEAVED when interleaved."""
        return self.ggml_type | (INTERLEAVED if self.interleaved else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.in_features

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def data_ptr(self) -> int:
        return self.blocks.data_ptr()

    def check(self) -> None:
        """Raise `KernelArgumentError` unless the kernels can read it."""
        _check_weight(self.code, self.blocks, self.in_features)


def block_bytes(ggml_type: int) -> int:
    """Bytes of one block of `ggml_type` (a type code: interleaved, its type's); 0 when it
    has no kernel here."""
    return int(library().llmserve_quant_block_bytes(int(ggml_type)))


def block_weights(ggml_type: int) -> int:
    """Weights in one block of `ggml_type` (32; 256 for the k-quants)."""
    return int(library().llmserve_quant_block_weights(int(ggml_type)))


def interleaves(ggml_type: int) -> bool:
    """Whether this build multiplies weights of `ggml_type` interleaved (`interleave`)."""
    return bool(library().llmserve_quant_interleaves(int(ggml_type)))


def matrix_engine_rows() -> int:
    """The fewest activation rows a call needs to go to the matrix engine (quant_amx.h;
    build.set_matrix_engine turns it on and off)."""
    return int(library().llmserve_quant_matrix_engine_rows())


def interleave(weight: QuantWeight) -> QuantWeight | None:
    """`weight` with its rows interleaved for fast mode (new bytes; `weight` is unchanged), or
    None when it cannot be: a type this build does not interleave, or rows that are not a
    multiple of INTERLEAVE_ROWS."""
    rows, in_features = weight.shape
    if weight.interleaved or not interleaves(weight.ggml_type) or rows % INTERLEAVE_ROWS:
        return None
    weight.check()
    out = torch.empty_like(weight.blocks)
    status = library().llmserve_quant_interleave(
        weight.ggml_type, weight.blocks.data_ptr(), rows, in_features, out.data_ptr()
    )
    assert status == 0, "checked above"
    return QuantWeight(weight.ggml_type, out, in_features, interleaved=True)


def _check_weight(ggml_type: int, weight: torch.Tensor, in_features: int) -> int:
    """The weight's rows (out features), after checking it against `in_features` (ggml_type:
    a type code)."""
    size = block_bytes(ggml_type)
    if size == 0:
        raise KernelArgumentError("ggml_type", f"no kernel for ggml type {ggml_type}")
    weights = block_weights(ggml_type)
    if in_features % weights:
        raise KernelArgumentError(
            "in_features", f"{in_features} is not a multiple of the block size {weights}"
        )
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.device.type != "cpu":
        raise KernelArgumentError("weight", "expected a 2-d uint8 CPU tensor of blocks")
    if not weight.is_contiguous():
        raise KernelArgumentError("weight", f"must be contiguous, got strides {weight.stride()}")
    row_bytes = in_features // weights * size
    if weight.shape[1] != row_bytes:
        raise KernelArgumentError(
            "weight",
            f"rows of {weight.shape[1]} bytes, expected {row_bytes} for {in_features} weights",
        )
    if ggml_type & INTERLEAVED and weight.shape[0] % INTERLEAVE_ROWS:
        raise KernelArgumentError(
            "weight", f"{weight.shape[0]} interleaved rows, not a multiple of {INTERLEAVE_ROWS}"
        )
    return int(weight.shape[0])


def dequantize(
    ggml_type: int,  # a type code (`QuantWeight.code`)
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


def _check_activations(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise KernelArgumentError("x", "expected a 2-d float32 CPU tensor")
    if not x.is_contiguous():
        raise KernelArgumentError("x", f"must be contiguous, got strides {x.stride()}")


def linear(
    x: torch.Tensor,  # [n, in_features] float32
    ggml_type: int,  # a type code (`QuantWeight.code`): interleaved in fast mode only
    weight: torch.Tensor,  # [out_features, in_features / 32 * block bytes] uint8
    mode: QuantMode = "exact",
) -> torch.Tensor:  # [n, out_features] float32: x @ dequantize(weight).T in `mode`
    _check_activations(x)
    if mode not in MODES:
        raise KernelArgumentError("mode", f"{mode!r}: one of {', '.join(MODES)}")
    if mode == "exact" and ggml_type & INTERLEAVED:
        raise KernelArgumentError("mode", "interleaved weights are multiplied in fast mode only")
    n, in_features = x.shape
    if mode == "exact" and in_features > MAX_IN_FEATURES:
        raise KernelArgumentError(
            "x", f"{in_features} input features, over exact mode's {MAX_IN_FEATURES}"
        )
    out_features = _check_weight(ggml_type, weight, in_features)
    out = torch.empty(n, out_features, dtype=torch.float32)
    kernel = (
        library().llmserve_quant_linear if mode == "exact" else library().llmserve_quant_linear_fast
    )
    if n and out_features and in_features:
        kernel(
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


ACTIVATION_BLOCK_BYTES = 40  # float d, float d * sum(q), 32 int8 q (quant.cpp's ActBlock)


def quantize_activations(
    x: torch.Tensor,  # [n, cols] float32, cols a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # d, s [n, cols / 32]; q [n, cols] int8
    """Fast mode's 8-bit activations: per block of 32, d = max|x| / 127, q = x * (1 / d)
    rounded half to even, s = d * sum(q)."""
    _check_activations(x)
    n, cols = x.shape
    if cols % BLOCK:
        raise KernelArgumentError("x", f"{cols} columns, not a multiple of {BLOCK}")
    raw = torch.empty(n, cols // BLOCK, ACTIVATION_BLOCK_BYTES, dtype=torch.uint8)
    library().llmserve_quant_activations(x.data_ptr(), n, cols, raw.data_ptr())
    scales = raw[..., :8].contiguous().view(torch.float32)  # [n, blocks, 2]
    return (
        scales[..., 0],
        scales[..., 1],
        raw[..., 8:].contiguous().view(torch.int8).reshape(n, cols),
    )


def round_activations(
    x: torch.Tensor,  # [n, cols] float32, cols a multiple of 32
) -> torch.Tensor:  # [n, cols] float32: q * d, the values fast mode's integer dots multiply
    """x as fast mode sees it (`quantize_activations`), back in float32: a product with a
    dequantized weight is then fast mode's up to summation order."""
    d, _, q = quantize_activations(x)
    n, cols = x.shape
    return (q.view(n, cols // BLOCK, BLOCK).float() * d[..., None]).view(n, cols)
