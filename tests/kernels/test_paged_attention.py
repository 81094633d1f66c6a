"""Triton paged decode attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

import llmserve_kernels
from llmserve_kernels import decode_plan, paged_attention, reference
from tests.kernels.paged import (
    DTYPES,
    LAYOUTS,
    assert_close,
    make_attention_case,
    make_paged_cache,
    random_lens,
    skip_unsupported,
)


def run_decode(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    *,
    queries_per_kv: int,
    block_size: int = 16,
    head_dim: int = 64,
    seed: int = 0,
    pool_pad: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output) for one random batch."""
    cache, query = make_attention_case(  # query: [num_seqs, num_heads, head_dim]
        seq_lens,
        len(seq_lens),
        queries_per_kv=queries_per_kv,
        block_size=block_size,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
        pool_pad=pool_pad,
    )
    scale = head_dim**-0.5
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, scale)
    return (
        llmserve_kernels.paged_attention_decode(*args, **kwargs),
        reference.paged_attention_decode(*args),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("partition_size", [512, 64], ids=["single-pass", "split-k"])
def test_decode_matches_reference(
    device: str, dtype: torch.dtype, queries_per_kv: int, head_dim: int, partition_size: int
) -> None:
    skip_unsupported(device, dtype)
    generator = torch.Generator().manual_seed(queries_per_kv * head_dim)
    # Ragged lengths: a single token, partial last blocks, several split-K partitions.
    seq_lens = [1, 17, *random_lens(2, 2, 300, generator)]
    actual, expected = run_decode(
        device,
        dtype,
        seq_lens,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        partition_size=partition_size,
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_block_sizes(
    device: str, dtype: torch.dtype, block_size: int, pool_pad: int | None
) -> None:
    skip_unsupported(device, dtype)
    seq_lens = [block_size, block_size + 1, 3 * block_size - 1, 150]
    actual, expected = run_decode(
        device,
        dtype,
        seq_lens,
        queries_per_kv=3,
        block_size=block_size,
        partition_size=64,
        pool_pad=pool_pad,
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reduces_more_partitions_than_one_chunk(device: str, dtype: torch.dtype) -> None:
    skip_unsupported(device, dtype)
    # 1,100 tokens in partitions of 32: 35 partitions, more than one reduction chunk of 16.
    actual, expected = run_decode(
        device, dtype, [1100, 40, 513], queries_per_kv=8, block_size=32, partition_size=32
    )
    assert_close(actual, expected)


def test_decode_max_seq_len_bounds_the_grid(device: str) -> None:
    # The block table has spare columns; max_seq_len trims the partition count to the longest.
    seq_lens = [100, 130]
    actual, expected = run_decode(
        device,
        torch.float32,
        seq_lens,
        queries_per_kv=1,
        partition_size=32,
        max_seq_len=max(seq_lens),
    )
    assert_close(actual, expected)


def test_decode_writes_into_out_from_strided_query(device: str) -> None:
    generator = torch.Generator().manual_seed(7)
    seq_lens = [5, 40, 70]
    cache = make_paged_cache(
        seq_lens,
        block_size=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        generator=generator,
    )
    # The query is a view into a fused qkv projection: rows are not contiguous.
    qkv = torch.randn(3, 4 + 2 + 2, 64, generator=generator).to(device)
    query = qkv[:, :4]  # [num_seqs, num_heads, head_dim], stride(0) = 8 * 64
    out = torch.full_like(query, float("nan"))
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.1)
    result = llmserve_kernels.paged_attention_decode(*args, out=out, partition_size=32)
    assert result is out
    assert_close(out, reference.paged_attention_decode(*args))


def test_decode_rejects_bad_arguments(device: str) -> None:
    cache, query = make_attention_case(  # query: [1, 4, 64]
        [4],
        1,
        queries_per_kv=2,
        block_size=8,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        seed=0,
    )
    good = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.1)

    with pytest.raises(llmserve_kernels.KernelArgumentError, match="block_tables: dtype"):
        llmserve_kernels.paged_attention_decode(*good[:3], cache.block_tables.long(), *good[4:])
    with pytest.raises(
        llmserve_kernels.KernelArgumentError, match="not a multiple of num_kv_heads"
    ):
        llmserve_kernels.paged_attention_decode(query[:, :3], *good[1:])
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="query: dtype"):
        llmserve_kernels.paged_attention_decode(query.int(), *good[1:])
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="key_cache: dtype"):
        llmserve_kernels.paged_attention_decode(query.half(), *good[1:])
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="seq_lens: dimension 0"):
        llmserve_kernels.paged_attention_decode(*good[:4], cache.seq_lens.repeat(2), 0.1)


