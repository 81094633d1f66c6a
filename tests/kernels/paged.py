"""Factories for paged KV caches with shuffled, ragged block tables, in their own memory or as
one layer's views into a block-major pool of several layers (the worker's layout)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]


# Where a test's caches live (`pool_pad` of the factories): None, in their own contiguous
# tensors; a number, as views into a block-major pool of POOL_LAYERS layers whose blocks end in
# that many more elements (7: blocks no whole number of rows apart).
LAYOUTS = [
    pytest.param(None, id="contiguous"),
    pytest.param(0, id="pooled"),
    pytest.param(7, id="pooled-odd"),
]
POOL_LAYERS = 3


def skip_unsupported(device: str, dtype: torch.dtype) -> None:
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16")


@dataclass
class PagedCache:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    pool: torch.Tensor | None = None  # [num_blocks, pool row] the caches are views into

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]


def make_paged_cache(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    generator: torch.Generator,
    pool_pad: int | None = None,
) -> PagedCache:
    """Random caches where each sequence owns a random, non-contiguous set of blocks.

    Slots no sequence owns, including the tail of each partial last block, hold NaN, and
    block-table entries past a sequence's last block hold -1: a kernel that reads past the
    context poisons its output instead of passing by luck. With `pool_pad` (LAYOUTS) the
    caches are the middle layer's views into a pool (`in_pool`) whose other layers hold NaN.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq) + spare_columns
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for seq, (length, count) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        blocks = order[used : used + count]
        used += count
        block_tables[seq, :count] = blocks.int()
        context = (length, num_kv_heads, head_dim)
        keys = torch.randn(context, generator=generator).to(dtype)
        values = torch.randn(context, generator=generator).to(dtype)
        tokens = torch.arange(length)
        slots = blocks[tokens // block_size] * block_size + tokens % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = values
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    pool = None
    if pool_pad is not None:
        key_cache, value_cache, pool = in_pool(key_cache, value_cache, pool_pad)
    return PagedCache(
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        pool=pool,
    )


def block_pool(
    num_layers: int,
    shape: tuple[int, ...],  # a layer's [num_blocks, block_size, num_kv_heads, head_dim]
    pad: int,
    *,
    fill: float = float("nan"),
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.Tensor:  # [num_blocks, 2 * num_layers * block elements + pad]
    """A block-major KV pool, as the worker lays out every layer's cache: per block, each
    layer's keys ([block_size, num_kv_heads, head_dim] each), then each layer's values, then
    `pad` more elements; all `fill`."""
    block = shape[1] * shape[2] * shape[3]
    return torch.full((shape[0], 2 * num_layers * block + pad), fill, dtype=dtype, device=device)


def layer_views(
    pool: torch.Tensor, layer: int, num_layers: int, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s key and value caches in a `block_pool`: views of `shape` whose blocks
    lie a pool row apart."""
    block = shape[1] * shape[2] * shape[3]
    key = pool[:, layer * block : (layer + 1) * block].view(shape)
    value = pool[:, (num_layers + layer) * block : (num_layers + layer + 1) * block].view(shape)
    return key, value


def in_pool(
    key_cache: torch.Tensor, value_cache: torch.Tensor, pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copies of the caches as the middle layer's views into a NaN-filled `block_pool` of
    POOL_LAYERS layers: (key_cache, value_cache, pool)."""
    shape = tuple(key_cache.shape)
    pool = block_pool(POOL_LAYERS, shape, pad, dtype=key_cache.dtype, device=key_cache.device)
    key, value = layer_views(pool, POOL_LAYERS // 2, POOL_LAYERS, shape)
    key.copy_(key_cache)
    value.copy_(value_cache)
    assert not key.is_contiguous() and key.stride(0) > key[0].numel()
    return key, value, pool


def assert_unchanged_outside(
    before: torch.Tensor, after: torch.Tensor, *views: torch.Tensor
) -> None:
    """Every element of the pool `after` outside `views` (of it) is bit for bit as in
    `before`: writes through the views landed in them only."""
    outside = torch.ones(after.numel(), dtype=torch.bool, device=after.device)
    index = torch.arange(after.numel(), device=after.device)
    for view in views:
        offset = view.storage_offset() - after.storage_offset()
        outside[index.as_strided(view.shape, view.stride(), offset).reshape(-1)] = False
    torch.testing.assert_close(
        after.reshape(-1)[outside], before.reshape(-1)[outside], rtol=0, atol=0, equal_nan=True
    )


def random_lens(count: int, low: int, high: int, generator: torch.Generator) -> list[int]:
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert not actual.isnan().any(), "kernel output has NaN (read past the context?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[expected.dtype])


# KV heads of the random attention cases; queries_per_kv sets the query heads.
NUM_KV_HEADS = 2


def make_attention_case(
    seq_lens: list[int],
    num_query_rows: int,
    *,
    queries_per_kv: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    pool_pad: int | None = None,
) -> tuple[PagedCache, torch.Tensor]:
    """A random paged cache for `seq_lens` and `num_query_rows` random query rows
    ([num_query_rows, NUM_KV_HEADS * queries_per_kv, head_dim]), from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(
        seq_lens,
        block_size=block_size,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        generator=generator,
        pool_pad=pool_pad,
    )
    num_heads = NUM_KV_HEADS * queries_per_kv
    query = torch.randn(num_query_rows, num_heads, head_dim, generator=generator).to(dtype)
    return cache, query.to(device)


def make_prefill_args(
    parts: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    pool_pad: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """A prefill call's positional arguments on CPU for sequences of (cached prefix, new
    tokens) `parts`: (query [new tokens, num_heads, head_dim], key cache, value cache, block
    tables, query_start_loc, seq_lens), a 16-token-block cache from `make_paged_cache`."""
    cache = make_paged_cache(
        [c + q for c, q in parts],
        block_size=16,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        generator=generator,
        pool_pad=pool_pad,
    )
    q_lens = torch.tensor([q for _, q in parts])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=generator).to(dtype)
    return query, cache.key_cache, cache.value_cache, cache.block_tables, starts, cache.seq_lens
