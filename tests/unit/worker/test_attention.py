"""The CPU attention backends (torch, native) against a per-sequence reference, and backend
selection."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from worker_service.attention import (
    AttentionBackendError,
    AttentionMetadata,
    AttentionSpec,
    get_backend_class,
)
from worker_service.attention.torch_backend import TorchAttentionBackend

BS, H, KVH, D = 4, 6, 2, 32
CPU_SPEC = AttentionSpec(torch.device("cpu"), torch.float32, H, KVH, D)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int) -> torch.Tensor:
    """One sequence: q [n, H, D] at positions context.., k/v [context + n, KVH, D]."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    n, total = q.shape[0], k.shape[0]
    allowed = torch.arange(total)[None, :] <= context + torch.arange(n)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_mixed_batch_of_chunks_prefix_hits_and_decodes(backend_name: str) -> None:
    torch.manual_seed(0)
    # (context already cached, new tokens): two prefills (one over a prefix), three decodes.
    seqs = [(0, 7), (5, 6), (9, 1), (3, 1), (14, 1)]
    num_blocks = 40
    key_cache = torch.zeros(num_blocks, BS, KVH, D)
    value_cache = torch.zeros(num_blocks, BS, KVH, D)
    perm = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v, next_block = [], [], [], 0
    for context, n in seqs:
        nb = -(-(context + n) // BS)
        tables.append(perm[next_block : next_block + nb])
        next_block += nb
        full_k.append(torch.randn(context + n, KVH, D))
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
    pre = seqs[:2]
    meta = AttentionMetadata(
        num_prefills=2,
        num_prefill_tokens=13,
        num_decodes=3,
        slot_mapping=torch.tensor(slots),
        prefill_query_start_loc=torch.tensor([0, 7, 13], dtype=torch.int32),
        prefill_query_lens=torch.tensor([n for _, n in pre], dtype=torch.int32),
        prefill_context_lens=torch.tensor([c for c, _ in pre], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([c + n for c, n in pre], dtype=torch.int32),
        prefill_block_tables=padded[:2],
        max_prefill_query_len=7,
        max_prefill_seq_len=11,
        prefill_no_context=False,
        decode_seq_lens=torch.tensor([c + n for c, n in seqs[2:]], dtype=torch.int32),
        decode_block_tables=padded[2:],
        max_decode_seq_len=15,
        block_size=BS,
    )
    backend = get_backend_class(backend_name, CPU_SPEC)(H, KVH, D, D**-0.5)
    backend.begin_step(meta)
    out = backend.forward(
        torch.cat(queries),
        torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)]),
        torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)]),
        key_cache,
        value_cache,
        meta,
    )
    expected = torch.cat(
        [
            reference(q, k, v, c)
            for q, k, v, (c, _) in zip(queries, full_k, full_v, seqs, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # Every new token's K/V landed in its slot.
    flat_k = key_cache.view(-1, KVH, D)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    assert torch.equal(flat_k[torch.tensor(slots)], new_k)


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


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(AttentionBackendError, match="known: \\['cpu', 'torch', 'triton'\\]"):
        get_backend_class("flash", CPU_SPEC)
