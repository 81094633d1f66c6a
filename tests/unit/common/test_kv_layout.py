"""KV groups: how layers are grouped, which blocks a window keeps, what a sequence holds."""

from __future__ import annotations

import pytest

from llmserve.kv_layout import (
    KvLayoutError,
    first_live_block,
    plan_layout,
    single_group,
    window_span,
)


def test_a_model_whose_layers_attend_alike_is_one_group_of_every_layer() -> None:
    assert plan_layout([None] * 4) == single_group(4)
    layout = plan_layout([8] * 3)
    assert [g.layers for g in layout.groups] == [(0, 1, 2)]
    assert layout.windows == (8,)
    assert layout.reserves_null_block


def test_kinds_split_into_groups_as_large_as_the_smallest_kind() -> None:
    # Gemma 3's pattern: five local layers, then a global one, three times.
    windows = ([512] * 5 + [None]) * 3
    layout = plan_layout(windows)
    assert layout.slots == 3
    assert [(g.sliding_window, g.layers) for g in layout.groups] == [
        (None, (5, 11, 17)),
        (512, (0, 1, 2)),
        (512, (3, 4, 6)),
        (512, (7, 8, 9)),
        (512, (10, 12, 13)),
        (512, (14, 15, 16)),
    ]
    slots = layout.slot_of_layer()
    assert slots[11] == (0, 1) and slots[6] == (2, 2)


def test_a_kind_that_does_not_divide_evenly_leaves_a_short_last_group() -> None:
    layout = plan_layout([4, 4, 4, 4, 4, None, None])
    assert [g.layers for g in layout.groups] == [(5, 6), (0, 1), (2, 3), (4,)]


def test_shared_layers_store_nothing_and_read_their_source() -> None:
    layout = plan_layout([4, None, 4, None], kv_sources={2: 0, 3: 1})
    assert [g.layers for g in layout.groups] == [(1,), (0,)]
    assert layout.slot_of_layer() == {0: (1, 0), 1: (0, 0), 2: (1, 0), 3: (0, 0)}
    assert layout.num_layers == 4


def test_layers_take_slots_by_their_width_over_the_common_unit() -> None:
    # The large Gemma 4s: local layers of 16 kv heads x 256, global of 4 x 512 (half as wide).
    windows = ([1024] * 5 + [None]) * 2
    layout = plan_layout(windows, widths=([16 * 256] * 5 + [4 * 512]) * 2)
    assert (layout.unit, layout.slots) == (4 * 512, 2)
    assert [(g.sliding_window, g.layers, g.units) for g in layout.groups] == [
        (None, (5, 11), 1),
        *[(1024, (layer,), 2) for layer in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)],
    ]
    assert layout.slot_of_layer()[11] == (0, 1)
    # One kind too small to fill a layer of the widest: a block still holds one such layer.
    narrow = plan_layout([4, None], widths=[8, 24])
    assert (narrow.unit, narrow.slots) == (8, 3)
    assert [(g.layers, g.units) for g in narrow.groups] == [((1,), 3), ((0,), 1)]


@pytest.mark.parametrize(
    ("windows", "sources", "named"),
    [
        ([], None, "at least one layer"),
        ([0, None], None, "layer 0: sliding window"),
        ([4, None], {0: 1}, "window 4 reads the K/V of layer 1"),
        ([None, None], {0: 1, 1: 0}, "stores none"),
    ],
)
def test_layouts_that_cannot_be_built_are_refused_naming_the_layer(
    windows: list[int | None], sources: dict[int, int] | None, named: str
) -> None:
    with pytest.raises(KvLayoutError, match=named):
        plan_layout(windows, sources)


@pytest.mark.parametrize(
    ("widths", "sources", "named"),
    [
        ([64, 128], {1: 0}, "layer 1: width 128 reads the K/V of layer 0, width 64"),
        ([64, 0], None, "layer 1: K/V width must be at least 1"),
        ([64], None, "1 widths for 2 layers"),
    ],
)
def test_widths_that_cannot_be_laid_out_are_refused_by_name(
    widths: list[int], sources: dict[int, int] | None, named: str
) -> None:
    with pytest.raises(KvLayoutError, match=named):
        plan_layout([None, None], sources, widths=widths)


def test_a_window_keeps_every_block_its_queries_read() -> None:
    block, window = 4, 6
    for position in range(40):
        first = first_live_block(position, window, block)
        # Every query from the start of position's block on reads no earlier block...
        start = position - position % block
        assert all(max(0, q - window + 1) // block >= first for q in range(start, position + 9))
        # ...and the query at the block's start reads block `first` itself.
        assert max(0, start - window + 1) // block == first


def test_window_span_bounds_the_blocks_a_step_keeps() -> None:
    block = 4
    for window in (1, 3, 4, 6, 9):
        for chunk in (1, 2, 5, 16):
            worst = 0
            for position in range(64):
                first = first_live_block(position, window, block)
                last = (position + chunk - 1) // block
                worst = max(worst, last - first + 1)
            assert worst == window_span(window, block, chunk), (window, chunk)


def test_blocks_for_counts_full_groups_whole_and_windows_by_their_span() -> None:
    layout = plan_layout([None, 8, 8, None])  # a full group and a windowed one, two layers each
    # 100 tokens in blocks of 4: 25 for the full group; the windowed one holds its span.
    assert layout.blocks_for(100, 4, chunk=1) == 25 + window_span(8, 4, 1)
    assert layout.blocks_for(100, 4) == 25 + 25  # computed at once: every block of the prompt
