"""CacheEngine: block sizing, layer views over slots, swap out/in bit-exactness, copy-on-write
copies in every layer."""

from __future__ import annotations

import pytest
import torch

from llmserve.kv_layout import KvLayout, plan_layout, single_group
from worker_service.cache_engine import CacheEngine, KvShape, cache_block_size_bytes

SHAPE = (2, 8)  # num_kv_heads, head_dim


def make_engine(
    dtype: torch.dtype = torch.float32,
    layout: KvLayout | None = None,
    shapes: list[KvShape | None] | None = None,
) -> CacheEngine:
    layout = layout or single_group(3, SHAPE[0] * SHAPE[1])
    return CacheEngine(
        layout=layout,
        kv_shapes=shapes or [SHAPE] * layout.num_layers,
        block_size=4,
        num_device_blocks=10,
        num_host_blocks=6,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def test_block_size_bytes_counts_k_and_v_of_every_layer() -> None:
    # SmolLM2: 30 layers, 3 kv heads, head_dim 64, 16 tokens, fp32 -> 2*30*16*3*64*4 bytes.
    layout = single_group(30, 3 * 64)
    assert cache_block_size_bytes(layout, 16, torch.float32) == 737_280
    assert cache_block_size_bytes(layout, 16, torch.bfloat16) == 368_640


def test_layer_caches_are_views_with_the_documented_layout() -> None:
    engine = make_engine()
    caches = engine.layer_caches()
    assert len(caches) == 3
    key, value = caches[1]
    assert key.shape == value.shape == (10, 4, 2, 8)
    key[3, 2, 1, 5] = 1.5
    value[3, 2, 1, 5] = 2.5
    # [blocks, K/V, slots, block_size, unit]: head 1's dim 5 is element 8 + 5 of the row.
    assert engine.device_cache[3, 0, 1, 2, 13] == 1.5
    assert engine.device_cache[3, 1, 1, 2, 13] == 2.5
    assert engine.device_cache.count_nonzero() == 2
    assert key.stride(0) == engine.block_stride == 2 * 3 * 4 * 16


def test_layers_of_a_grouped_layout_share_slots_by_their_index_in_the_group() -> None:
    # Layers 0, 1, 3, 4 slide, 2 and 5 attend to all: three groups of two layers.
    layout = plan_layout([4, 4, None, 4, 4, None], widths=16)
    engine = make_engine(layout=layout)
    assert engine.device_cache.shape[:3] == (10, 2, 2)  # two slots a block
    caches = engine.layer_caches()
    assert len(caches) == 6
    # Layer 2 is slot 0 of the full group, layer 4 slot 1 of the second windowed group.
    caches[2][0][3, 0, 0, 0] = 2.0
    caches[4][1][5, 0, 0, 0] = 4.0
    assert engine.device_cache[3, 0, 0, 0, 0] == 2.0
    assert engine.device_cache[5, 1, 1, 0, 0] == 4.0
    assert caches[0][0].data_ptr() == caches[2][0].data_ptr() == caches[3][0].data_ptr()


def test_layers_of_two_widths_share_blocks_through_their_slots() -> None:
    # Gemma 4's pattern in small: windowed layers of 2 heads x 8, global ones of 1 head x 32
    # (twice as wide). A block holds four slots of 16: the four windowed layers, or the two
    # global ones, two slots each.
    windows, shapes = [4, 4, None, 4, 4, None], [(2, 8), (2, 8), (1, 32)] * 2
    layout = plan_layout(windows, widths=[h * d for h, d in shapes])
    assert (layout.unit, layout.slots) == (16, 4)
    assert [(g.layers, g.units) for g in layout.groups] == [((2, 5), 2), ((0, 1, 3, 4), 1)]
    engine = make_engine(layout=layout, shapes=list(shapes))
    caches = engine.layer_caches()
    assert caches[5][0].shape == (10, 4, 1, 32) and caches[0][0].shape == (10, 4, 2, 8)
    # Layer 5's block is slots 2 and 3 of the block, token-major; a windowed layer's one slot.
    caches[5][0][7, 1].copy_(torch.arange(32.0) + 1)
    assert torch.equal(engine.device_cache[7, 0, 2:].flatten()[32:64], torch.arange(32.0) + 1)
    caches[1][1][7, 3, 1, 2] = -1.0  # the same block given to the windowed group later
    assert engine.device_cache[7, 1, 1, 3, 8 + 2] == -1.0
    assert engine.device_cache.count_nonzero() == 33
    with pytest.raises(ValueError, match="does not fill 1 slots"):
        make_engine(layout=layout, shapes=[(1, 32)] * 6).layer_caches()


def test_swap_out_then_in_restores_bit_exactly() -> None:
    engine = make_engine(torch.bfloat16)
    torch.manual_seed(0)
    engine.device_cache.copy_(torch.randn_like(engine.device_cache, dtype=torch.float32).bfloat16())
    original = engine.device_cache[[2, 5, 7]].clone()
    engine.swap_out([(2, 0), (5, 4), (7, 1)])
    engine.device_cache.zero_()
    engine.swap_in([(0, 9), (4, 3), (1, 0)])
    restored = engine.device_cache[[9, 3, 0]]
    assert torch.equal(restored.view(torch.int16), original.view(torch.int16))
    # Untouched blocks stay zero.
    assert not engine.device_cache[[1, 2, 4, 5, 6, 7, 8]].any()


def test_copy_blocks_copies_every_layer_and_both_caches() -> None:
    engine = make_engine()
    torch.manual_seed(1)
    engine.device_cache.copy_(torch.randn_like(engine.device_cache))
    before = engine.device_cache.clone()
    engine.copy_blocks([(1, 8), (4, 9)])
    for layer, (key, value) in enumerate(engine.layer_caches()):
        for cache in (key, value):
            assert torch.equal(cache[8], cache[1]), layer
            assert torch.equal(cache[9], cache[4]), layer
    assert torch.equal(engine.device_cache[8], before[1])
    assert torch.equal(engine.device_cache[:8], before[:8])


def test_read_then_write_blocks_moves_whole_blocks() -> None:
    engine = make_engine()
    torch.manual_seed(2)
    engine.device_cache.copy_(torch.randn_like(engine.device_cache))
    blocks = engine.read_blocks([6, 2])
    assert blocks.shape == (2, *engine.device_cache.shape[1:])
    assert blocks.numel() * blocks.element_size() == 2 * engine.block_bytes
    target = make_engine()
    target.write_blocks([0, 9], blocks)
    assert torch.equal(target.device_cache[0], engine.device_cache[6])
    assert torch.equal(target.device_cache[9], engine.device_cache[2])
    assert not target.device_cache[1:9].any()


def test_empty_mappings_are_no_ops() -> None:
    engine = make_engine()
    engine.swap_out([])
    engine.swap_in([])
    engine.copy_blocks([])
    assert not engine.device_cache.any()
