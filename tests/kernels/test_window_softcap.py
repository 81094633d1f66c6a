"""Sliding windows and soft-capping in the Triton prefill and decode kernels, against the
torch reference: windows shorter than, equal to and longer than a context, starting mid-block
and mid-partition, with and without a soft-cap, over GQA groups and several block sizes."""

from __future__ import annotations

import pytest
import torch

import llmserve_kernels
from llmserve_kernels import paged_attention, reference
from tests.kernels.paged import (
    DTYPES,
    assert_close,
    make_attention_case,
    skip_unsupported,
)

HEAD_DIM = 32
# Large enough that scores often pass the cap, so capping changes the result.
SCALE = 0.5
SOFTCAP = 4.0
# Decode contexts: one token, shorter than every window but 1, and two long ones.
DECODE_LENS = [1, 23, 77, 150]
# Windows: the query alone, exactly the second context (23), starting mid-block for every block
# size here and mid-partition for the split-K ones in the 77 and 150 contexts (77 - 40 = 37,
# 150 - 40 = 110), and longer than every context.
WINDOWS = [1, 23, 40, 1000]
# (block_size, partition_size, queries_per_kv): single pass and split-K, with GQA.
DECODE_LAYOUTS = [
    pytest.param(16, 512, 4, id="bs16-single-gqa4"),
    pytest.param(8, 32, 1, id="bs8-split32-mha"),
    pytest.param(32, 64, 3, id="bs32-split64-gqa3"),
]
SOFTCAPS = [pytest.param(None, id="nocap"), pytest.param(SOFTCAP, id="cap")]


def decode_case(
    device: str, dtype: torch.dtype, block_size: int, queries_per_kv: int, seed: int = 0
) -> tuple:
    """(query, key_cache, value_cache, block_tables, seq_lens, scale) for DECODE_LENS."""
    cache, query = make_attention_case(
        DECODE_LENS, len(DECODE_LENS), queries_per_kv=queries_per_kv, block_size=block_size,
        head_dim=HEAD_DIM, dtype=dtype, device=device, seed=seed,
    )  # fmt: skip
    return (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, SCALE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "partition_size", "queries_per_kv"), DECODE_LAYOUTS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_decode_window_and_softcap_match_reference(
    device: str,
    dtype: torch.dtype,
    block_size: int,
    partition_size: int,
    queries_per_kv: int,
    softcap: float | None,
) -> None:
    skip_unsupported(device, dtype)
    args = decode_case(device, dtype, block_size, queries_per_kv)
    for window in WINDOWS:
        actual = llmserve_kernels.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window, softcap=softcap
        )
        expected = reference.paged_attention_decode(*args, sliding_window=window, softcap=softcap)
        assert_close(actual, expected)


def test_decode_reads_no_key_before_the_window(device: str) -> None:
    """Every cached key and value before the window is NaN: the output stays finite and equal
    to the reference (computed before the poisoning) only if those slots are never loaded,
    not merely masked (a masked NaN value still poisons the weighted sum)."""
    window = 40
    args = decode_case(device, torch.float32, 8, 2)
    expected = {
        cap: reference.paged_attention_decode(*args, sliding_window=window, softcap=cap)
        for cap in (None, SOFTCAP)
    }
    _, key_cache, value_cache, block_tables, seq_lens, _ = args
    block_size = key_cache.shape[1]
    for seq, length in enumerate(seq_lens.tolist()):
        for pos in range(max(length - window, 0)):
            block = block_tables[seq, pos // block_size]
            key_cache[block, pos % block_size] = float("nan")
            value_cache[block, pos % block_size] = float("nan")
    for partition_size in (512, 32):  # one pass; windows from mid-partition
        for cap in (None, SOFTCAP):
            actual = llmserve_kernels.paged_attention_decode(
                *args, partition_size=partition_size, sliding_window=window, softcap=cap
            )
            assert_close(actual, expected[cap])


def test_decode_window_and_softcap_change_the_result(device: str) -> None:
    """The comparisons above can fail: ignoring the window or the cap gives another output."""
    args = decode_case(device, torch.float32, 8, 2)
    plain = reference.paged_attention_decode(*args)
    windowed = llmserve_kernels.paged_attention_decode(*args, partition_size=32, sliding_window=40)
    capped = llmserve_kernels.paged_attention_decode(*args, partition_size=32, softcap=SOFTCAP)
    # Sequences 2 and 3 (77 and 150 tokens) have keys outside a window of 40.
    for seq in (2, 3):
        assert not torch.allclose(windowed[seq], plain[seq], atol=1e-3)
        assert not torch.allclose(capped[seq], plain[seq], atol=1e-3)
    # Within the window (1 and 23 tokens) a window changes nothing.
    torch.testing.assert_close(windowed[:2], plain[:2], atol=2e-5, rtol=2e-5)


def test_decode_padding_rows_give_zeros_with_a_window(device: str) -> None:
    """CUDA-graph padding rows attend to an empty context (length 0): zeros, not NaN."""
    cache, query = make_attention_case(
        [0, 30, 0], 3, queries_per_kv=2, block_size=8, head_dim=HEAD_DIM,
        dtype=torch.float32, device=device, seed=5,
    )  # fmt: skip
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, SCALE)
    for partition_size in (512, 16):
        out = llmserve_kernels.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=20, softcap=SOFTCAP
        )
        assert torch.equal(out[0::2], torch.zeros_like(out[0::2]))
        expected = reference.paged_attention_decode(*args, sliding_window=20, softcap=SOFTCAP)
        assert_close(out[1], expected[1])


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_one_plan_runs_layers_with_and_without_a_window(device: str, softcap: float | None) -> None:
    """Layers alternate a window and full attention (as Gemma 2 does) over one plan."""
    args = decode_case(device, torch.float32, 16, 4)
    query, key_cache, value_cache, block_tables, seq_lens, _ = args
    plan = paged_attention.DecodePlan(
        block_tables, seq_lens, num_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
        head_dim=HEAD_DIM, block_size=16, dtype=torch.float32, scale=SCALE,
        partition_size=32, softcap=softcap,
    )  # fmt: skip
    for window in (40, None, 40, None):
        out = plan.run(query, key_cache, value_cache, sliding_window=window)
        assert_close(
            out, reference.paged_attention_decode(*args, sliding_window=window, softcap=softcap)
        )


