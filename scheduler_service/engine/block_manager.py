"""Block tables: which physical blocks hold each sequence's KV cache, on which device."""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from scheduler_service.engine.block_allocator import BlockAllocator, Device
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(Enum):
    OK = "ok"  # can be allocated now
    LATER = "later"  # not enough free blocks now; wait for some to free
    NEVER = "never"  # larger than the whole cache (minus the watermark)


class BlockSpaceManager:
    """Maps sequences to device (GPU) and host (CPU swap) blocks.

    Besides the tables it remembers, per sequence, the first table index that changed in
    place (copy-on-write, swap) since `pop_dirty_from` was last called, so the engine can send
    workers a table diff without comparing whole tables.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_caching = enable_caching
        self.gpu = BlockAllocator(Device.GPU, num_gpu_blocks, enable_caching)
        # Swap space holds exact copies of device blocks; it is not a prefix cache.
        self.cpu = BlockAllocator(Device.CPU, num_cpu_blocks, enable_caching=False)
        self._tables: dict[int, list[int]] = {}
        self._on_cpu: set[int] = set()
        self._dirty_from: dict[int, int] = {}
        # Leading blocks of each table already marked computed.
        self._num_marked: dict[int, int] = {}
        # Logical clock for the evictor's LRU order; the scheduler advances it every step.
        self.now = 0.0
        self.prefix_cache_queries = 0  # full prompt blocks looked up
        self.prefix_cache_hits = 0  # of those, found computed in the cache
        # Device blocks held by KV transfers between workers, by transfer id, besides the
        # tables (`scheduler_service.fleet.kv_mover`).
        self.pins: dict[int, list[int]] = {}

    # -- allocation of waiting sequences ----------------------------------------------------

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        required = sum(s.get_num_logical_blocks() for s in seqs)
        if self.enable_caching and len(seqs) > 1:
            # Siblings share the prompt's full blocks (`allocate` finds them by hash).
            required -= (len(seqs) - 1) * (seqs[0].num_prompt_tokens // self.block_size)
        if self.num_total_gpu_blocks - required < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu.get_num_free_blocks() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give every waiting sequence a table covering all its tokens (sharing cached blocks)."""
        bs = self.block_size
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            assert seq.seq_id not in self._tables, f"{seq} already has blocks"
            num_tokens = seq.get_len()
            num_full = num_tokens // bs
            table: list[int] = []
            for i in range(seq.get_num_logical_blocks()):
                if self.enable_caching and i < num_full:
                    table.append(self.gpu.allocate(seq.block_hash(i), (i + 1) * bs))
                else:
                    table.append(self.gpu.allocate())
            self._tables[seq.seq_id] = table
            self._num_marked[seq.seq_id] = 0

    def get_num_computed_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V a prefix-cache hit already holds.

        Always leaves at least the last token to compute, so the step has logits to sample.
        Counts one prefix-cache query per full block of the sequence.
        """
        if not self.enable_caching:
            return 0
        table = self._tables[seq.seq_id]
        num_full = seq.get_len() // self.block_size
        self.prefix_cache_queries += num_full
        hashes = self.gpu.block_hashes
        computed = self.gpu.computed
        num_cached = 0
        while num_cached < num_full:
            block_id = table[num_cached]
            if hashes[block_id] is None or not computed[block_id]:
                break
            num_cached += 1
        self.prefix_cache_hits += num_cached
        return min(num_cached * self.block_size, seq.get_len() - 1)

    # -- running sequences ----------------------------------------------------------------

    def _must_copy(self, block_id: int) -> bool:
        # A shared block gets written: copy it first, unless it is a hashed full block, whose
        # content is fixed by its hash (a prefix-cache hit rewriting the same K/V).
        return self.gpu.ref_counts[block_id] > 1 and self.gpu.block_hashes[block_id] is None

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether the free device blocks cover every running sequence's new blocks, and a
        copy of each shared block about to be written."""
        bs = self.block_size
        tables = self._tables
        ref_counts = self.gpu.ref_counts
        hashes = self.gpu.block_hashes
        needed = 0
        for seq in seq_group.seqs:
            if seq.status == SequenceStatus.RUNNING:
                table = tables[seq.seq_id]
                num_blocks = len(table)
                needed += -(-len(seq.token_ids) // bs) - num_blocks
                write_index = seq.num_computed_tokens // bs
                if write_index < num_blocks:
                    block_id = table[write_index]
                    if ref_counts[block_id] > 1 and hashes[block_id] is None:  # _must_copy
                        needed += 1
        # The usual decode writes into room its last block already has.
        return needed <= 0 or needed <= self.gpu.get_num_free_blocks()

    def append_slots(
        self, seq: Sequence, copies: list[tuple[int, int]] | None = None
    ) -> list[tuple[int, int]]:
        """Extend `seq`'s table to cover all its tokens; copy-on-write the block about to be
        written if it is shared. Adds the (src, dst) copies to `copies` (a new list if None)
        and returns it."""
        if copies is None:
            copies = []
        bs = self.block_size
        gpu = self.gpu
        seq_id = seq.seq_id
        table = self._tables[seq_id]
        num_tokens = len(seq.token_ids)
        old_len = len(table)
        if num_tokens > old_len * bs:
            for _ in range(-(-num_tokens // bs) - old_len):
                table.append(gpu.allocate())
        write_index = seq.num_computed_tokens // bs
        if write_index < old_len and self._must_copy(table[write_index]):
            src = table[write_index]
            dst = gpu.allocate()
            table[write_index] = dst
            gpu.free(src, self.now)
            copies.append((src, dst))
            self._mark_dirty(seq_id, write_index)
        if self.enable_caching and num_tokens // bs > write_index:
            self._promote_full(seq, table, write_index)
        return copies

    def _promote_full(self, seq: Sequence, table: list[int], first: int) -> None:
        """Blocks from table index `first` on that `seq`'s tokens fill become findable by
        hash."""
        bs = self.block_size
        gpu = self.gpu
        hashes = gpu.block_hashes
        ref_counts = gpu.ref_counts
        for i in range(first, len(seq.token_ids) // bs):
            block_id = table[i]
            if hashes[block_id] is None and ref_counts[block_id] == 1:
                gpu.promote(block_id, seq.block_hash(i), (i + 1) * bs)

    # -- asynchronous scheduling ----------------------------------------------------------

    def can_reserve_lookahead(self, seqs: list[Sequence], lookahead: int | list[int] = 1) -> bool:
        """Whether each of `seqs` can get slots for `lookahead` tokens (or lookahead[i] for
        seqs[i]) past the ones it knows (the token it is sampling now, or drafts) without a
        copy-on-write, from the free device blocks."""
        bs = self.block_size
        tables = self._tables
        needed = 0
        for i, seq in enumerate(seqs):
            table = tables[seq.seq_id]
            position = len(seq.token_ids)
            if position // bs < len(table) and self._must_copy(table[position // bs]):
                return False
            ahead = lookahead if isinstance(lookahead, int) else lookahead[i]
            needed += max(0, (position + ahead - 1) // bs + 1 - len(table))
        return needed <= self.gpu.get_num_free_blocks()

    def reserve_lookahead(self, seq: Sequence, lookahead: int = 1) -> None:
        """Extend `seq`'s table to hold `lookahead` tokens more than it knows (checked by
        `can_reserve_lookahead`). `append_slots`, once the tokens are appended, finds the
        room and only marks full blocks for the prefix cache."""
        table = self._tables[seq.seq_id]
        while len(table) * self.block_size < len(seq.token_ids) + lookahead:
            table.append(self.gpu.allocate())

    def commit_lookahead(self, seq: Sequence, first_written: int, ahead: int = 0) -> None:
        """After tokens from position `first_written` on were appended to `seq` into its
        reserved slots (kept drafts): blocks past its tokens and `ahead` slots more (what the
        step in flight after it reserved) go back to the free pool, the blocks they filled
        become findable by hash, and the computed ones count as hits."""
        table = self._tables[seq.seq_id]
        needed = -(-(len(seq.token_ids) + ahead) // self.block_size)
        if len(table) > needed:
            while len(table) > needed:
                self.gpu.free(table.pop(), self.now)
            self._mark_dirty(seq.seq_id, needed)  # the worker's table shrinks too
        if self.enable_caching:
            self._promote_full(seq, table, first_written // self.block_size)
        self.mark_computed(seq)

    def _mark_dirty(self, seq_id: int, index: int) -> None:
        old = self._dirty_from.get(seq_id)
        if old is None or index < old:
            self._dirty_from[seq_id] = index

    def pop_dirty_from(self, seq_id: int) -> int | None:
        """First table index rewritten in place since the last call (None: only appends)."""
        return self._dirty_from.pop(seq_id, None)

    def has_dirty_tables(self) -> bool:
        """Whether any table was rewritten in place since its `pop_dirty_from`."""
        return bool(self._dirty_from)

    def mark_computed(self, seq: Sequence) -> None:
        """Record that the K/V of `seq`'s computed tokens exist, so its full hashed blocks
        count as prefix-cache hits from now on."""
        seq_id = seq.seq_id
        start = self._num_marked.get(seq_id)
        if start is None:
            return
        end = seq.num_computed_tokens // self.block_size
        if end <= start or seq_id in self._on_cpu:
            return
        table = self._tables[seq_id]
        computed = self.gpu.computed
        hashes = self.gpu.block_hashes
        for i in range(start, end):
            if hashes[table[i]] is not None:
                computed[table[i]] = True
        self._num_marked[seq_id] = end

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """`child_seq` shares every block of `parent_seq`."""
        table = self._tables[parent_seq.seq_id]
        allocator = self.cpu if parent_seq.seq_id in self._on_cpu else self.gpu
        for block_id in table:
            allocator.share(block_id)
        child_id = child_seq.seq_id
        self._tables[child_id] = list(table)
        if parent_seq.seq_id in self._on_cpu:
            self._on_cpu.add(child_id)
        self._num_marked[child_id] = self._num_marked[parent_seq.seq_id]
        dirty = self._dirty_from.get(parent_seq.seq_id)
        if dirty is not None:
            self._dirty_from[child_id] = dirty

    # -- swapping ---------------------------------------------------------------------------

    def _unique_blocks(self, seqs: list[Sequence]) -> int:
        return len({b for s in seqs for b in self._tables[s.seq_id]})

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self._unique_blocks(seqs) <= self.cpu.get_num_free_blocks()

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        # One more block per sequence for the token it appends when it resumes, or as many
        # as the tokens appended while it was out need (a grammar's forced tokens).
        bs = self.block_size
        tables = self._tables
        required = self._unique_blocks(seqs) + sum(
            max(1, -(-seq.get_len() // bs) - len(tables[seq.seq_id])) for seq in seqs
        )
        return self.gpu.get_num_free_blocks() - required >= self.watermark_blocks

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the running sequences' blocks to host blocks. Returns {gpu block: cpu block};
        a block shared inside the group is copied once and stays shared."""
        mapping: dict[int, int] = {}
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            self._tables[seq.seq_id] = self._move(seq.seq_id, self.gpu, self.cpu, mapping)
            self._on_cpu.add(seq.seq_id)
        return mapping

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the swapped sequences' blocks back to device blocks. Returns {cpu: gpu}."""
        mapping: dict[int, int] = {}
        for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
            seq_id = seq.seq_id
            self._tables[seq_id] = self._move(seq_id, self.cpu, self.gpu, mapping)
            self._on_cpu.discard(seq_id)
            self._dirty_from[seq_id] = 0
            # Swapped-in blocks carry no hash; only blocks filled from now on get one.
            self._num_marked[seq_id] = seq.num_computed_tokens // self.block_size
        return mapping

    def _move(
        self, seq_id: int, src: BlockAllocator, dst: BlockAllocator, mapping: dict[int, int]
    ) -> list[int]:
        new_table: list[int] = []
        for block_id in self._tables[seq_id]:
            moved = mapping.get(block_id)
            if moved is None:
                moved = dst.allocate()
                mapping[block_id] = moved
            else:
                dst.share(moved)
            new_table.append(moved)
            src.free(block_id, self.now)
        return new_table

    # -- KV transfers -----------------------------------------------------------------------

    def pin(self, transfer_id: int, block_ids: list[int]) -> None:
        """Hold device blocks (in use, or cached and free) for an export: they stay allocated,
        unwritten by new sequences, until `unpin`."""
        for block_id in block_ids:
            self.gpu.hold(block_id)
        self.pins[transfer_id] = list(block_ids)

    def allocate_pinned(self, transfer_id: int, hashed: list[tuple[int, int]]) -> list[int]:
        """Device blocks for an import, one per (block hash, hashed tokens), registered under
        those hashes but not computed (`mark_imported` makes them prefix-cache hits)."""
        block_ids = [self.gpu.allocate(block_hash, tokens) for block_hash, tokens in hashed]
        self.pins[transfer_id] = block_ids
        return block_ids

    def mark_imported(self, transfer_id: int) -> None:
        """The import's K/V have arrived: its blocks count as computed."""
        for block_id in self.pins[transfer_id]:
            if self.gpu.block_hashes[block_id] is not None:
                self.gpu.computed[block_id] = True

    def unpin(self, transfer_id: int) -> None:
        """Let go of a transfer's blocks (unknown ids are ignored); hashed ones stay findable
        in the prefix cache until evicted."""
        for block_id in self.pins.pop(transfer_id, ()):
            self.gpu.free(block_id, self.now)

    # -- freeing and queries ----------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        seq_id = seq.seq_id
        table = self._tables.pop(seq_id, None)
        if table is None:
            return
        allocator = self.cpu if seq_id in self._on_cpu else self.gpu
        self._on_cpu.discard(seq_id)
        self._dirty_from.pop(seq_id, None)
        self._num_marked.pop(seq_id, None)
        # Free the tail first: at equal LRU time the evictor prefers deeper blocks anyway.
        for block_id in reversed(table):
            allocator.free(block_id, self.now)

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self._tables[seq.seq_id]

    @property
    def block_tables(self) -> Mapping[int, list[int]]:
        """Every table by seq id, for readers that visit many sequences (do not modify)."""
        return self._tables

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.get_num_free_blocks()

    def gpu_usage(self) -> float:
        return 1.0 - self.gpu.get_num_free_blocks() / max(self.num_total_gpu_blocks, 1)

    def cpu_usage(self) -> float:
        return 1.0 - self.cpu.get_num_free_blocks() / max(self.num_total_cpu_blocks, 1)

    def check_invariants(self) -> None:
        """Free + in use == total on each device; ref counts equal table references; no block
        both free and referenced; tables cover their sequences' tokens."""
        gpu_refs = [0] * self.num_total_gpu_blocks
        cpu_refs = [0] * self.num_total_cpu_blocks
        for seq_id, table in self._tables.items():
            refs = cpu_refs if seq_id in self._on_cpu else gpu_refs
            for block_id in table:
                refs[block_id] += 1
        for block_ids in self.pins.values():
            for block_id in block_ids:
                gpu_refs[block_id] += 1
        assert self._on_cpu <= self._tables.keys()
        self.gpu.check_invariants(gpu_refs)
        self.cpu.check_invariants(cpu_refs)
