"""Prefix-cache hits across KV groups: how blocks and state snapshots are keyed, and the
longest prefix that every group can serve.

Each group's blocks are hashed under their own key (group 0 under the token chain's hash, so
KV transfers between replicas name blocks as before); the state snapshot after a block (a
model with recurrent layers) under a key of its own. A hit is the longest prefix that every
group can serve: all of a full group's blocks, the blocks of a windowed group that the first
computed position's window reads, and with recurrent layers the snapshot at its end (the
sequence starts from a copy of it).

A sequence's hit is found when the block manager gives it its tables and kept until the
scheduler asks how many of its tokens are computed, which counts the prefix-cache queries and
hits; the slot of the snapshot it starts from is kept until the step builder sends it. Other
replicas ask for the longest cached prefix of a prompt that has no tables here (KV moves,
prefix fetches, routing).
"""

from __future__ import annotations

from collections.abc import Set

from llmserve.kv_layout import first_live_block
from scheduler_service.engine.block_allocator import BlockAllocator
from scheduler_service.engine.sequence import Sequence
from scheduler_service.engine.state_slots import StateSlots


def group_key(group: int, block_hash: int) -> int:
    """The key of a block of `group` holding the tokens hashed to `block_hash`."""
    return block_hash if group == 0 else hash((group, block_hash))


def state_key(block_hash: int) -> int:
    """The key of the state snapshot after the tokens hashed to `block_hash`."""
    return hash(("state", block_hash))


def hit_start(seq: Sequence, hit: int, block_size: int) -> int:
    """The first position computed after a hit of `hit` blocks (at least the last token
    is computed, to sample from)."""
    return min(hit * block_size, seq.get_len() - 1)


