"""reshape_and_cache and copy_blocks against the torch reference."""

from __future__ import annotations

import pytest
import torch

import llmserve_kernels
from llmserve_kernels import reference
from tests.kernels.paged import (
    DTYPES,
    LAYOUTS,
    assert_unchanged_outside,
    block_pool,
    in_pool,
    layer_views,
    skip_unsupported,
)


def random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    # [num_blocks, block_size, num_kv_heads, head_dim]
    return torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_matches_reference(
    device: str, dtype: torch.dtype, block_size: int, pool_pad: int | None
) -> None:
    skip_unsupported(device, dtype)
    torch.manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 6, 3, 64, 20
    key_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype).to(device)
    value_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype).to(device)
    # K and V are views into a fused [num_tokens, q + k + v heads, head_dim] projection.
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim).to(dtype).to(device)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::4] = -1  # padding tokens
    slots = slots.to(device)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    if pool_pad is not None:  # the middle layer's views into a pool of layers
        key_cache, value_cache, pool = in_pool(key_cache, value_cache, pool_pad)
        before = pool.clone()

    llmserve_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)

    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)
    if pool_pad is not None:
        assert_unchanged_outside(before, pool, key_cache, value_cache)


def test_reshape_and_cache_skips_negative_slots(device: str) -> None:
    key_cache = torch.zeros(2, 8, 1, 64, device=device)
    value_cache = torch.zeros(2, 8, 1, 64, device=device)
    key = torch.ones(3, 1, 64, device=device)
    value = torch.full((3, 1, 64), 2.0, device=device)
    slots = torch.tensor([9, -1, 0], device=device)

    llmserve_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)

    written = key_cache[:, :, 0, 0].flatten().nonzero().flatten().tolist()
    assert written == [0, 9]
    assert value_cache.sum().item() == 2.0 * 2 * 64


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference(
    device: str, dtype: torch.dtype, pool_pad: int | None
) -> None:
    skip_unsupported(device, dtype)
    torch.manual_seed(1)
    layers = 2
    key_caches = [random_cache(8, 16, 2, 64, dtype).to(device) for _ in range(layers)]
    value_caches = [random_cache(8, 16, 2, 64, dtype).to(device) for _ in range(layers)]
    expected_keys = [c.clone() for c in key_caches]
    expected_values = [c.clone() for c in value_caches]
    if pool_pad is not None:  # every layer's caches as views into one pool of layers
        shape = tuple(key_caches[0].shape)
        pool = block_pool(layers, shape, pool_pad, dtype=dtype, device=device)
        for layer in range(layers):
            key, value = layer_views(pool, layer, layers, shape)
            key.copy_(key_caches[layer])
            value.copy_(value_caches[layer])
            key_caches[layer], value_caches[layer] = key, value
        before = pool.clone()
    mapping = torch.tensor([[3, 0], [3, 5], [7, 1]], device=device)

    llmserve_kernels.copy_blocks(key_caches, value_caches, mapping)
    reference.copy_blocks(expected_keys, expected_values, mapping)

    for actual, expected in zip(
        key_caches + value_caches, expected_keys + expected_values, strict=True
    ):
        assert torch.equal(actual, expected)
    assert torch.equal(key_caches[1][5], key_caches[1][3])
    if pool_pad is not None:  # the padding after each block's layers is untouched
        assert_unchanged_outside(before, pool, *key_caches, *value_caches)


def test_cache_ops_reject_bad_arguments(device: str) -> None:
    key_cache = torch.zeros(2, 8, 2, 64, device=device)
    value_cache = torch.zeros(2, 8, 2, 64, device=device)
    key = torch.ones(3, 2, 64, device=device)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="slot_mapping: dimension 0"):
        slots = torch.tensor([1, 2], device=device)
        llmserve_kernels.reshape_and_cache(key, key, key_cache, value_cache, slots)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="key_cache: dimension 2"):
        slots = torch.tensor([1, 2, 3], device=device)
        llmserve_kernels.reshape_and_cache(key[:, :1], key[:, :1], key_cache, value_cache, slots)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="block_mapping: dtype"):
        llmserve_kernels.copy_blocks(
            [key_cache], [value_cache], torch.zeros(1, 2, dtype=torch.int32)
        )
