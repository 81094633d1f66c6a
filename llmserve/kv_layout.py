"""How a model's layers keep their K/V in the paged cache: KV groups (DESIGN.md, section 13).

Layers that attend alike share one block table per sequence: a **group** is a list of layers
of one kind (full attention, or a sliding window of W tokens) and one K/V width (elements
per token: kv heads x head dim). Every block of the worker's one pool holds `slots` slots of
`unit` elements per token, K and V; a layer takes `width / unit` consecutive slots
(`KvGroup.units`), so a block given to group g holds its j-th layer in slots
[j * units, (j + 1) * units). The unit is the greatest common divisor of the layers' widths:
layers of different head sizes (Gemma 4's 256 and 512) share the one pool without padding.
So one block id space serves every group, memory moves between groups as the load changes,
and swaps, copies and transfers move whole blocks whatever group they belong to.

Groups are cut to equal sizes so that no slot sits idle: a block holds as many slots as the
smallest kind needs for all its layers (at least one layer of the widest), and each kind's
layers are split into groups that fill it (the last group of a kind may be shorter, its
spare slots unused). A model whose layers all attend alike is one group of every layer, the
layout before groups existed.

A windowed group keeps only the blocks that the window can still read. Its table stays
indexed by position (entry i holds positions [i * block_size, (i + 1) * block_size)); the
entries before the window hold `NULL_BLOCK`, a block reserved at start-up that is never
written and reads as zeros (backends mask it: it lies outside every window).

Recurrent layers (Gated DeltaNet linear attention, Qwen3.5) keep no K/V per token: each
sequence has one **state slot**, in pools of their own beside the blocks
(`worker_service.linear_state`). They are in no group; `state_layers` lists them. (A model of
recurrent layers alone is refused: every layout has a group.)

The scheduler and the worker both read their rules from here: the scheduler learns the
groups' windows from the worker (`InfoResponse.kv_groups`), the worker builds its cache from
the same layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Table entry of a windowed group for a block the window left: block 0 of the pool, reserved
# (never allocated to a sequence) whenever some group has a window.
NULL_BLOCK = 0


class KvLayoutError(ValueError):
    """The layers cannot be laid out as KV groups (the message names what)."""


@dataclass(frozen=True, slots=True)
class KvGroup:
    """Layers that share one block table per sequence."""

    sliding_window: int | None  # keys less than this many positions behind a query; None: all
    layers: tuple[int, ...]  # the layers whose K/V its blocks hold, in slot order
    units: int = 1  # slots each layer takes: its K/V width per token over the layout's unit

    def first_slot(self, j: int) -> int:
        """The first slot of the group's j-th layer in each of its blocks."""
        return j * self.units

    def first_live_block(self, position: int, block_size: int) -> int:
        """The first table index a windowed group keeps while its next computed position is
        `position` (0 without a window): see `first_live_block`."""
        if self.sliding_window is None:
            return 0
        return first_live_block(position, self.sliding_window, block_size)