def test_decode_pads_head_dims_that_are_not_powers_of_2(device: str) -> None:
    actual, expected = run_decode(
        device, torch.float32, [3, 70], queries_per_kv=3, head_dim=96, partition_size=32
    )
    assert_close(actual, expected)


def test_partition_size_shrinks_until_the_grid_fills_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_plan, "_sm_count", lambda index: 100)
    cuda = torch.device("cuda")
    # 200 programs wanted: 64 x 8 x 4 partitions of 512 already suffice.
    assert paged_attention.choose_partition_size(64, 8, 2048, cuda) == 512
    # 1 x 8 KV heads: 16 partitions of 128 (the floor) give 128 programs.
    assert paged_attention.choose_partition_size(1, 8, 2048, cuda) == 128
    # 4 x 8 x 8 partitions of 256 = 256 programs.
    assert paged_attention.choose_partition_size(4, 8, 2048, cuda) == 256
    assert paged_attention.choose_partition_size(1, 8, 2048, torch.device("cpu")) == 512


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [512, 64], ids=["single-pass", "split-k"])
def test_one_plan_serves_every_layer(device: str, dtype: torch.dtype, partition_size: int) -> None:
    """A `DecodePlan` made once runs over several layers' caches and queries (each against
    the reference), through the kept compiled kernel after the first launch on CUDA, and over
    row-strided queries (views of a fused QKV row)."""
    skip_unsupported(device, dtype)
    seq_lens = [1, 40, 300]
    cache0, query0 = make_attention_case(
        seq_lens, 3, queries_per_kv=4, block_size=16, head_dim=64, dtype=dtype,
        device=device, seed=0,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)

    def fresh(t: torch.Tensor) -> torch.Tensor:  # new values where t has any (the same poison)
        new = torch.randn(t.shape, generator=generator).to(dtype=t.dtype, device=t.device)
        return torch.where(t.isnan(), t, new)

    layers = [(cache0.key_cache, cache0.value_cache, query0)] + [
        (fresh(cache0.key_cache), fresh(cache0.value_cache), fresh(query0)) for _ in range(2)
    ]
    plan = paged_attention.DecodePlan(
        cache0.block_tables,
        cache0.seq_lens,
        num_heads=query0.shape[1],
        num_kv_heads=cache0.key_cache.shape[2],
        head_dim=64,
        block_size=16,
        dtype=dtype,
        scale=64**-0.5,
        partition_size=partition_size,
    )
    for i, (key_cache, value_cache, query) in enumerate(layers):
        if i == 2:  # queries as the first heads of wider rows
            wide = torch.randn(3, query.shape[1] + 5, 64, dtype=dtype, device=device)
            wide[:, : query.shape[1]] = query
            query = wide[:, : query.shape[1]]
        out = torch.full_like(query, float("nan")).contiguous()
        args = (query, key_cache, value_cache, cache0.block_tables, cache0.seq_lens)
        plan.run(*args[:3], out)
        assert_close(out, reference.paged_attention_decode(*args, 64**-0.5))


def test_plan_refuses_a_query_of_another_shape(device: str) -> None:
    cache, query = make_attention_case(
        [5, 9], 2, queries_per_kv=2, block_size=16, head_dim=64, dtype=torch.float32,
        device=device, seed=0,
    )  # fmt: skip
    plan = paged_attention.DecodePlan(
        cache.block_tables, cache.seq_lens, num_heads=query.shape[1],
        num_kv_heads=cache.key_cache.shape[2], head_dim=64, block_size=16,
        dtype=torch.float32, scale=0.125,
    )  # fmt: skip
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="query"):
        plan.run(query[:1], cache.key_cache, cache.value_cache)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="query"):
        plan.run(query.half(), cache.key_cache, cache.value_cache)
