"""Triton paged prefill attention (chunked prefill, cached prefixes) against the reference."""

from __future__ import annotations

import pytest
import torch

import llmserve_kernels
from llmserve_kernels import reference
from tests.kernels.paged import (
    DTYPES,
    LAYOUTS,
    assert_close,
    make_attention_case,
    skip_unsupported,
)


def run_prefill(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    queries_per_kv: int,
    block_size: int = 16,
    head_dim: int = 64,
    seed: int = 0,
    pool_pad: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output): sequence s has query_lens[s] new tokens at its end."""
    cache, query = make_attention_case(  # query: [num_tokens, num_heads, head_dim]
        seq_lens,
        sum(query_lens),
        queries_per_kv=queries_per_kv,
        block_size=block_size,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
        pool_pad=pool_pad,
    )
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(device)  # [num_seqs+1]
    args = (
        query,
        cache.key_cache,
        cache.value_cache,
        cache.block_tables,
        starts,
        cache.seq_lens,
        head_dim**-0.5,
    )
    return llmserve_kernels.prefill_attention(*args), reference.prefill_attention(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_reference(
    device: str, dtype: torch.dtype, queries_per_kv: int, head_dim: int
) -> None:
    skip_unsupported(device, dtype)
    # A whole prompt, a chunk after a cached prefix, a one-token chunk, and a chunk longer than
    # one query tile (64 rows / padded group) after a prefix that ends mid-block.
    seq_lens = [37, 90, 51, 150]
    query_lens = [37, 20, 1, 70]
    actual, expected = run_prefill(
        device, dtype, seq_lens, query_lens, queries_per_kv=queries_per_kv, head_dim=head_dim
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_prefill_block_sizes(device: str, block_size: int, pool_pad: int | None) -> None:
    seq_lens = [block_size + 3, 2 * block_size, 100]
    query_lens = [block_size + 3, 5, 33]
    actual, expected = run_prefill(
        device,
        torch.float32,
        seq_lens,
        query_lens,
        queries_per_kv=3,
        block_size=block_size,
        pool_pad=pool_pad,
    )
    assert_close(actual, expected)


def test_prefill_skips_sequences_without_new_tokens(device: str) -> None:
    actual, expected = run_prefill(
        device, torch.float32, [20, 33, 9], [4, 0, 9], queries_per_kv=1, block_size=8
    )
    assert_close(actual, expected)


def test_chunked_prefill_equals_whole_prompt(device: str) -> None:
    """Writing a prompt in three chunks and attending per chunk gives the one-shot result."""
    generator = torch.Generator().manual_seed(3)
    prompt_len, num_kv_heads, num_heads, head_dim, block_size = 45, 2, 6, 64, 8
    num_blocks = 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.zeros(shape, device=device)
    value_cache = torch.zeros(shape, device=device)
    block_table = torch.randperm(num_blocks, generator=generator)[:6].int().to(device)[None]
    query = torch.randn(prompt_len, num_heads, head_dim, generator=generator).to(device)
    key = torch.randn(prompt_len, num_kv_heads, head_dim, generator=generator).to(device)
    value = torch.randn(prompt_len, num_kv_heads, head_dim, generator=generator).to(device)
    tokens = torch.arange(prompt_len, device=device)
    slots = block_table[0].long()[tokens // block_size] * block_size + tokens % block_size

    def attend(lo: int, hi: int) -> torch.Tensor:
        llmserve_kernels.reshape_and_cache(
            key[lo:hi], value[lo:hi], key_cache, value_cache, slots[lo:hi]
        )
        starts = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=device)
        return llmserve_kernels.prefill_attention(
            query[lo:hi], key_cache, value_cache, block_table, starts, seq_lens, 0.125
        )

    chunked = torch.cat([attend(0, 16), attend(16, 17), attend(17, prompt_len)])
    whole = reference.attend(query, key, value, 0.125, causal_offset=0)
    assert_close(chunked, whole)


def test_prefill_of_one_token_equals_decode(device: str) -> None:
    cache, query = make_attention_case(  # query: [2, 16, 64], one row per sequence
        [10, 77],
        2,
        queries_per_kv=8,
        block_size=16,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        seed=5,
    )
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    caches = (cache.key_cache, cache.value_cache, cache.block_tables)
    prefill = llmserve_kernels.prefill_attention(query, *caches, starts, cache.seq_lens, 0.1)
    decode = llmserve_kernels.paged_attention_decode(query, *caches, cache.seq_lens, 0.1)
    assert_close(prefill, decode)


def test_prefill_rejects_bad_arguments(device: str) -> None:
    cache, query = make_attention_case(  # query: [4, 4, 64]
        [4],
        4,
        queries_per_kv=2,
        block_size=8,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        seed=0,
    )
    caches = (cache.key_cache, cache.value_cache, cache.block_tables)
    starts = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="query_start_loc: dtype"):
        llmserve_kernels.prefill_attention(query, *caches, starts.long(), cache.seq_lens, 0.1)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="key_cache: dimension 3"):
        llmserve_kernels.prefill_attention(query[..., :32], *caches, starts, cache.seq_lens, 0.1)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match="block_tables: dimension 0"):
        three = torch.tensor([0, 1, 2, 4], dtype=torch.int32, device=device)
        llmserve_kernels.prefill_attention(query, *caches, three, cache.seq_lens, 0.1)


@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cpu_prefill_query_bits_do_not_depend_on_its_chunk(
    queries_per_kv: int, head_dim: int, softcap: float | None
) -> None:
    """The CPU kernel scores query heads several at a time (paged_prefill.cpp's
    kQueryBlock) where a whole block of them sees a key chunk, one at a time elsewhere: a
    chunk of 77 tokens after a cached prefix gives, bit for bit, what each of its tokens
    gives as a chunk of its own (where a block never fills). (Not with a sliding window:
    there a tile's key chunks start at its first query's oldest key, so their bounds, and the
    online softmax's rounding, move with the tile.)"""
    from llmserve_kernels.cpu.attention import prefill_attention

    seq_len, chunk = 140, 77
    cache, query = make_attention_case(
        [seq_len],
        chunk,
        queries_per_kv=queries_per_kv,
        block_size=16,
        head_dim=head_dim,
        dtype=torch.float32,
        device="cpu",
        seed=11,
    )
    caches = (cache.key_cache, cache.value_cache, cache.block_tables)
    extra = {"softcap": softcap}
    starts = torch.tensor([0, chunk], dtype=torch.int32)
    whole = prefill_attention(query, *caches, starts, cache.seq_lens, 0.125, **extra)
    one = torch.tensor([0, 1], dtype=torch.int32)
    alone = torch.cat(
        [
            prefill_attention(
                query[i : i + 1],
                *caches,
                one,
                torch.tensor([seq_len - chunk + 1 + i], dtype=torch.int32),
                0.125,
                **extra,
            )
            for i in range(chunk)
        ]
    )
    assert torch.equal(whole, alone)
