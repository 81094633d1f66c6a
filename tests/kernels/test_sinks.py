"""Attention sinks (gpt-oss: a learned logit per head in every softmax's denominator) in the
Triton decode and prefill kernels and the native CPU kernels, against the torch reference;
the reference itself against the identity a sink obeys: it scales the plain attention
output of head h by Z / (Z + exp(sink_h - max)), Z the plain softmax's sum."""

from __future__ import annotations

import pytest
import torch

import llmserve_kernels
from llmserve_kernels import cpu as cpu_kernels
from llmserve_kernels import paged_attention, reference
from tests.kernels.paged import assert_close, make_attention_case

HEAD_DIM = 32
SCALE = 0.5
DECODE_LENS = [1, 23, 77, 150]
# (cached prefix, new tokens) per prefill sequence.
PREFILL_SEQS = [(0, 40), (50, 30), (8, 1), (100, 5)]
WINDOWS = [None, 1, 40]


def sinks_for(num_heads: int, device: str) -> torch.Tensor:  # [num_heads] float32
    """Sinks from well below to well above the scores (|score| is a few units here), so that
    some heads barely notice theirs and others give it most of the weight."""
    return torch.linspace(-4.0, 12.0, num_heads).to(device)


def decode_args(device: str, block_size: int, queries_per_kv: int) -> tuple:
    cache, query = make_attention_case(
        DECODE_LENS, len(DECODE_LENS), queries_per_kv=queries_per_kv, block_size=block_size,
        head_dim=HEAD_DIM, dtype=torch.float32, device=device, seed=11,
    )  # fmt: skip
    return (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens, SCALE)


def prefill_args(device: str, block_size: int, queries_per_kv: int) -> tuple:
    query_lens = [new for _, new in PREFILL_SEQS]
    cache, query = make_attention_case(
        [prefix + new for prefix, new in PREFILL_SEQS], sum(query_lens),
        queries_per_kv=queries_per_kv, block_size=block_size, head_dim=HEAD_DIM,
        dtype=torch.float32, device=device, seed=12,
    )  # fmt: skip
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32).to(device)
    return (
        query, cache.key_cache, cache.value_cache, cache.block_tables, starts, cache.seq_lens,
        SCALE,
    )  # fmt: skip


def test_reference_sinks_follow_the_rescaling_identity() -> None:
    query, key_cache, value_cache, tables, lens, scale = decode_args("cpu", 8, 2)
    sinks = sinks_for(query.shape[1], "cpu")
    length = int(lens[3])
    key = reference.gather_context(key_cache, tables[3], length)
    value = reference.gather_context(value_cache, tables[3], length)
    q = query[3:4]
    plain = reference.attend(q, key, value, scale, length - 1)
    with_sinks = reference.attend(q, key, value, scale, length - 1, sinks=sinks)
    group = q.shape[1] // key.shape[1]
    scores = torch.einsum("hd,khd->hk", q[0], key.repeat_interleave(group, dim=1)) * scale
    top = torch.maximum(scores.max(dim=-1).values, sinks)  # [heads]
    total = (scores - top[:, None]).exp().sum(dim=-1)
    kept = total / (total + (sinks - top).exp())  # [heads]
    torch.testing.assert_close(with_sinks[0], plain[0] * kept[:, None], atol=1e-6, rtol=1e-5)
    # The sinks matter: the largest takes most of its head's weight.
    assert kept.min() < 0.5 and kept.max() > 0.99


@pytest.mark.parametrize(
    ("block_size", "partition_size", "queries_per_kv"),
    [
        pytest.param(16, 512, 4, id="bs16-single-gqa4"),
        pytest.param(8, 32, 1, id="bs8-split32-mha"),
        pytest.param(32, 64, 3, id="bs32-split64-gqa3"),
    ],
)
def test_triton_decode_sinks_match_reference(
    device: str, block_size: int, partition_size: int, queries_per_kv: int
) -> None:
    args = decode_args(device, block_size, queries_per_kv)
    sinks = sinks_for(args[0].shape[1], device)
    for window in WINDOWS:
        actual = llmserve_kernels.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window, sinks=sinks
        )
        expected = reference.paged_attention_decode(*args, sliding_window=window, sinks=sinks)
        assert_close(actual, expected)
        plain = reference.paged_attention_decode(*args, sliding_window=window)
        assert not torch.allclose(actual, plain, atol=1e-3)


def test_one_plan_runs_layers_with_different_sinks(device: str) -> None:
    """Every layer has its own sinks (and alternates windows) over one decode plan."""
    args = decode_args(device, 16, 2)
    query, key_cache, value_cache, tables, lens, _ = args
    plan = paged_attention.DecodePlan(
        tables, lens, num_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
        head_dim=HEAD_DIM, block_size=16, dtype=torch.float32, scale=SCALE, partition_size=32,
    )  # fmt: skip
    base = sinks_for(query.shape[1], device)
    for sinks, window in ((base, 40), (base.flip(0), None), (None, 40), (base, None)):
        out = plan.run(query, key_cache, value_cache, sliding_window=window, sinks=sinks)
        assert_close(
            out, reference.paged_attention_decode(*args, sliding_window=window, sinks=sinks)
        )


@pytest.mark.parametrize("queries_per_kv", [1, 4])
def test_triton_prefill_sinks_match_reference(device: str, queries_per_kv: int) -> None:
    args = prefill_args(device, 8, queries_per_kv)
    sinks = sinks_for(args[0].shape[1], device)
    for window in WINDOWS:
        actual = llmserve_kernels.prefill_attention(*args, sliding_window=window, sinks=sinks)
        expected = reference.prefill_attention(*args, sliding_window=window, sinks=sinks)
        assert_close(actual, expected)
        assert not torch.allclose(actual, reference.prefill_attention(*args), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("queries_per_kv", [1, 3])
def test_cpu_kernels_sinks_match_reference(dtype: torch.dtype, queries_per_kv: int) -> None:
    decode = [
        t.to(dtype) if t.is_floating_point() else t
        for t in decode_args("cpu", 8, queries_per_kv)[:5]
    ]
    prefill = [
        t.to(dtype) if t.is_floating_point() else t
        for t in prefill_args("cpu", 16, queries_per_kv)[:6]
    ]
    sinks = sinks_for(decode[0].shape[1], "cpu").to(dtype)
    for window in WINDOWS:
        opts = dict(sliding_window=window, sinks=sinks)
        actual = cpu_kernels.paged_attention_decode(*decode, SCALE, **opts)
        assert_close(actual, reference.paged_attention_decode(*decode, SCALE, **opts))
        actual = cpu_kernels.prefill_attention(*prefill, SCALE, **opts)
        assert_close(actual, reference.prefill_attention(*prefill, SCALE, **opts))
        assert not torch.allclose(
            actual.float(), reference.prefill_attention(*prefill, SCALE).float(), atol=1e-2
        )


@pytest.mark.parametrize(
    ("sinks", "message"),
    [
        (torch.zeros(3), r"sinks: expected \[4\]"),
        (torch.zeros(4, dtype=torch.int32), "sinks: must be a float tensor"),
        (torch.zeros(8)[::2], "sinks: must be contiguous"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks: torch.Tensor, message: str) -> None:
    args = decode_args("cpu", 8, 2)
    with pytest.raises(llmserve_kernels.KernelArgumentError, match=message):
        cpu_kernels.paged_attention_decode(*args, sinks=sinks)