class PrefixHits:
    """The longest prefix every KV group serves from the device's prefix cache: a new
    sequence's (kept until `take`, its snapshot until `pop_state_source`), or a prompt's that
    another replica asks about."""

    def __init__(
        self,
        gpu: BlockAllocator,
        block_size: int,
        windows: tuple[int | None, ...],
        enable_caching: bool,
        states: StateSlots | None,
    ) -> None:
        self.gpu = gpu
        self.block_size = block_size
        self.windows = windows
        self._windowed = [g for g, w in enumerate(windows) if w is not None]
        self._full = [g for g, w in enumerate(windows) if w is None]
        self.enable_caching = enable_caching
        self.states = states
        # A new sequence's hit, in blocks, until `take`.
        self._found: dict[int, int] = {}
        # A new sequence's snapshot slot to start from, with the tokens it holds, until
        # `pop_state_source`.
        self._sources: dict[int, tuple[int, int]] = {}  # seq id -> (slot, tokens)
        self.queries = 0  # full prompt blocks looked up
        self.hits = 0  # of those, found computed in the cache

    def _live_index(self, group: int, position: int) -> int:
        """The first table index windowed `group` keeps while the next computed position is
        `position` (`llmserve.kv_layout.first_live_block`)."""
        window = self.windows[group]
        assert window is not None
        return first_live_block(position, window, self.block_size)

    def admit(self, seq: Sequence, full_tables: list[list[int]]) -> int:
        """The hit of a sequence just given its full groups' tables (in group order), in
        blocks, kept until `take`; 0 without prefix caching. With recurrent layers its
        snapshot is marked used and kept until `pop_state_source`."""
        hit = self._find(seq, full_tables) if self.enable_caching else 0
        if self.states is not None and hit:
            source = self.states.lookup(state_key(seq.block_hash(hit - 1)))
            assert source is not None, "a hit without its snapshot"
            self._sources[seq.seq_id] = (source, hit * self.block_size)
        self._found[seq.seq_id] = hit
        return hit

    def _find(self, seq: Sequence, full_tables: list[list[int]]) -> int:
        """Blocks of the longest prefix of `seq` whose K/V every group holds computed (and,
        with recurrent layers, whose state after its last block a snapshot holds)."""
        gpu = self.gpu
        hashes = gpu.block_hashes
        computed = gpu.computed
        hit = seq.get_len() // self.block_size
        for table in full_tables:
            cached = 0
            while cached < hit and hashes[b := table[cached]] is not None and computed[b]:
                cached += 1
            hit = cached
        states = self.states
        if states is not None:  # a hit starts from its snapshot: exactly at the boundary
            hit = min(hit, (seq.get_len() - 1) // self.block_size)
        while hit > 0:
            served = states is None or states.is_saved(state_key(seq.block_hash(hit - 1)))
            start = hit_start(seq, hit, self.block_size)
            for g in self._windowed if served else ():
                for i in range(self._live_index(g, start), hit):
                    block_id = gpu.lookup(group_key(g, seq.block_hash(i)))
                    if block_id is None or not computed[block_id]:
                        served = False
                        break
                if not served:
                    break
            if served:
                return hit
            hit -= 1
        return 0

    def take(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V its hit already holds in every group.

        Always leaves at least the last token to compute, so the step has logits to sample.
        Counts one prefix-cache query per full block of the sequence.
        """
        hit = self._found.pop(seq.seq_id, 0)
        if not self.enable_caching:
            return 0
        self.queries += seq.get_len() // self.block_size
        self.hits += hit
        return hit_start(seq, hit, self.block_size)

    def pop_state_source(self, seq: Sequence) -> int | None:
        """The snapshot slot a new sequence starts from (its hit), once; None when it
        computes from its first token (no hit, or one it does not use: prompt logprobs)."""
        source = self._sources.pop(seq.seq_id, None)
        if source is None or seq.num_computed_tokens == 0:
            return None
        assert source[1] == seq.num_computed_tokens, "a hit used at another boundary"
        return source[0]

    def forget(self, seq_id: int) -> None:
        """Drop a freed sequence's hit and snapshot not taken."""
        self._found.pop(seq_id, None)
        self._sources.pop(seq_id, None)

    def cached_prefix(
        self, block_hashes: list[int], num_tokens: int
    ) -> tuple[int, list[tuple[int, int, int]]]:
        """For a prompt of `num_tokens` tokens whose full blocks hash to `block_hashes`: the
        blocks of the longest prefix hit every group serves from this cache, and the (block id,
        key, hashed tokens) of the blocks that hit reads, in table order across groups."""
        if not self.enable_caching:
            return 0, []
        gpu = self.gpu
        bs = self.block_size

        def cached(g: int, i: int) -> int | None:
            block_id = gpu.lookup(group_key(g, block_hashes[i]))
            return block_id if block_id is not None and gpu.computed[block_id] else None

        hit = len(block_hashes)
        for g in self._full:
            count = 0
            while count < hit and cached(g, count) is not None:
                count += 1
            hit = count
        while hit > 0:
            start = min(hit * bs, num_tokens - 1)
            firsts = {g: self._live_index(g, start) for g in self._windowed}
            if all(cached(g, i) is not None for g in self._windowed for i in range(firsts[g], hit)):
                break
            hit -= 1
        found: list[tuple[int, int, int, int]] = []
        for g in range(len(self.windows)):
            first = (
                0 if self.windows[g] is None else self._live_index(g, min(hit * bs, num_tokens - 1))
            )
            for i in range(first, hit):
                block_id = cached(g, i)
                assert block_id is not None
                found.append((i, block_id, group_key(g, block_hashes[i]), (i + 1) * bs))
        found.sort(key=lambda f: f[0])
        return hit, [(block_id, key, tokens) for _, block_id, key, tokens in found]

    def check_invariants(self, seq_ids: Set[int]) -> None:
        """Every hit and snapshot not taken belongs to a sequence with tables (`seq_ids`)."""
        assert self._found.keys() <= seq_ids, "a prefix hit kept for a freed sequence"
        assert self._sources.keys() <= seq_ids, "a snapshot kept for a freed sequence"
