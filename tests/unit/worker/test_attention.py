"""The CPU attention backends (torch, native, and Triton under its interpreter) against a
per-sequence reference, over caches of their own or views into a block-major pool of layers,
and backend selection."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from tests.kernels.paged import LAYOUTS, assert_unchanged_outside, in_pool
from worker_service.attention import (
    AttentionBackendError,
    AttentionMetadata,
    AttentionSpec,
    get_backend_class,
)
from worker_service.attention.torch_backend import TorchAttentionBackend

BS, H, KVH, D = 4, 6, 2, 32
CPU_SPEC = AttentionSpec(torch.device("cpu"), torch.float32, H, KVH, D)
# tests/conftest.py sets it where there is no CUDA device; Triton runs CPU tensors only then.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_ON_CPU = pytest.param(
    "triton",
    marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1"),
)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence: q [n, H, D] at positions context.., k/v [context + n, KVH, D]; a query
    at p sees keys p - window < j <= p; scores capped to softcap * tanh(s / softcap); head
    h's weights divided by one more exp(sinks[h]) (sums taken without a max shift)."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n, total = q.shape[0], k.shape[0]
    query_pos = context + torch.arange(n)[:, None]
    keys = torch.arange(total)[None, :]
    allowed = keys <= query_pos
    if window is not None:
        allowed &= keys > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    weights = scores.double().exp()
    weights = weights / (weights.sum(-1, keepdim=True) + sinks.double().exp()[:, None, None])
    return torch.einsum("hqk,khd->qhd", weights.float(), v)


# (context already cached, new tokens): prefills (one from scratch, two over a cached
# prefix, one long enough for several key chunks of the native kernel), then decodes.
SEQS = [(0, 7), (5, 6), (70, 9), (9, 1), (3, 1), (14, 1), (90, 1)]


@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks"),
    [
        (None, None, False),
        (3, None, False),
        (None, 0.7, False),
        (5, 0.5, False),
        (40, None, False),
        (None, None, True),
        (3, None, True),
    ],
)
@pytest.mark.parametrize("backend_name", ["torch", "cpu", TRITON_ON_CPU])
@pytest.mark.parametrize("pool_pad", LAYOUTS)
def test_mixed_batch_of_chunks_prefix_hits_and_decodes(
    backend_name: str,
    window: int | None,
    softcap: float | None,
    with_sinks: bool,
    pool_pad: int | None,
) -> None:
    torch.manual_seed(0)
    # Sinks around the scores' size (keys are scaled up below), one per query head.
    sinks = torch.linspace(-2.0, 6.0, H) if with_sinks else None
    seqs = SEQS
    num_blocks = 80
    key_cache = torch.zeros(num_blocks, BS, KVH, D)
    value_cache = torch.zeros(num_blocks, BS, KVH, D)
    perm = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v, next_block = [], [], [], 0
    for context, n in seqs:
        nb = -(-(context + n) // BS)
        tables.append(perm[next_block : next_block + nb])
        next_block += nb
        # Scaled up so that soft-capping changes the scores a lot.
        full_k.append(torch.randn(context + n, KVH, D) * 3)
        full_v.append(torch.randn(context + n, KVH, D))
        for pos in range(context):  # the cached prefix
            blk, off = tables[-1][pos // BS], pos % BS
            key_cache[blk, off], value_cache[blk, off] = full_k[-1][pos], full_v[-1][pos]
    queries = [torch.randn(n, H, D) for _, n in seqs]
    slots = [
        tables[i][p // BS] * BS + p % BS for i, (c, n) in enumerate(seqs) for p in range(c, c + n)
    ]
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    if pool_pad is not None:  # the middle layer's views into a pool (NaN elsewhere)
        key_cache, value_cache, pool = in_pool(key_cache, value_cache, pool_pad)
        before = pool.clone()
    pre = [s for s in seqs if s[1] > 1]
    dec = seqs[len(pre) :]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    starts = [0]
    for _, n in pre:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        num_prefills=len(pre),
        num_prefill_tokens=starts[-1],
        num_decodes=len(dec),
        slot_mapping=torch.tensor(slots),
        prefill_query_start_loc=i32(starts),
        prefill_query_lens=i32([n for _, n in pre]),
        prefill_context_lens=i32([c for c, _ in pre]),
        prefill_seq_lens=i32([c + n for c, n in pre]),
        prefill_block_tables=padded[: len(pre)],
        max_prefill_query_len=max(n for _, n in pre),
        max_prefill_seq_len=max(c + n for c, n in pre),
        prefill_no_context=False,
        decode_seq_lens=i32([c + n for c, n in dec]),
        decode_block_tables=padded[len(pre) :],
        max_decode_seq_len=max(c + n for c, n in dec),
        block_size=BS,
    )
    spec = replace(CPU_SPEC, sliding_window=window, softcap=softcap, sinks=with_sinks)
    backend = get_backend_class(backend_name, spec)(H, KVH, D, D**-0.5, softcap)
    backend.begin_step(meta)
    out = backend.forward(
        torch.cat(queries),
        torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)]),
        key_cache,
        value_cache,
        meta,
        sliding_window=window,
        sinks=sinks,
    )
    expected = torch.cat(
        [
            reference(q, k, v, c, window, softcap, sinks)
            for q, k, v, (c, _) in zip(queries, full_k, full_v, seqs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every new token's K/V landed in its slot, and nowhere outside the layer's caches.
    flat_k = key_cache.reshape(-1, KVH, D)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    assert torch.equal(flat_k[torch.tensor(slots)], new_k)
    if pool_pad is not None:
        assert_unchanged_outside(before, pool, key_cache, value_cache)
    if window is not None or softcap is not None or sinks is not None:  # features matter
        plain = torch.cat(
            [
                reference(q, k, v, c)
                for q, k, v, (c, _) in zip(queries, full_k, full_v, seqs, strict=True)
            ]
        )
        assert not torch.allclose(out, plain, atol=1e-3)


def test_no_context_prefill_with_a_window_and_softcap() -> None:
    """The torch backend's path without a cached prefix (keys from the step itself)."""
    torch.manual_seed(1)
    n = 13
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D) * 3, torch.randn(n, KVH, D)
    table = torch.arange(4, dtype=torch.int32)[None]
    meta = AttentionMetadata(
        num_prefills=1,
        num_prefill_tokens=n,
        num_decodes=0,
        slot_mapping=torch.arange(n),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_query_lens=torch.tensor([n], dtype=torch.int32),
        prefill_context_lens=torch.tensor([0], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32),
        prefill_block_tables=table,
        max_prefill_query_len=n,
        max_prefill_seq_len=n,
        prefill_no_context=True,
        decode_seq_lens=torch.zeros(0, dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 4, dtype=torch.int32),
        max_decode_seq_len=0,
        block_size=BS,
    )
    for name in ("torch", "cpu"):
        backend = get_backend_class(name, CPU_SPEC)(H, KVH, D, D**-0.5, 0.6)
        backend.begin_step(meta)
        cache = torch.zeros(4, BS, KVH, D), torch.zeros(4, BS, KVH, D)
        out = backend.forward(q, k, v, *cache, meta, sliding_window=4)
        torch.testing.assert_close(out, reference(q, k, v, 0, 4, 0.6), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1")
def test_triton_takes_windows_and_softcaps() -> None:
    spec = replace(CPU_SPEC, sliding_window=512, softcap=50.0)
    assert get_backend_class("triton", spec).name == "triton"


def test_auto_is_the_native_backend_on_cpu_and_torch_where_it_cannot_run() -> None:
    assert get_backend_class("auto", CPU_SPEC).name == "cpu"
    assert get_backend_class("torch", CPU_SPEC) is TorchAttentionBackend
    # fp16 and a head size without a native kernel fall back to torch under auto ...
    for spec in (
        replace(CPU_SPEC, dtype=torch.float16),
        replace(CPU_SPEC, head_dim=80),
    ):
        assert get_backend_class("auto", spec) is TorchAttentionBackend
        # ... and are refused with the reason when asked for by name.
        with pytest.raises(AttentionBackendError, match="cannot run here: unsupported"):
            get_backend_class("cpu", spec)


def test_a_backend_without_sinks_is_refused_by_name_for_a_model_with_them() -> None:
    class NoSinks(TorchAttentionBackend):
        name = "no_sinks_test"
        supports_sinks = False

    spec = replace(CPU_SPEC, sinks=True)
    assert NoSinks.unsupported_reason(CPU_SPEC) is None
    assert "attention sinks" in (NoSinks.unsupported_reason(spec) or "")
    for name in ("torch", "cpu"):  # the backends here all take them
        assert get_backend_class(name, spec).supports_sinks


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(AttentionBackendError, match="known: \\['cpu', 'torch', 'triton'\\]"):
        get_backend_class("flash", CPU_SPEC)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", TRITON_ON_CPU])
def test_decode_rows_of_one_sequence_attend_causally(backend_name: str) -> None:
    """Speculative decoding's verification: a sequence's last token and its drafts run as
    decode rows sharing one block table, row i seeing the keys up to its own position (all
    rows' K/V are written before any row attends): the same as a causal chunk."""
    torch.manual_seed(2)
    context, rows = 10, 5  # one row for the last known token, four for drafts
    total = context + rows
    k, v = torch.randn(total, KVH, D) * 3, torch.randn(total, KVH, D)
    q = torch.randn(rows, H, D)
    table = [7, 2, 9, 4]
    key_cache, value_cache = torch.zeros(10, BS, KVH, D), torch.zeros(10, BS, KVH, D)
    for pos in range(context):
        key_cache[table[pos // BS], pos % BS] = k[pos]
        value_cache[table[pos // BS], pos % BS] = v[pos]
    positions = range(context, total)
    meta = AttentionMetadata.for_decodes(
        slot_mapping=torch.tensor([table[p // BS] * BS + p % BS for p in positions]),
        seq_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        block_tables=torch.tensor([table] * rows, dtype=torch.int32),
        max_seq_len=total,
        block_size=BS,
    )
    backend = get_backend_class(backend_name, CPU_SPEC)(H, KVH, D, D**-0.5, None)
    backend.begin_step(meta)
    out = backend.forward(q, k[context:], v[context:], key_cache, value_cache, meta)
    torch.testing.assert_close(out, reference(q, k, v, context), atol=1e-5, rtol=1e-5)


def test_decode_metadata_has_no_prefill_part() -> None:
    slots = torch.tensor([9, 30, 3], dtype=torch.int64)
    lens = torch.tensor([2, 7, 4], dtype=torch.int32)
    tables = torch.tensor([[2, 0], [6, 7], [0, 0]], dtype=torch.int32)
    meta = AttentionMetadata.for_decodes(slots, lens, tables, max_seq_len=7, block_size=BS)
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decodes) == (0, 0, 3)
    assert meta.num_tokens == 3
    assert meta.prefill_query_start_loc.tolist() == [0]
    assert meta.prefill_query_start_loc.dtype == torch.int32
    assert [t.numel() for t in (meta.prefill_query_lens, meta.prefill_seq_lens)] == [0, 0]
    assert meta.prefill_block_tables.shape == (0, 2)
    assert (meta.max_prefill_query_len, meta.max_prefill_seq_len) == (0, 0)
    assert meta.prefill_no_context
    assert meta.decode_seq_lens is lens and meta.decode_block_tables is tables
    assert meta.slot_mapping is slots
    assert (meta.max_decode_seq_len, meta.block_size) == (7, BS)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", TRITON_ON_CPU])
def test_a_layer_that_reads_another_layers_kv_writes_nothing(backend_name: str) -> None:
    """`write_kv=False` (Gemma 4's KV-shared layers): the cache, already holding every
    position's K/V (the source layer wrote them), stays as it is whatever keys/values come
    along, and queries attend over what it holds: a prefill over a cached prefix and a
    decode, one with a window."""
    torch.manual_seed(2)
    seqs = [(5, 3), (9, 1)]  # (context, new tokens)
    key_cache, value_cache = torch.randn(8, BS, KVH, D) * 3, torch.randn(8, BS, KVH, D)
    tables = [[6, 1], [3, 7, 0]]
    slots = [
        tables[i][p // BS] * BS + p % BS for i, (c, n) in enumerate(seqs) for p in range(c, c + n)
    ]

    def cached(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # [context + n, KVH, D] each
        total = sum(seqs[i])
        rows = torch.tensor([tables[i][p // BS] * BS + p % BS for p in range(total)])
        return key_cache.view(-1, KVH, D)[rows], value_cache.view(-1, KVH, D)[rows]

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    meta = AttentionMetadata(
        num_prefills=1,
        num_prefill_tokens=3,
        num_decodes=1,
        slot_mapping=torch.tensor(slots),
        prefill_query_start_loc=i32([0, 3]),
        prefill_query_lens=i32([3]),
        prefill_context_lens=i32([5]),
        prefill_seq_lens=i32([8]),
        prefill_block_tables=i32([tables[0] + [0]]),
        max_prefill_query_len=3,
        max_prefill_seq_len=8,
        prefill_no_context=False,
        decode_seq_lens=i32([10]),
        decode_block_tables=i32([tables[1]]),
        max_decode_seq_len=10,
        block_size=BS,
    )
    expected_caches = key_cache.clone(), value_cache.clone()
    q = torch.randn(4, H, D)
    for window in (None, 3):
        backend = get_backend_class(backend_name, CPU_SPEC)(H, KVH, D, D**-0.5)
        backend.begin_step(meta)
        garbage = torch.randn(4, KVH, D), torch.randn(4, KVH, D)
        out = backend.forward(
            q, *garbage, key_cache, value_cache, meta, sliding_window=window, write_kv=False
        )
        assert torch.equal(key_cache, expected_caches[0])
        assert torch.equal(value_cache, expected_caches[1])
        expected = torch.cat(
            [reference(q[:3], *cached(0), 5, window), reference(q[3:], *cached(1), 9, window)]
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