# Prefill: (cached prefix, new tokens) per sequence: a whole prompt, a chunk after a prefix,
# one new token, a long prefix with a short chunk.
PREFILL_SEQS = [(0, 40), (50, 30), (8, 1), (100, 5)]
# Windows: the token alone, mid-block, longer than a whole prompt but not than the longest
# context, and longer than every context.
PREFILL_WINDOWS = [1, 17, 45, 1000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("block_size", "queries_per_kv"),
    [pytest.param(8, 1, id="bs8-mha"), pytest.param(16, 4, id="bs16-gqa4")],
)
@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_prefill_window_and_softcap_match_reference(
    device: str, dtype: torch.dtype, block_size: int, queries_per_kv: int, softcap: float | None
) -> None:
    skip_unsupported(device, dtype)
    args = prefill_case(device, dtype, block_size, queries_per_kv)
    for window in PREFILL_WINDOWS:
        actual = llmserve_kernels.prefill_attention(*args, sliding_window=window, softcap=softcap)
        expected = reference.prefill_attention(*args, sliding_window=window, softcap=softcap)
        assert_close(actual, expected)


def test_prefill_window_and_softcap_change_the_result(device: str) -> None:
    args = prefill_case(device, torch.float32, 8, 2)
    plain = reference.prefill_attention(*args)
    windowed = llmserve_kernels.prefill_attention(*args, sliding_window=6)
    capped = llmserve_kernels.prefill_attention(*args, softcap=SOFTCAP)
    # The first 6 tokens of the first prompt see no more than the window: unchanged ...
    torch.testing.assert_close(windowed[:6], plain[:6], atol=2e-5, rtol=2e-5)
    # ... every later token, in every sequence, loses keys.
    for rows in (slice(6, 40), slice(40, 70), slice(70, 71), slice(71, 76)):
        assert not torch.allclose(windowed[rows], plain[rows], atol=1e-3)
    assert not torch.allclose(capped, plain, atol=1e-3)


def prefill_case(device: str, dtype: torch.dtype, block_size: int, queries_per_kv: int) -> tuple:
    """(query, caches, block_tables, query_start_loc, seq_lens, scale) for PREFILL_SEQS."""
    query_lens = [new for _, new in PREFILL_SEQS]
    cache, query = make_attention_case(
        [prefix + new for prefix, new in PREFILL_SEQS], sum(query_lens),
        queries_per_kv=queries_per_kv, block_size=block_size, head_dim=HEAD_DIM, dtype=dtype,
        device=device, seed=3,
    )  # fmt: skip
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(device)
    return (
        query, cache.key_cache, cache.value_cache, cache.block_tables, starts, cache.seq_lens,
        SCALE,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sliding_window": -1}, "sliding_window: must be a non-negative integer"),
        ({"sliding_window": 2.5}, "sliding_window: must be a non-negative integer"),
        ({"softcap": 0.0}, "softcap: must be positive"),
        ({"softcap": float("inf")}, "softcap: must be positive and finite"),
        ({"softcap": "50"}, "softcap: must be a number"),
    ],
)
def test_bad_window_or_softcap_is_refused_by_name(device: str, kwargs: dict, message: str) -> None:
    decode_args = decode_case(device, torch.float32, 16, 1)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match=message):
        llmserve_kernels.paged_attention_decode(*decode_args, **kwargs)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match=message):
        llmserve_kernels.prefill_attention(*prefill_case(device, torch.float32, 16, 1), **kwargs)
