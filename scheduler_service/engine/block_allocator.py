"""Physical KV block allocation for one device, with content-hash prefix caching.

A block is either free (in the free queue, or — when it holds a cached prefix — in the
evictor) or in use (ref count > 0). A full block can carry the chained hash of its tokens;
such a block stays findable by hash after its last user frees it, until the evictor hands
it out for something else.
"""

from __future__ import annotations

import heapq
from collections import deque
from enum import Enum


class Device(Enum):
    GPU = "gpu"
    CPU = "cpu"


class NoFreeBlocksError(RuntimeError):
    """The allocator was asked for a block while none is free (a scheduler bug)."""


class LRUEvictor:
    """Free blocks that still hold a cached prefix, in eviction order.

    Least recently used first (the time the block was last freed); among blocks freed at the
    same time, the one with the most hashed tokens (the deepest in its prefix) goes first, so
    shorter, more shareable prefixes survive longer.
    """

    __slots__ = ("_keys", "_heap")

    def __init__(self) -> None:
        self._keys: dict[int, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, int]] = []

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._keys

    def add(self, block_id: int, last_accessed: float, num_hashed_tokens: int) -> None:
        key = (last_accessed, -num_hashed_tokens)
        self._keys[block_id] = key
        heapq.heappush(self._heap, (last_accessed, -num_hashed_tokens, block_id))

    def remove(self, block_id: int) -> None:
        del self._keys[block_id]  # its heap entry is dropped lazily

    def evict(self) -> int:
        heap = self._heap
        while heap:
            last_accessed, neg_tokens, block_id = heapq.heappop(heap)
            if self._keys.get(block_id) == (last_accessed, neg_tokens):
                del self._keys[block_id]
                return block_id
        raise NoFreeBlocksError("no evictable block")

    def block_ids(self) -> set[int]:
        return set(self._keys)


class BlockAllocator:
    """Ref-counted blocks of one device. Block ids are 0 .. num_blocks - 1."""

    __slots__ = (
        "device",
        "num_blocks",
        "enable_caching",
        "ref_counts",
        "block_hashes",
        "num_hashed_tokens",
        "computed",
        "tags",
        "in_use_by_tag",
        "_free",
        "_cached",
        "evictor",
    )

    def __init__(
        self, device: Device, num_blocks: int, enable_caching: bool, num_tags: int = 1
    ) -> None:
        self.device = device
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        self.num_hashed_tokens = [0] * num_blocks
        # Whether a hashed block's K/V have been written by an executed step.
        self.computed = [False] * num_blocks
        # Who took each block in use (the block manager's KV group), and blocks in use per tag.
        self.tags = [0] * num_blocks
        self.in_use_by_tag = [0] * num_tags
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.evictor = LRUEvictor()

    def get_num_free_blocks(self) -> int:
        return len(self._free) + len(self.evictor)

    def lookup(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def allocate(
        self, block_hash: int | None = None, num_hashed_tokens: int = 0, tag: int = 0
    ) -> int:
        """A block holding `block_hash` (a cache hit, shared) or a fresh one; a block that was
        free is counted in use under `tag`."""
        if block_hash is not None and self.enable_caching:
            block_id = self._cached.get(block_hash)
            if block_id is not None:
                if self.ref_counts[block_id] == 0:
                    self.evictor.remove(block_id)
                    self._tag(block_id, tag)
                self.ref_counts[block_id] += 1
                return block_id
        block_id = self._take_free_block()
        self._tag(block_id, tag)
        self.ref_counts[block_id] = 1
        if block_hash is not None and self.enable_caching:
            self._register(block_id, block_hash, num_hashed_tokens)
        return block_id

    def share(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0
        self.ref_counts[block_id] += 1

    def hold(self, block_id: int, tag: int = 0) -> None:
        """One more reference to a block in use or to a cached one waiting in the evictor
        (counted in use under `tag` then)."""
        if self.ref_counts[block_id] == 0:
            self.evictor.remove(block_id)
            self._tag(block_id, tag)
        self.ref_counts[block_id] += 1

    def _tag(self, block_id: int, tag: int) -> None:
        self.tags[block_id] = tag
        self.in_use_by_tag[tag] += 1

    def free(self, block_id: int, now: float) -> None:
        refs = self.ref_counts[block_id] - 1
        assert refs >= 0, f"double free of {self.device.value} block {block_id}"
        self.ref_counts[block_id] = refs
        if refs:
            return
        self.in_use_by_tag[self.tags[block_id]] -= 1
        if self.block_hashes[block_id] is not None:
            self.evictor.add(block_id, now, self.num_hashed_tokens[block_id])
        else:
            self._free.append(block_id)

    def promote(self, block_id: int, block_hash: int, num_hashed_tokens: int) -> bool:
        """Make an in-use block that just became full findable by its hash.

        Left unhashed when another block already holds that hash: the sequence keeps its own
        copy rather than switching blocks under a running step.
        """
        if not self.enable_caching or block_hash in self._cached:
            return False
        assert self.block_hashes[block_id] is None
        self._register(block_id, block_hash, num_hashed_tokens)
        return True

    def _register(self, block_id: int, block_hash: int, num_hashed_tokens: int) -> None:
        self.block_hashes[block_id] = block_hash
        self.num_hashed_tokens[block_id] = num_hashed_tokens
        self.computed[block_id] = False
        self._cached[block_hash] = block_id

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.popleft()
        if not len(self.evictor):
            raise NoFreeBlocksError(f"no free {self.device.value} block")
        block_id = self.evictor.evict()
        old_hash = self.block_hashes[block_id]
        assert old_hash is not None
        del self._cached[old_hash]
        self.block_hashes[block_id] = None
        self.num_hashed_tokens[block_id] = 0
        self.computed[block_id] = False
        return block_id

    def check_invariants(self, expected_refs: list[int]) -> None:
        """`expected_refs[b]` = how many block-table entries point at block b."""
        free = list(self._free)
        assert len(free) == len(set(free)), "block twice in the free queue"
        free_set = set(free)
        evictable = self.evictor.block_ids()
        assert not free_set & evictable, "block both in the free queue and the evictor"
        in_use = 0
        for block_id in range(self.num_blocks):
            refs = self.ref_counts[block_id]
            assert refs == expected_refs[block_id], (
                f"{self.device.value} block {block_id}: ref count {refs}, "
                f"{expected_refs[block_id]} table references"
            )
            is_free = block_id in evictable or block_id in free_set
            assert is_free == (refs == 0), f"{self.device.value} block {block_id} free and used"
            in_use += refs > 0
            if block_id in evictable:
                assert self.block_hashes[block_id] is not None
        assert len(free) + len(evictable) + in_use == self.num_blocks
        counted = [0] * len(self.in_use_by_tag)
        for block_id in range(self.num_blocks):
            counted[self.tags[block_id]] += self.ref_counts[block_id] > 0
        assert counted == self.in_use_by_tag, f"in use by tag {self.in_use_by_tag}, {counted}"
        for block_hash, block_id in self._cached.items():
            assert self.block_hashes[block_id] == block_hash
        assert sum(h is not None for h in self.block_hashes) == len(self._cached)
