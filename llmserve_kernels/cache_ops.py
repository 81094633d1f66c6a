"""Cache writes: new K/V into their slots, and whole-block copies for copy-on-write.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`; a slot is
`block * block_size + offset`. The kernels take the caches' strides, so blocks may lie further
apart than a block (a layer's views into a block-major pool of all layers); head_dim must be
unit-stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve_kernels._checks import (
    FLOAT_DTYPES,
    KernelArgumentError,
    check_device,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_ndim,
    check_paged_cache,
    check_same_dtype,
    next_power_of_2,
)

# Elements per program of copy_blocks.
COPY_CHUNK = 1024


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, negative = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    in_bounds = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # The slot test is broadcast to a full tile: the interpreter rejects a scalar-bool mask term.
    mask = in_bounds & (tl.zeros_like(in_bounds.to(tl.int64)) + slot >= 0)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kct + heads[:, None] * stride_kch
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vct + heads[:, None] * stride_vch
    tl.store(k_dst + dims, k, mask=mask)
    tl.store(v_dst + dims, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_blocks, block_numel...], each block contiguous
    block_mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(block_mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pair * 2 + 1).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offsets < BLOCK_NUMEL
    data = tl.load(cache_ptr + src * stride_block + offsets, mask=mask)
    tl.store(cache_ptr + dst * stride_block + offsets, data, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's K/V into slot slot_mapping[i] of the caches; negative slots are skipped.

    key / value: [num_tokens, num_kv_heads, head_dim]; key_cache / value_cache:
    [num_blocks, block_size, num_kv_heads, head_dim] of the same dtype; slot_mapping:
    [num_tokens] int64. Slots must be below num_blocks * block_size (not checked: no sync).
    """
    layout = "[num_tokens, num_kv_heads, head_dim]"
    check_ndim("key", key, 3, layout)
    check_ndim("value", value, 3, layout)
    if value.shape != key.shape:
        raise KernelArgumentError(
            "value", f"shape {tuple(value.shape)} differs from key {tuple(key.shape)}"
        )
    check_dtype("key", key, FLOAT_DTYPES)
    check_same_dtype("value", value, key, "key")
    check_inner_contiguous("key", key)
    check_inner_contiguous("value", value)
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, _, _ = check_paged_cache(key_cache, value_cache, key, "key")
    check_dim("key_cache", key_cache, 2, num_kv_heads, "num_kv_heads of key")
    check_dim("key_cache", key_cache, 3, head_dim, "head_dim of key")
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dim("slot_mapping", slot_mapping, 0, num_tokens, "num_tokens of key")
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    check_device(
        _reshape_and_cache_kernel,
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
        },
    )
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks src -> dst in every layer's key and value cache (copy-on-write).

    key_caches / value_caches: one [num_blocks, block_size, num_kv_heads, head_dim] per layer,
    each block contiguous; block_mapping: [num_pairs, 2] int64 rows of (src, dst). A dst must
    not also be a src in the same call (pairs are copied concurrently).
    """
    check_ndim("block_mapping", block_mapping, 2, "[num_pairs, 2]")
    check_dim("block_mapping", block_mapping, 1, 2, "(src, dst)")
    check_dtype("block_mapping", block_mapping, (torch.int64,))
    if not block_mapping.is_contiguous():
        raise KernelArgumentError("block_mapping", "must be contiguous")
    if len(key_caches) != len(value_caches):
        raise KernelArgumentError(
            "value_caches", f"{len(value_caches)} layers, key_caches has {len(key_caches)}"
        )
    caches = {f"key_caches[{i}]": c for i, c in enumerate(key_caches)}
    caches |= {f"value_caches[{i}]": c for i, c in enumerate(value_caches)}
    for name, cache in caches.items():
        check_ndim(name, cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
        if not cache[0].is_contiguous():
            raise KernelArgumentError(name, f"blocks must be contiguous, strides {cache.stride()}")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0 or not caches:
        return
    check_device(_copy_blocks_kernel, {"block_mapping": block_mapping, **caches})
    for cache in caches.values():
        block_numel = cache[0].numel()
        grid = (num_pairs, triton.cdiv(block_numel, COPY_CHUNK))
        _copy_blocks_kernel[grid](
            cache, block_mapping, cache.stride(0), BLOCK_NUMEL=block_numel, CHUNK=COPY_CHUNK
        )
