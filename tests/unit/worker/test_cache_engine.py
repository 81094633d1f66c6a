"""CacheEngine: block sizing, swap out/in bit-exactness, copy-on-write copies in every layer."""

from __future__ import annotations

import torch

from llmserve.kv_layout import KvLayout, plan_layout, single_group
from worker_service.cache_engine import CacheEngine, cache_block_size_bytes


def make_engine(dtype: torch.dtype = torch.float32, layout: KvLayout | None = None) -> CacheEngine:
    return CacheEngine(
        layout=layout or single_group(3),
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        num_device_blocks=10,
        num_host_blocks=6,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def test_block_size_bytes_counts_k_and_v_of_every_layer() -> None:
    # SmolLM2: 30 layers, 3 kv heads, head_dim 64, 16 tokens, fp32 -> 2*30*16*3*64*4 bytes.
    assert cache_block_size_bytes(30, 3, 64, 16, torch.float32) == 737_280
    assert cache_block_size_bytes(30, 3, 64, 16, torch.bfloat16) == 368_640


def test_layer_caches_are_views_with_the_documented_layout() -> None:
    engine = make_engine()
    caches = engine.layer_caches()
    assert len(caches) == 3
    key, value = caches[1]
    assert key.shape == value.shape == (10, 4, 2, 8)
    key[3, 2, 1, 5] = 1.5
    assert engine.device_cache[1, 0, 3, 2, 1, 5] == 1.5


def test_layers_of_a_grouped_layout_share_slots_by_their_index_in_the_group() -> None:
    # Layers 0, 1, 3, 4 slide, 2 and 5 attend to all: three groups of two layers.
    layout = plan_layout([4, 4, None, 4, 4, None])
    engine = make_engine(layout=layout)
    assert engine.device_cache.shape[:3] == (2, 2, 10)  # two slots a block
    caches = engine.layer_caches()
    assert len(caches) == 6
    # Layer 2 is slot 0 of the full group, layer 4 slot 1 of the second windowed group.
    caches[2][0][3, 0, 0, 0] = 2.0
    caches[4][1][5, 0, 0, 0] = 4.0
    assert engine.device_cache[0, 0, 3, 0, 0, 0] == 2.0
    assert engine.device_cache[1, 1, 5, 0, 0, 0] == 4.0
    assert caches[0][0].data_ptr() == caches[2][0].data_ptr() == caches[3][0].data_ptr()


def test_swap_out_then_in_restores_bit_exactly() -> None:
    engine = make_engine(torch.bfloat16)
    torch.manual_seed(0)
    engine.device_cache.copy_(torch.randn_like(engine.device_cache, dtype=torch.float32).bfloat16())
    original = engine.device_cache[:, :, [2, 5, 7]].clone()
    engine.swap_out([(2, 0), (5, 4), (7, 1)])
    engine.device_cache.zero_()
    engine.swap_in([(0, 9), (4, 3), (1, 0)])
    restored = engine.device_cache[:, :, [9, 3, 0]]
    assert torch.equal(restored.view(torch.int16), original.view(torch.int16))
    # Untouched blocks stay zero.
    assert not engine.device_cache[:, :, [1, 2, 4, 5, 6, 7, 8]].any()


def test_copy_blocks_copies_every_layer_and_both_caches() -> None:
    engine = make_engine()
    torch.manual_seed(1)
    engine.device_cache.copy_(torch.randn_like(engine.device_cache))
    before = engine.device_cache.clone()
    engine.copy_blocks([(1, 8), (4, 9)])
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(engine.device_cache[layer, kv, 8], before[layer, kv, 1])
            assert torch.equal(engine.device_cache[layer, kv, 9], before[layer, kv, 4])
    assert torch.equal(engine.device_cache[:, :, :8], before[:, :, :8])


def test_empty_mappings_are_no_ops() -> None:
    engine = make_engine()
    engine.swap_out([])
    engine.swap_in([])
    engine.copy_blocks([])
    assert not engine.device_cache.any()
