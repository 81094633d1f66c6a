"""What KV transfers between replicas hold on this one: pinned device blocks and snapshots.

A transfer (`scheduler_service.fleet.kv_mover`) moves a prefix's blocks from a source replica
to a target. While it is in flight its blocks are pinned on both sides, beside the sequences'
tables: an export holds blocks some sequence may still use, or cached free ones, so that no
new sequence writes them; an import holds fresh blocks registered under the source's hashes
but not computed, so that no hit reads them before their K/V arrive. With recurrent layers a
transfer also carries the state snapshot at the deepest block boundary of the blocks it moves,
held as the blocks are. Blocks a transfer takes out of the free pool (an import's, or cached
free ones an export holds) are counted under the transfers' allocator tag, not a group's.
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler_service.engine.block_allocator import BlockAllocator
from scheduler_service.engine.prefix_hits import state_key
from scheduler_service.engine.state_slots import StateSlots


class TransferPins:
    """Device blocks and snapshots held by KV transfers, by transfer id, until `unpin`."""

    def __init__(self, gpu: BlockAllocator, states: StateSlots | None, tag: int) -> None:
        self.gpu = gpu
        self.states = states
        self.tag = tag  # the allocator tag of blocks a transfer holds
        # Logical clock for the evictor's LRU order (the block manager's).
        self.now = 0.0
        self.pins: dict[int, list[int]] = {}  # transfer id -> the device blocks it holds
        self.state_pins: dict[int, int] = {}  # transfer id -> the snapshot key it holds

    def pin(
        self, transfer_id: int, block_ids: list[int], state_key: int | None = None
    ) -> int | None:
        """Hold device blocks (in use, or cached and free) for an export, and the snapshot
        under `state_key` if one is saved: they stay allocated, unwritten by new sequences,
        until `unpin`. Returns the snapshot's slot (None: none held)."""
        for block_id in block_ids:
            self.gpu.hold(block_id, self.tag)
        self.pins[transfer_id] = list(block_ids)
        if state_key is None:
            return None
        assert self.states is not None
        slot = self.states.pin(state_key)
        if slot is not None:
            self.state_pins[transfer_id] = state_key
        return slot

    def allocate_pinned(
        self, transfer_id: int, hashed: list[tuple[int, int]], state_key: int | None = None
    ) -> tuple[list[int], int | None]:
        """Device blocks for an import, one per (block hash, hashed tokens), registered under
        those hashes but not computed (`mark_imported` makes them prefix-cache hits); and a
        state slot for the snapshot under `state_key`, if given and one can be had."""
        block_ids = [
            self.gpu.allocate(block_hash, tokens, self.tag) for block_hash, tokens in hashed
        ]
        self.pins[transfer_id] = block_ids
        slot = None
        if state_key is not None:
            assert self.states is not None
            slot = self.states.receive(state_key)
            if slot is not None:
                self.state_pins[transfer_id] = state_key
        return block_ids, slot

    def mark_imported(self, transfer_id: int) -> None:
        """The import's K/V (and snapshot) have arrived: its blocks count as computed."""
        for block_id in self.pins[transfer_id]:
            if self.gpu.block_hashes[block_id] is not None:
                self.gpu.computed[block_id] = True
        key = self.state_pins.get(transfer_id)
        if key is not None:
            assert self.states is not None
            self.states.mark_saved(key)

    def unpin(self, transfer_id: int) -> None:
        """Let go of a transfer's blocks and snapshot (unknown ids are ignored); hashed ones
        stay findable in the prefix cache until evicted, an import's snapshot once saved."""
        for block_id in self.pins.pop(transfer_id, ()):
            self.gpu.free(block_id, self.now)
        key = self.state_pins.pop(transfer_id, None)
        if key is not None:
            assert self.states is not None
            self.states.unpin(key)

    def snapshot_key(self, block_hashes: list[int], num_blocks: int) -> int | None:
        """The key of the saved snapshot at the deepest block boundary of the first
        `num_blocks` blocks hashed `block_hashes` (a transfer of those blocks carries it), or
        None (no recurrent layers, or no snapshot among them)."""
        if self.states is None:
            return None
        for i in range(min(num_blocks, len(block_hashes)) - 1, -1, -1):
            key = state_key(block_hashes[i])
            if self.states.is_saved(key):
                return key
        return None

    def held_blocks(self) -> Iterator[int]:
        """Every pinned block, once per transfer holding it."""
        for block_ids in self.pins.values():
            yield from block_ids

    def check_invariants(self) -> None:
        """Every held snapshot belongs to a transfer that holds blocks (maybe none)."""
        assert self.state_pins.keys() <= self.pins.keys(), "a snapshot pinned by no transfer"
