"""The native CPU kernels (kernels.cpu) against the torch references, on poisoned paged caches.

Caches come from `make_paged_cache`: shuffled blocks, NaN in every slot no sequence owns and
-1 past each block table's end, so reading outside a context shows up as NaN or a crash.
"""

from __future__ import annotations

import pytest
import torch

from kernels import KernelArgumentError, reference
from kernels import cpu as cpu_kernels
from tests.kernels.paged import assert_close, make_paged_cache, random_lens

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (num_heads, num_kv_heads, head_dim): the tiny test models, MHA, GQA 3:1 (SmolLM2), GQA 4:1,
# MQA, wide and odd-sized heads.
SHAPES = [(4, 2, 16), (4, 4, 32), (9, 3, 64), (8, 2, 64), (4, 1, 128), (2, 2, 256), (6, 2, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + block_size)
    # Lengths around block and 16-lane boundaries, plus a long one and a single token.
    lens = [1, 15, 16, 17, block_size, block_size + 1, 300, *random_lens(5, 1, 120, gen)]
    cache = make_paged_cache(
        lens,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        generator=gen,
    )
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, scale)
    assert_close(cpu_kernels.paged_attention_decode(*args), reference.paged_attention_decode(*args))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_prefill_matches_reference_with_cached_prefix(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    # (cached prefix, new tokens): a plain prompt, chunks after a prefix hit, a one-token
    # chunk, lengths that straddle the 16-token query tile and key tile.
    parts = [(0, 37), (48, 16), (5, 1), (100, 70), (0, 1), (16, 33)]
    lens = [c + q for c, q in parts]
    cache = make_paged_cache(
        lens,
        block_size=16,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        generator=gen,
    )
    q_lens = torch.tensor([q for _, q in parts])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen).to(dtype)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, starts, cache.seq_lens)
    scale = head_dim**-0.5
    assert_close(
        cpu_kernels.prefill_attention(*args, scale), reference.prefill_attention(*args, scale)
    )


def test_writes_into_given_output_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    cache = make_paged_cache(
        [5, 9],
        block_size=16,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        device="cpu",
        generator=gen,
    )
    query = torch.randn(2, 2, 32, generator=gen)
    buffer = torch.full((4, 2, 32), 7.0)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.2)
    cpu_kernels.paged_attention_decode(*args, out=buffer[1:3])
    assert_close(buffer[1:3], reference.paged_attention_decode(*args))
    assert (buffer[0] == 7.0).all() and (buffer[3] == 7.0).all()


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda a: {**a, "query": a["query"].half()}, "query"),
        (lambda a: {**a, "query": a["query"][:, :, :16].contiguous()}, "key_cache"),
        (lambda a: {**a, "block_tables": a["block_tables"].long()}, "block_tables"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens"),
        (lambda a: {**a, "value_cache": a["value_cache"][:2]}, "value_cache"),
        (lambda a: {**a, "query": a["query"].transpose(0, 1)}, "query"),
    ],
)
def test_bad_arguments_name_the_argument(change: object, name: str) -> None:
    gen = torch.Generator().manual_seed(4)
    cache = make_paged_cache(
        [5, 9],
        block_size=16,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        device="cpu",
        generator=gen,
    )
    args = dict(
        query=torch.randn(2, 2, 32, generator=gen),
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        block_tables=cache.block_tables,
        seq_lens=cache.seq_lens,
        scale=0.2,
    )
    with pytest.raises(KernelArgumentError) as info:
        cpu_kernels.paged_attention_decode(**change(args))  # type: ignore[operator]
    assert info.value.name == name


def test_unsupported_shapes_are_explained() -> None:
    assert cpu_kernels.unsupported_reason(torch.float32, 9, 3, 64) is None
    assert "head_dim" in (cpu_kernels.unsupported_reason(torch.float32, 4, 4, 80) or "")
    assert "dtype" in (cpu_kernels.unsupported_reason(torch.float16, 4, 4, 64) or "")
    assert "kv heads" in (cpu_kernels.unsupported_reason(torch.float32, 64, 2, 64) or "")
