"""The native CPU kernels (llmserve_kernels.cpu) against the torch references, on poisoned paged
caches.

Caches come from `make_paged_cache`: shuffled blocks, NaN in every slot no sequence owns and
-1 past each block table's end, so reading outside a context shows up as NaN or a crash; in
the pooled LAYOUTS, NaN in every other layer's part of the pool too.
"""

from __future__ import annotations

import pytest
import torch

from llmserve_kernels import KernelArgumentError, reference
from llmserve_kernels import cpu as cpu_kernels
from tests.kernels.paged import (
    LAYOUTS,
    PagedCache,
    assert_close,
    assert_unchanged_outside,
    in_pool,
    make_paged_cache,
    make_prefill_args,
    random_lens,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (num_heads, num_kv_heads, head_dim): the tiny test models, MHA, GQA 3:1 (SmolLM2), GQA 4:1,
# MQA, wide and odd-sized heads.
SHAPES = [
    (4, 2, 16),
    (4, 4, 32),
    (9, 3, 64),
    (8, 2, 64),
    (4, 1, 128),
    (2, 2, 256),
    (6, 2, 96),
    (2, 1, 512),
]


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    pool_pad: int | None,
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
        pool_pad=pool_pad,
    )
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, scale)
    assert_close(cpu_kernels.paged_attention_decode(*args), reference.paged_attention_decode(*args))


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), SHAPES)
def test_prefill_matches_reference_with_cached_prefix(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, pool_pad: int | None
) -> None:
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    # (cached prefix, new tokens): a plain prompt, chunks after a prefix hit, a one-token
    # chunk, lengths that straddle the 16-token query tile and key tile.
    parts = [(0, 37), (48, 16), (5, 1), (100, 70), (0, 1), (16, 33)]
    args = make_prefill_args(
        parts,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        generator=gen,
        pool_pad=pool_pad,
    )
    scale = head_dim**-0.5
    assert_close(
        cpu_kernels.prefill_attention(*args, scale), reference.prefill_attention(*args, scale)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 1), (4, 4)])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (20, None), (None, 5.0), (33, 2.0)])