@dataclass(frozen=True, slots=True)
class KvLayout:
    groups: tuple[KvGroup, ...]
    slots: int  # slots one block holds (each `unit` elements per token, K and V)
    # Layers that store no K/V of their own and read another layer's (KV shared across
    # layers, Gemma 4): layer -> the layer whose cache it reads. In no group.
    shared: tuple[tuple[int, int], ...] = ()
    # Layers that keep a recurrent state per sequence (a state slot) instead of K/V. In no
    # group.
    state_layers: tuple[int, ...] = ()
    unit: int = 1  # elements per token of one slot, K or V: the gcd of the layers' widths

    @property
    def has_states(self) -> bool:
        """Whether sequences hold state slots (some layer is recurrent)."""
        return bool(self.state_layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def reserves_null_block(self) -> bool:
        """Whether block 0 is the null block (some group has a window)."""
        return any(w is not None for w in self.windows)

    def slot_of_layer(self) -> dict[int, tuple[int, int]]:
        """Layer -> (group, first slot) of the blocks that hold its K/V (a shared layer: its
        source's); it spans its group's `units` slots from there."""
        slots = {
            layer: (g, group.first_slot(j))
            for g, group in enumerate(self.groups)
            for j, layer in enumerate(group.layers)
        }
        for layer, source in self.shared:
            slots[layer] = slots[source]
        return dict(sorted(slots.items()))

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups) + len(self.shared) + len(self.state_layers)

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int | None = None) -> int:
        """Device blocks one sequence of `num_tokens` holds at most, computing at most `chunk`
        tokens a step (None: all at once): a full group holds every block, a windowed group
        the window's and the step's."""
        total_blocks = -(-num_tokens // block_size)
        chunk = num_tokens if chunk is None else max(1, min(chunk, num_tokens))
        needed = 0
        for group in self.groups:
            if group.sliding_window is None:
                needed += total_blocks
            else:
                needed += min(total_blocks, window_span(group.sliding_window, block_size, chunk))
        return needed


def first_live_block(position: int, window: int, block_size: int) -> int:
    """The first table index a windowed group keeps while its next computed position is
    `position`: the first block that a query at the start of `position`'s block reads. A
    query at `position` or later reads no block before it; keeping from the block's start
    (one block more at most) keeps what a prefix-cache hit at that block boundary reads, so
    a sequence's own blocks serve a hit on its prefix (a move to another replica)."""
    aligned = position - position % block_size
    return max(0, aligned - window + 1) // block_size


def window_span(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a windowed group keeps for a step that computes `chunk` tokens: from
    `first_live_block` of the step's first position through its last position."""
    return -(-(window - 1) // block_size) + (chunk + block_size - 2) // block_size + 1


def single_group(num_layers: int, width: int = 1) -> KvLayout:
    """The layout of a model whose layers all attend to every key, each storing `width`
    elements per token (K or V)."""
    return KvLayout((KvGroup(None, tuple(range(num_layers))),), num_layers, unit=width)


def plan_layout(
    layer_windows: Sequence[int | None],
    kv_sources: dict[int, int] | None = None,
    state_layers: Sequence[int] = (),
    widths: Sequence[int] | int = 1,
) -> KvLayout:
    """Group layers by their kind, a window (None: full attention) and a K/V width per token
    (`widths`, per layer or one for all): full-attention groups first, then by window size,
    then by width. A block holds as many slots as the smallest kind fills (at least one layer
    of the widest), each kind cut into groups that fit it. `kv_sources` maps a layer that
    reads another layer's K/V (and stores none) to that layer, which must store its own and
    attend with the same window and width. `state_layers` keep a recurrent state instead of
    K/V (their windows and widths are not read)."""
    width_of = [widths] * len(layer_windows) if isinstance(widths, int) else list(widths)
    if len(width_of) != len(layer_windows):
        raise KvLayoutError(f"{len(width_of)} widths for {len(layer_windows)} layers")
    sources = dict(kv_sources or {})
    states = tuple(sorted(set(state_layers)))
    for layer in states:
        if not 0 <= layer < len(layer_windows) or layer in sources or layer in sources.values():
            raise KvLayoutError(f"layer {layer}: a recurrent layer neither stores nor shares K/V")
    for layer, source in sources.items():
        if not 0 <= source < len(layer_windows) or source in sources or source == layer:
            raise KvLayoutError(
                f"layer {layer}: reads the K/V of layer {source}, which stores none"
            )
        if layer_windows[layer] != layer_windows[source]:
            raise KvLayoutError(
                f"layer {layer}: window {layer_windows[layer]} reads the K/V of layer {source}, "
                f"window {layer_windows[source]}"
            )
        if width_of[layer] != width_of[source]:
            raise KvLayoutError(
                f"layer {layer}: width {width_of[layer]} reads the K/V of layer {source}, "
                f"width {width_of[source]}"
            )
    storing = [i for i in range(len(layer_windows)) if i not in sources and i not in states]
    if not storing:
        raise KvLayoutError("a model needs at least one layer that stores K/V")
    for i, window in enumerate(layer_windows):
        if window is not None and window < 1:
            raise KvLayoutError(f"layer {i}: sliding window must be at least 1, got {window}")
        if width_of[i] < 1 and i in storing:
            raise KvLayoutError(f"layer {i}: K/V width must be at least 1, got {width_of[i]}")
    unit = math.gcd(*(width_of[layer] for layer in storing))
    kinds: dict[tuple[int | None, int], list[int]] = {}
    for layer in storing:
        kinds.setdefault((layer_windows[layer], width_of[layer] // unit), []).append(layer)
    slots = max(
        min(len(layers) * units for (_, units), layers in kinds.items()),
        max(units for _, units in kinds),
    )
    order = sorted(kinds, key=lambda kind: (kind[0] is not None, kind[0] or 0, kind[1]))
    groups = tuple(
        KvGroup(window, tuple(kinds[window, units][start : start + slots // units]), units)
        for window, units in order
        for start in range(0, len(kinds[window, units]), slots // units)
    )
    return KvLayout(groups, slots, tuple(sorted(sources.items())), states, unit)
