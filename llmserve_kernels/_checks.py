"""Argument checks shared by the kernel wrappers.

User mistakes (a wrong shape, dtype or device) raise `KernelArgumentError` naming the argument,
so callers can map them to INVALID_ARGUMENT; asserts stay for internal invariants. The C++
kernels (llmserve_kernels.cpu) share these checks, so this module does not import Triton.
"""

from __future__ import annotations

import math

import torch

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
    if device.type != "cuda" and not is_interpreted(kernel):
        raise KernelArgumentError(
            first_name,
            f"tensors on {device} need the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing kernels, or move the tensors to CUDA",
        )


def check_paged_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, like: torch.Tensor, like_name: str
) -> tuple[int, int, int, int]:
    """Validate a key/value cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_ndim("key_cache", key_cache, 4, layout)
    check_ndim("value_cache", value_cache, 4, layout)
    if value_cache.shape != key_cache.shape:
        raise KernelArgumentError(
            "value_cache",
            f"shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}",
        )
    check_same_dtype("key_cache", key_cache, like, like_name)
    check_same_dtype("value_cache", value_cache, like, like_name)
    check_inner_contiguous("key_cache", key_cache)
    check_inner_contiguous("value_cache", value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_block_layout(key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    """Paged caches of one shape `[num_blocks, block_size, num_kv_heads, head_dim]` whose
    blocks are each dense (a block's rows back to back) and lie one stride apart in both
    caches, at least a block's size: further when a layer's caches are views into a
    block-major pool that all layers share. Returns that block stride, in elements."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not cache.is_contiguous() and not rows_dense(cache):
            raise KernelArgumentError(
                name, f"each block must be contiguous, got strides {cache.stride()}"
            )
    stride = key_cache.stride(0)
    if key_cache.shape[0] > 1:  # a single block's stride is never used
        if value_cache.stride(0) != stride:
            raise KernelArgumentError(
                "value_cache",
                f"block stride {value_cache.stride(0)} differs from key_cache's {stride}",
            )
        block = math.prod(key_cache.shape[1:])
        if stride < block:
            raise KernelArgumentError(
                "key_cache", f"blocks overlap: {stride} elements apart, of {block} each"
            )
    return stride


def rows_dense(tensor: torch.Tensor) -> bool:
    """Whether every dimension but the first is laid out row-major without gaps (strides of
    dimensions of size 1 do not count, as in `is_contiguous`): each row (a cache's block) is
    dense, and rows may lie apart."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_block_tables(block_tables: torch.Tensor, num_seqs: int) -> None:
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_dim("block_tables", block_tables, 0, num_seqs, "num_seqs")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_inner_contiguous("block_tables", block_tables)


def check_seq_lens(seq_lens: torch.Tensor, num_seqs: int) -> None:
    check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    check_dim("seq_lens", seq_lens, 0, num_seqs, "num_seqs")
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_inner_contiguous("seq_lens", seq_lens)


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape:
        raise KernelArgumentError(
            "out", f"shape {tuple(out.shape)} differs from query {tuple(like.shape)}"
        )
    check_same_dtype("out", out, like, "query")
    check_inner_contiguous("out", out)
    return out


def check_window_softcap(sliding_window: int | None, softcap: float | None) -> tuple[int, float]:
    """The window and soft-cap of an attention call, with 0 for "none" (a window of None or 0
    sees every earlier key; a soft-cap of None is off). A window counts tokens, the query's own
    included; a soft-cap must be a positive, finite number."""
    window = 0 if sliding_window is None else sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise KernelArgumentError(
            "sliding_window", f"must be a non-negative integer or None, got {sliding_window!r}"
        )
    if softcap is None:
        return window, 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, int | float):
        raise KernelArgumentError("softcap", f"must be a number or None, got {softcap!r}")
    if not (softcap > 0 and math.isfinite(softcap)):
        raise KernelArgumentError("softcap", f"must be positive and finite, got {softcap}")
    return window, float(softcap)


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    """Attention sinks, when given: one logit per query head, [num_heads], on the
    query's device, contiguous, in a float dtype."""
    if sinks is None:
        return
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise KernelArgumentError(
            "sinks", f"expected [{num_heads}] (one per query head), got {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise KernelArgumentError("sinks", f"must be a float tensor, got {sinks.dtype}")
    if sinks.device != device:
        raise KernelArgumentError("sinks", f"must be on {device}, got {sinks.device}")
    if not sinks.is_contiguous():
        raise KernelArgumentError("sinks", "must be contiguous")


def is_interpreted(kernel: object) -> bool:
    """Whether a Triton kernel runs under the interpreter (only asked of Triton kernels)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def next_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def check_query_start_loc(query_start_loc: torch.Tensor, num_tokens: int) -> list[int]:
    """Offsets of sequences packed one after another: [num_seqs + 1] integers, starting at 0,
    never decreasing, ending at num_tokens. Returns them as a list."""
    check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    if query_start_loc.dtype not in (torch.int32, torch.int64) or query_start_loc.shape[0] < 1:
        raise KernelArgumentError("query_start_loc", "expected [num_seqs + 1] int32 or int64")
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise KernelArgumentError(
            "query_start_loc",
            f"must run from 0 to {num_tokens} (tokens), got {starts[0]}..{starts[-1]}",
        )
    if any(b < a for a, b in zip(starts, starts[1:], strict=False)):
        raise KernelArgumentError("query_start_loc", "must not decrease")
    return starts


def check_state_slots(state_slots: torch.Tensor, num_seqs: int, num_slots: int) -> list[int]:
    """Each sequence's slot in a state pool: [num_seqs] integers in [0, num_slots), no two
    alike (two sequences writing one slot would race). Returns them as a list."""
    check_ndim("state_slots", state_slots, 1, "[num_seqs]")
    check_dim("state_slots", state_slots, 0, num_seqs, "num_seqs")
    if state_slots.dtype not in (torch.int32, torch.int64):
        raise KernelArgumentError(
            "state_slots", f"expected int32 or int64, got {state_slots.dtype}"
        )
    slots = state_slots.tolist()
    if any(not 0 <= slot < num_slots for slot in slots):
        raise KernelArgumentError("state_slots", f"slots must lie in [0, {num_slots})")
    if len(set(slots)) != len(slots):
        raise KernelArgumentError("state_slots", "a slot appears twice")
    return slots


def check_has_initial_state(has_initial_state: torch.Tensor | None, num_seqs: int) -> list[bool]:
    """Per sequence, whether its slot holds a state to continue from (None: all do)."""
    if has_initial_state is None:
        return [True] * num_seqs
    check_ndim("has_initial_state", has_initial_state, 1, "[num_seqs]")
    check_dim("has_initial_state", has_initial_state, 0, num_seqs, "num_seqs")
    check_dtype("has_initial_state", has_initial_state, (torch.bool,))
    return [bool(x) for x in has_initial_state.tolist()]