def test_rows_sharing_a_table_equal_each_row_alone(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, window: int | None, softcap: float | None
) -> None:
    """A sequence with drafts runs as rows with one block table and consecutive lengths: the
    kernel reads their keys and values once for several rows, and each row's output is
    bit-identical to that row attended alone (speculation must not change a token)."""
    head_dim, block_size = 64, 16
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + (window or 0))
    # Sequences of 7 rows (crossing a block boundary), 2 and 11 (over 300 tokens) among single
    # rows; the lengths are each sequence's last row's.
    runs = [(1, 40), (7, 70), (1, 5), (2, 16), (1, 17), (11, 300), (1, 1)]
    cache = make_paged_cache(
        [end for _, end in runs],
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        generator=gen,
    )
    rows = [(i, end - count + 1 + r) for i, (count, end) in enumerate(runs) for r in range(count)]
    tables = cache.block_tables[[i for i, _ in rows]].contiguous()
    lens = torch.tensor([length for _, length in rows], dtype=torch.int32)
    query = torch.randn(len(rows), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    caches = (cache.key_cache, cache.value_cache)
    opts = dict(sliding_window=window, softcap=softcap)
    together = cpu_kernels.paged_attention_decode(query, *caches, tables, lens, scale, **opts)
    for r in range(len(rows)):
        alone = cpu_kernels.paged_attention_decode(
            query[r : r + 1], *caches, tables[r : r + 1], lens[r : r + 1], scale, **opts
        )
        assert torch.equal(together[r : r + 1], alone), f"row {r}"
    expected = reference.paged_attention_decode(query, *caches, tables, lens, scale, **opts)
    assert_close(together, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap", "with_sinks"), [
    (None, None, False), (None, None, True), (300, None, False), (700, 3.0, True),
])  # fmt: skip
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 1)])
def test_long_rows_equal_the_reference_and_each_row_alone(
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
    with_sinks: bool,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Contexts of several hundred to two thousand tokens with a window, a soft-cap and sinks,
    and sequences with drafts: the reference's output, and each row's bits the same alone as
    in the batch. A lone sequence is where the kernel splits its work differently: a long
    context's partitions over the threads, or one kv head's query heads over two threads,
    with 4:1; in a batch a row's partitions run in one work item. The drafts of the second
    run cross lengths where a context takes one more partition (at multiples of 128, 256 and
    512 tokens)."""
    head_dim, block_size = 64, 16
    gen = torch.Generator().manual_seed(41 + (window or 0))
    lens = [256, 257, 512, 513, 1000, 2049, 40]
    cache = make_paged_cache(
        [*lens, 260, 1027],
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
        generator=gen,
    )
    # The last two sequences: a token at 253 with drafts up to 260, and one at 1020 with
    # drafts up to 1027, each one run of rows.
    rows = [(i, n) for i, n in enumerate(lens)]
    rows += [(len(lens), n) for n in range(253, 261)]
    rows += [(len(lens) + 1, n) for n in range(1020, 1028)]
    tables = cache.block_tables[[i for i, _ in rows]].contiguous()
    seq_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    query = torch.randn(len(rows), num_heads, head_dim, generator=gen).to(dtype)
    # Large sinks, so that a sink left out of a merged denominator shows.
    sinks = torch.randn(num_heads, generator=gen) + 6 if with_sinks else None
    scale = head_dim**-0.5
    caches = (cache.key_cache, cache.value_cache)
    opts = dict(sliding_window=window, softcap=softcap, sinks=sinks)
    together = cpu_kernels.paged_attention_decode(query, *caches, tables, seq_lens, scale, **opts)
    expected = reference.paged_attention_decode(query, *caches, tables, seq_lens, scale, **opts)
    assert_close(together, expected)
    for r in range(len(rows)):
        alone = cpu_kernels.paged_attention_decode(
            query[r : r + 1], *caches, tables[r : r + 1], seq_lens[r : r + 1], scale, **opts
        )
        assert torch.equal(together[r : r + 1], alone), f"row {r}"


def small_cache(
    seed: int, lens: list[int], num_kv_heads: int
) -> tuple[PagedCache, torch.Generator]:
    """A float32 cache of block size 16 and head_dim 32, and the generator that filled it."""
    gen = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(
        lens,
        block_size=16,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        dtype=torch.float32,
        device="cpu",
        generator=gen,
    )
    return cache, gen


def test_query_rows_may_be_strided_views() -> None:
    """The backend passes q as a view of the fused QKV projection: rows further apart."""
    cache, gen = small_cache(5, [7, 40, 3], num_kv_heads=2)
    qkv = torch.randn(3, (4 + 2 + 2) * 32, generator=gen)
    query = qkv[:, : 4 * 32].view(3, 4, 32)
    assert not query.is_contiguous()
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, 0.3)
    expected = reference.paged_attention_decode(query.contiguous(), *args[1:])
    assert_close(cpu_kernels.paged_attention_decode(*args), expected)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    prefill_args = (*args[:4], starts, cache.seq_lens, 0.3)
    expected = reference.prefill_attention(query.contiguous(), *prefill_args[1:])
    assert_close(cpu_kernels.prefill_attention(*prefill_args), expected)


def test_writes_into_given_output_rows() -> None:
    cache, gen = small_cache(3, [5, 9], num_kv_heads=1)
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
        # blocks a pool row apart, the key cache's a block apart: the kernels take one stride
        (lambda a: {**a, "value_cache": in_pool(a["key_cache"], a["value_cache"], 0)[1]},
         "value_cache"),
        # a block's rows not back to back (its heads are)
        (lambda a: {**a, "key_cache": a["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)},
         "key_cache"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument(change: object, name: str) -> None:
    cache, gen = small_cache(4, [5, 9], num_kv_heads=2)
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


# -- fused elementwise ops ------------------------------------------------------------------

OP_DTYPES = [
    pytest.param(torch.float32, 2e-6, id="fp32"),  # last-bit differences in sums and exp
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),  # at most one bf16 rounding step apart
]


NORM_KINDS = ["rms", "rms_f32", "gemma"]  # Llama's, OLMo 2's and Gemma's weight orders


@pytest.mark.parametrize(("dtype", "tol"), OP_DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 40])  # SmolLM2, a tiny model, a ragged tail
@pytest.mark.parametrize("kind", NORM_KINDS)
def test_rms_norm_matches_the_model_reference(
    dtype: torch.dtype, tol: float, hidden: int, kind: str
) -> None:
    from worker_service.models.blocks import rms_norm

    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(70, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    residual = torch.randn(70, hidden, generator=gen).to(dtype)
    expected_residual = residual + x
    updated = residual.clone()
    torch.testing.assert_close(
        cpu_kernels.rms_norm(x, weight, 1e-5, kind=kind),
        rms_norm(x, weight, 1e-5, kind),  # type: ignore[arg-type]
        atol=tol,
        rtol=tol,
    )
    out = cpu_kernels.rms_norm(x, weight, 1e-5, residual=updated, kind=kind)
    assert torch.equal(updated, expected_residual)  # the residual add rounds like torch
    expected = rms_norm(expected_residual, weight, 1e-5, kind)  # type: ignore[arg-type]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), OP_DTYPES)
@pytest.mark.parametrize("kind", NORM_KINDS)
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "whole"])
def test_head_norm_normalizes_each_head_of_the_strided_rows(
    dtype: torch.dtype, tol: float, kind: str, per_head: bool
) -> None:
    """Qwen3's and Gemma's q/k norms (per head) and OLMo 2's (over all the heads), in place on
    the q and k parts of projection rows; the rest of each row is left as it was."""
    from worker_service.models.blocks import rms_norm

    gen = torch.Generator().manual_seed(int(per_head))
    n, heads, kv_heads, head_dim = 37, 4, 2, 48
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q_width, k_width = (head_dim, head_dim) if per_head else (q_size, kv_size)
    q_weight = torch.randn(q_width, generator=gen).to(dtype)
    k_weight = torch.randn(k_width, generator=gen).to(dtype)
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    expected_q = rms_norm(q.reshape(n, -1, q_width), q_weight, 1e-6, kind).reshape(n, -1)  # type: ignore[arg-type]
    expected_k = rms_norm(k.reshape(n, -1, k_width), k_weight, 1e-6, kind).reshape(n, -1)  # type: ignore[arg-type]
    values = qkv[:, q_size + kv_size :].clone()
    q_heads, k_heads = (heads, kv_heads) if per_head else (1, 1)
    cpu_kernels.head_norm_(qkv, q_weight, 1e-6, q_heads, kind=kind)
    cpu_kernels.head_norm_(qkv[:, q_size:], k_weight, 1e-6, k_heads, kind=kind)
    torch.testing.assert_close(qkv[:, :q_size], expected_q, atol=tol, rtol=tol)
    torch.testing.assert_close(qkv[:, q_size : q_size + kv_size], expected_k, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, q_size + kv_size :], values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 16, 40])
def test_rotary_is_bit_exact_with_the_torch_path(dtype: torch.dtype, head_dim: int) -> None:
    from worker_service.models.rope import apply_rotary, cos_sin_table, inverse_frequencies

    gen = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, n = 6, 2, 33
    cos, sin = cos_sin_table(
        inverse_frequencies(head_dim, 10000.0, None), 512, dtype, torch.device("cpu")
    )
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (n,), generator=gen)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    expected_q = apply_rotary(q, cos[positions][:, None], sin[positions][:, None])
    expected_k = apply_rotary(k, cos[positions][:, None], sin[positions][:, None])
    untouched = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cpu_kernels.rotary_(qkv, positions, cos, sin, heads + kv_heads)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], untouched)  # v is not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 16), (40, 24), (32, 32)])
def test_partial_rotary_turns_the_first_dims_of_each_head_as_the_torch_path(
    dtype: torch.dtype, head_dim: int, rotary_dim: int
) -> None:
    from worker_service.models.rope import apply_rotary, cos_sin_table, inverse_frequencies

    gen = torch.Generator().manual_seed(rotary_dim)
    heads, kv_heads, n = 4, 2, 21
    cos, sin = cos_sin_table(
        inverse_frequencies(rotary_dim, 10000.0, None), 256, dtype, torch.device("cpu")
    )
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 256, (n,), generator=gen)
    rotated = (heads + kv_heads) * head_dim
    expected = apply_rotary(
        qkv[:, :rotated].reshape(n, -1, head_dim), cos[positions][:, None], sin[positions][:, None]
    ).reshape(n, -1)
    untouched = qkv[:, rotated:].clone()
    cpu_kernels.rotary_(qkv, positions, cos, sin, heads + kv_heads, head_dim=head_dim)
    assert torch.equal(qkv[:, :rotated], expected)
    assert torch.equal(qkv[:, rotated:], untouched)


@pytest.mark.parametrize(("dtype", "tol"), OP_DTYPES)
def test_silu_mul_matches_torch(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(7)
    # Wide range: exp over- and underflows at both ends.
    gate_up = (torch.randn(9, 2 * 1000, generator=gen) * 30).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("dtype", "tol"), OP_DTYPES)
def test_gelu_tanh_mul_matches_torch(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(8)
    # Wide range: tanh saturates at both ends; a ragged width leaves a tail. Where the gate is
    # far below 0, 1 + tanh cancels: an ulp of tanh is then the whole result, so the bound is
    # absolute, on the scale of gate * up.
    gate_up = (torch.randn(9, 2 * 1003, generator=gen) * 10).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    scale = float((gate.float() * up.float()).abs().max())
    torch.testing.assert_close(
        cpu_kernels.gelu_tanh_mul(gate_up), expected, atol=tol * scale, rtol=tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_argmax_takes_the_best_allowed_token_and_ranks_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(7, 1003, generator=gen) * 5).to(dtype)
    refused = torch.rand(7, 1003, generator=gen) < 0.5
    refused[1] = False  # nothing refused: the plain argmax, rank 1
    refused[2] = True
    refused[2, 999] = False  # one token allowed
    logits[3, 20] = logits[3, 700] = 100.0  # a tie of allowed tokens: the first wins
    refused[3, 20] = refused[3, 700] = False
    logits[4, 5] = float("nan")  # NaN never wins
    refused[4, 5] = False
    logits[5] = float("-inf")  # only -inf allowed: the first allowed index
    refused[6] = True  # nothing allowed: -1
    argmax, rank = cpu_kernels.masked_argmax(logits, refused)
    values = logits.float().masked_fill(refused, float("-inf")).nan_to_num(nan=float("-inf"))
    expected = values.argmax(dim=-1)
    expected[5] = int((~refused[5]).nonzero()[0, 0])
    expected[6] = -1
    assert argmax.tolist() == expected.tolist()
    assert argmax[1] == logits[1].float().argmax() and argmax[2] == 999 and argmax[3] == 20
    chosen = logits.float().gather(1, argmax[:6, None].clamp(min=0))
    above = (logits[:6].float() > chosen).sum(dim=-1) + 1
    assert rank[:6].tolist() == above.tolist()
    assert rank[1] == 1 and rank[2] > 1


def test_masked_argmax_refuses_a_mask_of_another_shape() -> None:
    logits = torch.zeros(2, 8)
    for refused in (torch.zeros(2, 7, dtype=torch.bool), torch.zeros(2, 8, dtype=torch.uint8)):
        with pytest.raises(KernelArgumentError, match="refused"):
            cpu_kernels.masked_argmax(logits, refused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_logsumexp_matches_torch_and_takes_the_first_maximum(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(6, 1003, generator=gen) * 5).to(dtype)
    logits[1, 10] = logits[1, 500] = 100.0  # a tie: the first index wins, as in torch
    logits[2] = float("-inf")
    logits[2, 7] = 0.0  # a single finite entry
    logits[3, 1001] = 100.0  # the maximum past the last whole vector
    logits[4, 1000] = logits[4, 1002] = 100.0  # a tie there
    logits[5, 600] = float("nan")  # NaN never wins
    argmax, lse, top = cpu_kernels.argmax_logsumexp(logits)
    assert lse.dtype == top.dtype == torch.float32
    assert argmax.tolist()[:5] == logits[:5].argmax(dim=-1).tolist()
    assert argmax.tolist()[1:5] == [10, 7, 1001, 1000]
    assert argmax[5] == logits[5].nan_to_num(nan=float("-inf")).argmax()
    assert top.tolist() == logits.float().nan_to_num(nan=float("-inf")).max(dim=-1).values.tolist()
    # bfloat16 rows are read as they are: the reference is torch on their float32 values.
    expected = torch.logsumexp(logits[:5].float(), dim=-1)
    torch.testing.assert_close(lse[:5], expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("pool_pad", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_matches_the_reference_and_skips_padding(
    dtype: torch.dtype, pool_pad: int | None
) -> None:
    gen = torch.Generator().manual_seed(9)
    n, kv_heads, head_dim = 11, 2, 16
    qkv = torch.randn(n, (4 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(n, kv_heads, head_dim)  # strided views
    value = qkv[:, 6 * head_dim :].view(n, kv_heads, head_dim)
    slots = torch.randperm(6 * 4, generator=gen)[:n]
    slots[3] = -1  # padding
    caches = [torch.randn(6, 4, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.reshape_and_cache(key, value, *expected, slots)
    if pool_pad is not None:
        caches[0], caches[1], pool = in_pool(caches[0], caches[1], pool_pad)
        before = pool.clone()
    cpu_kernels.write_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    if pool_pad is not None:  # the pool's other layers and padding are untouched
        assert_unchanged_outside(before, pool, *caches)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (
            lambda: cpu_kernels.write_kv(
                torch.zeros(2, 1, 16),
                torch.zeros(2, 1, 16),
                torch.zeros(2, 4, 1, 16),
                torch.zeros(2, 4, 1, 16),
                torch.tensor([0, 8]),
            ),
            "slot_mapping",
        ),
        (
            lambda: cpu_kernels.write_kv(
                torch.zeros(2, 1, 16),
                torch.zeros(2, 1, 16),
                torch.zeros(2, 4, 1, 16),
                torch.zeros(2, 8, 1, 16)[:, ::2],  # rows of a block two rows apart
                torch.tensor([0, 5]),
            ),
            "value_cache",
        ),
        (lambda: cpu_kernels.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5), "weight"),
        (lambda: cpu_kernels.rms_norm(torch.zeros(2, 8).half(), torch.zeros(8), 1e-5), "x"),
        (
            lambda: cpu_kernels.rms_norm(
                torch.zeros(2, 8), torch.zeros(8), 1e-5, residual=torch.zeros(3, 8)
            ),
            "residual",
        ),
        (lambda: cpu_kernels.rms_norm(torch.zeros(2, 8), torch.zeros(8), 1e-5, kind="l2"), "kind"),
        (lambda: cpu_kernels.head_norm_(torch.zeros(2, 64), torch.zeros(16), 1e-5, 5), "x"),
        (
            lambda: cpu_kernels.head_norm_(torch.zeros(2, 64), torch.zeros(16).double(), 1e-5, 2),
            "weight",
        ),
        (lambda: cpu_kernels.silu_mul(torch.zeros(2, 7)), "gate_up"),
        (lambda: cpu_kernels.gelu_tanh_mul(torch.zeros(2, 7)), "gate_up"),
        (
            lambda: cpu_kernels.rotary_(
                torch.zeros(2, 64),
                torch.tensor([0, 1]),
                torch.zeros(8, 16),
                torch.zeros(8, 16),
                4,
                head_dim=12,
            ),
            "qkv",
        ),
        (lambda: cpu_kernels.argmax_logsumexp(torch.zeros(2, 7).half()), "logits"),
        (lambda: cpu_kernels.argmax_logsumexp(torch.zeros(2, 8)[:, ::2]), "logits"),
        (
            lambda: cpu_kernels.rotary_(
                torch.zeros(2, 64), torch.tensor([0, 9]), torch.zeros(8, 16), torch.zeros(8, 16), 4
            ),
            "positions",
        ),
        (
            lambda: cpu_kernels.rotary_(
                torch.zeros(2, 64), torch.tensor([0, 1]), torch.zeros(8, 16), torch.zeros(8, 16), 5
            ),
            "qkv",
        ),
    ],
)
def test_op_arguments_are_checked(call: object, name: str) -> None:
    with pytest.raises(KernelArgumentError) as info:
        call()  # type: ignore[operator]
    assert info.value.name == name
