"""Argument checks shared by the kernel wrappers.

User mistakes (a wrong shape, dtype or device) raise `KernelArgumentError` naming the argument,
so callers can map them to INVALID_ARGUMENT; asserts stay for internal invariants.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelArgumentError(ValueError):
    """A kernel wrapper was called with an argument of the wrong shape, dtype or device."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise KernelArgumentError(name, f"expected {layout}, got shape {tuple(tensor.shape)}")


def check_dim(name: str, tensor: torch.Tensor, dim: int, size: int, what: str) -> None:
    if tensor.shape[dim] != size:
        raise KernelArgumentError(
            name, f"dimension {dim} is {tensor.shape[dim]}, expected {size} ({what})"
        )


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelArgumentError(name, f"dtype {tensor.dtype} not supported (expected {names})")


def check_same_dtype(name: str, tensor: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if tensor.dtype != like.dtype:
        raise KernelArgumentError(
            name, f"dtype {tensor.dtype} differs from {like_name} dtype {like.dtype}"
        )


def check_inner_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The last dimension must be unit-stride so that rows load as vectors."""
    if tensor.stride(-1) != 1:
        raise KernelArgumentError(
            name, f"last dimension must be contiguous, got strides {tensor.stride()}"
        )


def check_device(
    kernel: object, tensors: dict[str, torch.Tensor], device: torch.device | None = None
) -> None:
    """All tensors on one device, and a device the compiled kernel can run on."""
    first_name, first = next(iter(tensors.items()))
    device = device or first.device
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise KernelArgumentError(
                name, f"on {tensor.device}, expected {device} (like {first_name})"
            )
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise KernelArgumentError(
            first_name,
            f"tensors on {device} need the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing kernels, or move the tensors to CUDA",
        )


def is_interpreted(kernel: object) -> bool:
    return isinstance(kernel, InterpretedFunction)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
