"""Block tables: which physical blocks hold each sequence's KV cache, on which device.

A model's layers are laid out as KV groups (`llmserve.kv_layout`): each group has its own
block table per sequence, all drawing from one pool of device blocks. Group 0's tables are
`block_tables`; the others' are sent beside them (`StepInput`'s group tables). A windowed
group keeps only the blocks its window can still read: entries before the window hold
`NULL_BLOCK` (block 0, reserved) and the blocks they held went back to the pool, or to the
evictor when they carry a prefix hash. A windowed group also grows lazily: it holds blocks
for the positions a step computes, not for the whole prompt at admission.

Prefix caching hashes each group's blocks under its own key; what a hit is, and the hit each
new sequence starts from, is `PrefixHits`' (`scheduler_service.engine.prefix_hits`).

A model with recurrent layers also gives each sequence a state slot (`state_slots`) beside
its tables, swapped to a host slot with the blocks. With prefix caching, the state after a
sequence's prefix is kept at block boundaries (snapshots, keyed by the block's hash): where a
step of it ends on one (a prefill chunk; a decode without drafts, into a free slot only), and
the scheduler ends a chunk at the prompt's last boundary (`state_chunk`). A hit then also
needs the snapshot at its end, and the sequence starts from a copy of it.

KV transfers between replicas hold blocks and snapshots beside the tables (`transfers`, a
`scheduler_service.engine.kv_transfers.TransferPins`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from llmserve.kv_layout import NULL_BLOCK, first_live_block, window_span
from scheduler_service.engine.block_allocator import BlockAllocator, Device
from scheduler_service.engine.kv_transfers import TransferPins
from scheduler_service.engine.prefix_hits import PrefixHits, group_key, hit_start, state_key
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.engine.state_slots import StateSlots, slots_needed


class AllocStatus(Enum):
    OK = "ok"  # can be allocated now
    LATER = "later"  # not enough free blocks now; wait for some to free
    NEVER = "never"  # larger than the whole cache (minus the watermark)


class BlockSpaceManager:
    """Maps sequences to device (GPU) and host (CPU swap) blocks, one table per KV group.

    Besides the tables it remembers, per sequence and group, the first table index that
    changed in place (copy-on-write, swap, a refilled window) since `pop_dirty_from` was last
    called, so the engine can send workers a table diff without comparing whole tables.

    It owns the parts that share its device allocator: the recurrent layers' state slots
    (`states`), new sequences' prefix hits (`prefix`) and the KV transfers' pins
    (`transfers`).
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_caching: bool = True,
        windows: tuple[int | None, ...] = (None,),
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_caching = enable_caching
        # Per KV group, its sliding window (None: full attention).
        self.windows = windows
        self.num_groups = len(windows)
        self._windowed = [g for g, w in enumerate(windows) if w is not None]
        self._full = [g for g, w in enumerate(windows) if w is None]
        # Blocks in use are tagged with the group that took them; the last tag is the
        # transfers' (imports pinned before any sequence holds them) and the null block's.
        self.transfer_tag = len(windows)
        tags = len(windows) + 1
        self.gpu = BlockAllocator(Device.GPU, num_gpu_blocks, enable_caching, tags)
        # Swap space holds exact copies of device blocks; it is not a prefix cache.
        self.cpu = BlockAllocator(Device.CPU, num_cpu_blocks, enable_caching=False, num_tags=tags)
        # Blocks no sequence can have: the null block, held for good when a group has a window.
        self.num_reserved = 0
        if self._windowed:
            assert self.gpu.allocate(tag=self.transfer_tag) == NULL_BLOCK
            self.num_reserved = 1
        # Per group: seq id -> table. Group 0's is `_tables`.
        self._group_tables: list[dict[int, list[int]]] = [{} for _ in windows]
        self._tables = self._group_tables[0]
        # Per group: seq id -> the first live index of a windowed table (entries before it
        # are NULL_BLOCK); 0 for full groups, which keep no entry here.
        self._live: list[dict[int, int]] = [{} for _ in windows]
        self._on_cpu: set[int] = set()
        # Per group: seq id -> first table index rewritten in place.
        self._dirty: list[dict[int, int]] = [{} for _ in windows]
        # Leading blocks of each table already marked computed (the same for every group).
        self._num_marked: dict[int, int] = {}
        # Logical clock for the evictor's LRU order; the scheduler advances it every step.
        self._now = 0.0
        # The recurrent layers' state slots (None: the model has none).
        self.states = StateSlots(num_state_slots) if num_state_slots else None
        # Blocks and snapshots that KV transfers between replicas hold, besides the tables.
        self.transfers = TransferPins(self.gpu, self.states, self.transfer_tag)
        # New sequences' prefix hits, and the prefix-cache queries and hits counted.
        self.prefix = PrefixHits(self.gpu, block_size, windows, enable_caching, self.states)
        # Per sequence: the snapshots its steps in flight write, (tokens, key).
        self._pending_saves: dict[int, list[tuple[int, int]]] = {}

    @property
    def now(self) -> float:
        return self._now

    @now.setter
    def now(self, value: float) -> None:
        self._now = value
        self.transfers.now = value
        if self.states is not None:
            self.states.now = value

    @property
    def is_hybrid(self) -> bool:
        """Whether some group keeps less than every token's K/V (more than one table, or a
        window)."""
        return self.num_groups > 1 or bool(self._windowed)

    # -- allocation of waiting sequences ----------------------------------------------------

    def _window_span(self, group: int, chunk: int) -> int:
        """The most blocks a windowed group holds for a step computing `chunk` tokens."""
        window = self.windows[group]
        assert window is not None
        return window_span(window, self.block_size, max(chunk, 1))

    def required_blocks(self, seq_group: SequenceGroup, chunk: int | None = None) -> int:
        """Device blocks the waiting sequences of `seq_group` take at admission, computing
        `chunk` tokens in their first step (None: all)."""
        return self._required(seq_group.get_seqs(SequenceStatus.WAITING), chunk)

    def _required(self, seqs: list[Sequence], chunk: int | None) -> int:
        bs = self.block_size
        num_blocks = seqs[0].get_num_logical_blocks()
        shared = 0
        if self.enable_caching and len(seqs) > 1:
            # Siblings share the prompt's full blocks (`allocate` finds them by hash).
            shared = (len(seqs) - 1) * (seqs[0].num_prompt_tokens // bs)
        required = len(self._full) * (len(seqs) * num_blocks - shared)
        if self._windowed:
            n = seqs[0].get_len()
            step = min(n, chunk if chunk is not None else n)
            for g in self._windowed:
                # Siblings' windows are their own (only hits are shared).
                required += len(seqs) * min(num_blocks, self._window_span(g, step))
        return required

    def can_allocate(self, seq_group: SequenceGroup, chunk: int | None = None) -> AllocStatus:
        """Whether the waiting sequences of `seq_group` fit, computing `chunk` tokens in their
        first step (None: the whole prompt). NEVER when even one block's step would not fit
        the empty cache."""
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        smallest = self._required(seqs, self.block_size) if self._windowed else None
        required = self._required(seqs, chunk)
        usable = self.num_total_gpu_blocks - self.num_reserved
        if usable - (smallest if smallest is not None else required) < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.states is not None:
            slots = slots_needed(seq_group)
            if slots > self.states.num_slots:
                return AllocStatus.NEVER
            if slots > self.states.num_free():
                return AllocStatus.LATER
        if self.gpu.get_num_free_blocks() - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def never_reason(self, seq_group: SequenceGroup) -> str:
        """Why `can_allocate` says NEVER for the group: what it needs beyond the whole cache."""
        if self.states is not None and (slots := slots_needed(seq_group)) > self.states.num_slots:
            return (
                f"the request needs {slots} state slots at once (n, best_of, beam width), "
                f"more than the worker has ({self.states.num_slots})"
            )
        return (
            f"prompt needs {self.required_blocks(seq_group, self.block_size)} KV blocks, "
            f"more than the cache can ever hold ({self.num_total_gpu_blocks} blocks, "
            f"watermark {self.watermark_blocks})"
        )

    def max_chunk(self, seqs: list[Sequence], chunk: int) -> int:
        """The largest first step, up to `chunk` tokens, whose windowed blocks fit the free
        ones (what `can_allocate` with that chunk would call OK); `chunk` itself without a
        windowed group. At least one block's worth of tokens when `can_allocate` said OK for
        it."""
        if not self._windowed:
            return chunk
        free = self.gpu.get_num_free_blocks() - self.watermark_blocks
        bs = self.block_size
        while chunk > bs and self._required(seqs, chunk) > free:
            chunk = (chunk - 1) // bs * bs
        return chunk

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give every waiting sequence its tables: a full group's covers all its tokens
        (sharing cached blocks), a windowed group's the blocks of the longest prefix hit
        (`get_num_computed_tokens`) that its window reads; `append_slots` adds the rest. With
        recurrent layers, the request reserves its state slots and each sequence takes one
        (a hit's snapshot is copied into it: `pop_state_source`)."""
        bs = self.block_size
        states = self.states
        if states is not None:
            states.reserve(seq_group.request_id, slots_needed(seq_group))
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            seq_id = seq.seq_id
            assert seq_id not in self._tables, f"{seq} already has blocks"
            num_full = seq.get_len() // bs
            num_blocks = seq.get_num_logical_blocks()
            for g in self._full:
                table: list[int] = []
                for i in range(num_blocks):
                    if self.enable_caching and i < num_full:
                        key = group_key(g, seq.block_hash(i))
                        table.append(self.gpu.allocate(key, (i + 1) * bs, g))
                    else:
                        table.append(self.gpu.allocate(tag=g))
                self._group_tables[g][seq_id] = table
            self._num_marked[seq_id] = 0
            if states is not None:
                states.take(seq_group.request_id, seq_id)
            hit = self.prefix.admit(seq, [self._group_tables[g][seq_id] for g in self._full])
            start = hit_start(seq, hit, bs)
            for g in self._windowed:
                first = self._live_index(g, start)
                table = [NULL_BLOCK] * first
                for i in range(first, hit):
                    key = group_key(g, seq.block_hash(i))
                    table.append(self.gpu.allocate(key, (i + 1) * bs, g))
                self._group_tables[g][seq_id] = table
                self._live[g][seq_id] = first

    def _live_index(self, group: int, position: int) -> int:
        """The first table index windowed `group` keeps while the next computed position is
        `position` (`llmserve.kv_layout.first_live_block`)."""
        window = self.windows[group]
        assert window is not None
        return first_live_block(position, window, self.block_size)

    def get_num_computed_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V a prefix-cache hit already holds in every group.

        Always leaves at least the last token to compute, so the step has logits to sample.
        Counts one prefix-cache query per full block of the sequence (`PrefixHits.take`).
        """
        return self.prefix.take(seq)

    # -- running sequences ----------------------------------------------------------------

    def _must_copy(self, block_id: int) -> bool:
        # A shared block gets written: copy it first, unless it is a hashed full block, whose
        # content is fixed by its hash (a prefix-cache hit rewriting the same K/V).
        return self.gpu.ref_counts[block_id] > 1 and self.gpu.block_hashes[block_id] is None

    def _window_end(self, seq: Sequence, chunk: int | None) -> int:
        """Table length a windowed group needs for the step: through the step's tokens."""
        end = len(seq.token_ids)
        if chunk is not None:
            end = min(end, seq.num_computed_tokens + chunk)
        return -(-end // self.block_size)

    def can_append_slots(self, seq_group: SequenceGroup, chunk: int | None = None) -> bool:
        """Whether the free device blocks cover every running sequence's new blocks, and a
        copy of each shared block about to be written (computing `chunk` tokens; None: all
        its known tokens)."""
        bs = self.block_size
        ref_counts = self.gpu.ref_counts
        hashes = self.gpu.block_hashes
        needed = 0
        for seq in seq_group.seqs:
            if seq.status != SequenceStatus.RUNNING:
                continue
            seq_id = seq.seq_id
            write_index = seq.num_computed_tokens // bs
            for g in range(self.num_groups):
                table = self._group_tables[g][seq_id]
                num_blocks = len(table)
                if self.windows[g] is None:
                    needed += max(0, -(-len(seq.token_ids) // bs) - num_blocks)
                else:
                    needed += max(0, self._window_end(seq, chunk) - num_blocks)
                    first = self._live_index(g, seq.num_computed_tokens)
                    needed += max(0, self._live[g][seq_id] - first)  # refilled window
                if write_index < num_blocks:
                    block_id = table[write_index]
                    if ref_counts[block_id] > 1 and hashes[block_id] is None:  # _must_copy
                        needed += 1
        # The usual decode writes into room its last block already has.
        return needed <= 0 or needed <= self.gpu.get_num_free_blocks()

    def state_chunk(self, seq: Sequence, chunk: int) -> int:
        """`chunk`, or less so that it ends at the last block boundary of the prompt: the
        state there is kept for prefix hits (recurrent layers with prefix caching only)."""
        if self.states is None or not self.enable_caching:
            return chunk
        start = seq.num_computed_tokens
        boundary = seq.num_prompt_tokens // self.block_size * self.block_size
        return boundary - start if start < boundary < start + chunk else chunk

    def save_state(self, seq: Sequence, chunk: int) -> tuple[int, int] | None:
        """When computing `chunk` tokens of `seq` (no drafts after them) ends on a block
        boundary: a new snapshot of its state there, as (its slot, the snapshot's slot) for
        the worker to copy after the step; None otherwise (or when one is kept already)."""
        states = self.states
        end = seq.num_computed_tokens + chunk
        if (
            states is None
            or not self.enable_caching
            or end % self.block_size
            or not 0 < end <= seq.get_len()
        ):
            return None
        key = state_key(seq.block_hash(end // self.block_size - 1))
        # Past the prompt (a decode) only into a free slot: a prompt's snapshots, which
        # other requests share, are not evicted for one sequence's own.
        slot = states.save(key, evict=end <= seq.num_prompt_tokens)
        if slot is None:
            return None
        self._pending_saves.setdefault(seq.seq_id, []).append((end, key))
        return states.slot_of(seq.seq_id), slot

    def pop_state_source(self, seq: Sequence) -> int | None:
        """The snapshot slot a new sequence starts from (its prefix hit), once; None when it
        computes from its first token (no hit, or one it does not use: prompt logprobs)."""
        return self.prefix.pop_state_source(seq)

    def max_append_chunk(self, seq_group: SequenceGroup, chunk: int) -> int:
        """The largest next chunk of the group's running prefill, up to `chunk` tokens and in
        whole blocks below it, that `can_append_slots` allows; 0 when none does. Only a
        windowed group's needs shrink with the chunk (a full group holds every known token's
        blocks already)."""
        if self.can_append_slots(seq_group, chunk):
            return chunk
        if not self._windowed:
            return 0
        bs = self.block_size
        while chunk > bs:
            chunk = (chunk - 1) // bs * bs
            if self.can_append_slots(seq_group, chunk):
                return chunk
        return 0

    def append_slots(
        self,
        seq: Sequence,
        copies: list[tuple[int, int]] | None = None,
        chunk: int | None = None,
    ) -> list[tuple[int, int]]:
        """Extend `seq`'s tables to cover the tokens it computes next (`chunk`; None: all its
        known tokens); copy-on-write the block about to be written if it is shared. Adds the
        (src, dst) copies to `copies` (a new list if None) and returns it."""
        if copies is None:
            copies = []
        bs = self.block_size
        gpu = self.gpu
        seq_id = seq.seq_id
        num_tokens = len(seq.token_ids)
        write_index = seq.num_computed_tokens // bs
        for g in range(self.num_groups):
            table = self._group_tables[g][seq_id]
            if self.windows[g] is None:
                target = -(-num_tokens // bs)
            else:
                self._slide(g, seq)
                target = self._window_end(seq, chunk)
            old_len = len(table)
            for _ in range(target - old_len):
                table.append(gpu.allocate(tag=g))
            if write_index < old_len and self._must_copy(table[write_index]):
                src = table[write_index]
                dst = gpu.allocate(tag=g)
                table[write_index] = dst
                gpu.free(src, self._now)
                copies.append((src, dst))
                self._mark_dirty(g, seq_id, write_index)
            if self.enable_caching and num_tokens // bs > write_index:
                self._promote_full(g, seq, table, write_index)
        return copies

    def _slide(self, group: int, seq: Sequence) -> None:
        """Bring windowed `group`'s table to the window of `seq`'s next computed position:
        free the blocks before it, or give fresh blocks to NULL entries inside it (a sequence
        computing from before its prefix hit)."""
        seq_id = seq.seq_id
        first = self._live_index(group, seq.num_computed_tokens)
        live = self._live[group][seq_id]
        if first == live:
            return
        table = self._group_tables[group][seq_id]
        if first > live:
            on_cpu = seq_id in self._on_cpu
            allocator = self.cpu if on_cpu else self.gpu
            for i in range(live, min(first, len(table))):
                allocator.free(table[i], self._now)
                table[i] = NULL_BLOCK
        else:
            # Only a sequence computing from its first token (a hit left unused) reads no
            # position of the refilled blocks before writing it.
            assert seq.num_computed_tokens == 0, f"{seq}: window refilled mid-sequence"
            for i in range(first, min(live, len(table))):
                table[i] = self.gpu.allocate(tag=group)
            self._mark_dirty(group, seq_id, first)
        self._live[group][seq_id] = first

    def _promote_full(self, group: int, seq: Sequence, table: list[int], first: int) -> None:
        """Blocks from table index `first` on that `seq`'s tokens fill become findable by
        hash."""
        bs = self.block_size
        gpu = self.gpu
        hashes = gpu.block_hashes
        ref_counts = gpu.ref_counts
        if self.windows[group] is not None:
            first = max(first, self._live[group][seq.seq_id])
        for i in range(first, min(len(seq.token_ids) // bs, len(table))):
            block_id = table[i]
            if hashes[block_id] is None and ref_counts[block_id] == 1:
                gpu.promote(block_id, group_key(group, seq.block_hash(i)), (i + 1) * bs)

    # -- asynchronous scheduling ----------------------------------------------------------

    def can_reserve_lookahead(self, seqs: list[Sequence], lookahead: int | list[int] = 1) -> bool:
        """Whether each of `seqs` can get slots for `lookahead` tokens (or lookahead[i] for
        seqs[i]) past the ones it knows (the token it is sampling now, or drafts) without a
        copy-on-write, from the free device blocks."""
        bs = self.block_size
        ref_counts = self.gpu.ref_counts
        hashes = self.gpu.block_hashes
        aheads = [lookahead] * len(seqs) if isinstance(lookahead, int) else lookahead
        needed = 0
        for tables in self._group_tables:
            for seq, ahead in zip(seqs, aheads, strict=True):
                table = tables[seq.seq_id]
                position = len(seq.token_ids)
                index = position // bs
                num_blocks = len(table)
                if index < num_blocks:
                    block_id = table[index]
                    if ref_counts[block_id] > 1 and hashes[block_id] is None:  # _must_copy
                        return False
                last = (position + ahead - 1) // bs + 1
                if last > num_blocks:
                    needed += last - num_blocks
        return needed <= self.gpu.get_num_free_blocks()

    def reserve_lookahead(self, seq: Sequence, lookahead: int = 1) -> None:
        """Extend `seq`'s tables to hold `lookahead` tokens more than it knows (checked by
        `can_reserve_lookahead`). Once the tokens are appended, `append_reserved` (a
        continuation's sample) or `commit_lookahead` (kept drafts) finds the room and only
        marks full blocks for the prefix cache."""
        self.reserve_lookaheads([seq], [lookahead])

    def reserve_lookaheads(self, seqs: list[Sequence], lookahead: list[int]) -> None:
        """`reserve_lookahead` for each of `seqs`, `lookahead[i]` tokens for seqs[i]."""
        bs = self.block_size
        allocate = self.gpu.allocate
        for g, tables in enumerate(self._group_tables):
            for seq, ahead in zip(seqs, lookahead, strict=True):
                table = tables[seq.seq_id]
                missing = -(-(len(seq.token_ids) + ahead) // bs) - len(table)
                for _ in range(missing):
                    table.append(allocate(tag=g))

    def append_reserved(self, seqs: list[Sequence]) -> None:
        """`append_slots` for sequences whose appended tokens landed in slots reserved for them
        (`reserve_lookahead`): no block to add, none to copy, and their windows moved on when
        their computed tokens were marked (`mark_computed`), so only a block one of them
        filled has work (prefix caching)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            if len(seq.token_ids) // bs > seq.num_computed_tokens // bs:
                self.append_slots(seq, copies)
        assert not copies, "reserved slots are never copied on write"

    def commit_lookahead(self, seq: Sequence, first_written: int, ahead: int = 0) -> None:
        """After tokens from position `first_written` on were appended to `seq` into its
        reserved slots (kept drafts): blocks past its tokens and `ahead` slots more (what the
        step in flight after it reserved) go back to the free pool, the blocks they filled
        become findable by hash, and the computed ones count as hits."""
        needed = -(-(len(seq.token_ids) + ahead) // self.block_size)
        for g, tables in enumerate(self._group_tables):
            table = tables[seq.seq_id]
            if len(table) > needed:
                while len(table) > needed:
                    self.gpu.free(table.pop(), self._now)
                self._mark_dirty(g, seq.seq_id, needed)  # the worker's table shrinks too
            if self.enable_caching:
                self._promote_full(g, seq, table, first_written // self.block_size)
        self.mark_computed(seq)

    def _mark_dirty(self, group: int, seq_id: int, index: int) -> None:
        dirty = self._dirty[group]
        old = dirty.get(seq_id)
        if old is None or index < old:
            dirty[seq_id] = index

    def pop_dirty_from(self, seq_id: int, group: int = 0) -> int | None:
        """First index of `group`'s table rewritten in place since the last call (None: only
        appends)."""
        return self._dirty[group].pop(seq_id, None)

    def has_dirty_tables(self) -> bool:
        """Whether any table was rewritten in place since its `pop_dirty_from`."""
        return any(self._dirty)

    def mark_computed(self, seq: Sequence) -> None:
        """Record that the K/V of `seq`'s computed tokens exist, so its full hashed blocks
        count as prefix-cache hits from now on, and let windowed groups drop the blocks their
        windows left."""
        seq_id = seq.seq_id
        start = self._num_marked.get(seq_id)
        if start is None or seq_id in self._on_cpu:
            return
        end = seq.num_computed_tokens // self.block_size
        if end > start:
            computed = self.gpu.computed
            hashes = self.gpu.block_hashes
            for g, tables in enumerate(self._group_tables):
                table = tables[seq_id]
                first = start if self.windows[g] is None else max(start, self._live[g][seq_id])
                for i in range(first, min(end, len(table))):
                    if hashes[table[i]] is not None:
                        computed[table[i]] = True
            self._num_marked[seq_id] = end
        pending = self._pending_saves.get(seq_id)
        if pending:
            assert self.states is not None
            while pending and pending[0][0] <= seq.num_computed_tokens:
                self.states.mark_saved(pending.pop(0)[1])
        # After marking: the blocks a window leaves stay in the prefix cache as hits.
        for g in self._windowed:
            self._slide(g, seq)

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """`child_seq` shares every block of `parent_seq`."""
        parent_id, child_id = parent_seq.seq_id, child_seq.seq_id
        allocator = self.cpu if parent_id in self._on_cpu else self.gpu
        for g, tables in enumerate(self._group_tables):
            table = tables[parent_id]
            live = self._live[g].get(parent_id, 0)
            for block_id in table[live:]:
                allocator.share(block_id)
            tables[child_id] = list(table)
            if self.windows[g] is not None:
                self._live[g][child_id] = live
            dirty = self._dirty[g].get(parent_id)
            if dirty is not None:
                self._dirty[g][child_id] = dirty
        if parent_id in self._on_cpu:
            self._on_cpu.add(child_id)
        self._num_marked[child_id] = self._num_marked[parent_id]
        if self.states is not None:
            self.states.take_for_fork(parent_id, child_id)

    # -- swapping ---------------------------------------------------------------------------

    def _live_blocks(self, seq_id: int) -> list[int]:
        """Every block the sequence's tables hold (NULL entries left out)."""
        return [
            b
            for g, tables in enumerate(self._group_tables)
            for b in tables[seq_id][self._live[g].get(seq_id, 0) :]
        ]

    def _unique_blocks(self, seqs: list[Sequence]) -> int:
        return len({b for s in seqs for b in self._live_blocks(s.seq_id)})

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        if self.states is not None and len(seqs) > self.states.num_host_free():
            return False
        return self._unique_blocks(seqs) <= self.cpu.get_num_free_blocks()

    def _swap_in_blocks(self, seqs: list[Sequence]) -> int:
        # One more block per sequence and group for the token it appends when it resumes,
        # or as many as the tokens appended while it was out need (a grammar's forced tokens).
        bs = self.block_size
        return self._unique_blocks(seqs) + sum(
            max(1, -(-seq.get_len() // bs) - len(tables[seq.seq_id]))
            for seq in seqs
            for tables in self._group_tables
        )

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        if self.states is not None and slots_needed(seq_group) > self.states.num_free():
            return False
        required = self._swap_in_blocks(seq_group.get_seqs(SequenceStatus.SWAPPED))
        return self.gpu.get_num_free_blocks() - required >= self.watermark_blocks

    def can_ever_swap_in(self, seq_group: SequenceGroup) -> bool:
        """Whether the swapped group fits the empty cache (else only a recompute, which
        frees what its windows left, can bring it back)."""
        if self.states is not None and slots_needed(seq_group) > self.states.num_slots:
            return False
        required = self._swap_in_blocks(seq_group.get_seqs(SequenceStatus.SWAPPED))
        usable = self.num_total_gpu_blocks - self.num_reserved
        return usable - required >= self.watermark_blocks

    def swap_out(
        self, seq_group: SequenceGroup, state_moves: list[tuple[int, int]] | None = None
    ) -> dict[int, int]:
        """Move the running sequences' blocks to host blocks. Returns {gpu block: cpu block};
        a block shared inside the group is copied once and stays shared. Their states' moves,
        (device slot, host slot), go to `state_moves`."""
        mapping: dict[int, int] = {}
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            self._move(seq.seq_id, self.gpu, self.cpu, mapping)
            self._on_cpu.add(seq.seq_id)
            if self.states is not None:
                assert state_moves is not None, "a state model's swap needs its state moves"
                state_moves.append(self.states.swap_out(seq.seq_id))
                self._pending_saves.pop(seq.seq_id, None)
        return mapping

    def swap_in(
        self, seq_group: SequenceGroup, state_moves: list[tuple[int, int]] | None = None
    ) -> dict[int, int]:
        """Move the swapped sequences' blocks back to device blocks. Returns {cpu: gpu}. Their
        states' moves, (host slot, device slot), go to `state_moves`."""
        mapping: dict[int, int] = {}
        if self.states is not None:
            assert state_moves is not None, "a state model's swap needs its state moves"
            self.states.reserve(seq_group.request_id, slots_needed(seq_group))
        for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
            seq_id = seq.seq_id
            if self.states is not None:
                assert state_moves is not None
                state_moves.append(self.states.swap_in(seq_group.request_id, seq_id))
            self._move(seq_id, self.cpu, self.gpu, mapping)
            self._on_cpu.discard(seq_id)
            for g in range(self.num_groups):
                self._dirty[g][seq_id] = self._live[g].get(seq_id, 0)
            # Swapped-in blocks carry no hash; only blocks filled from now on get one.
            self._num_marked[seq_id] = seq.num_computed_tokens // self.block_size
        return mapping

    def _move(
        self, seq_id: int, src: BlockAllocator, dst: BlockAllocator, mapping: dict[int, int]
    ) -> None:
        for g, tables in enumerate(self._group_tables):
            table = tables[seq_id]
            for i in range(self._live[g].get(seq_id, 0), len(table)):
                block_id = table[i]
                moved = mapping.get(block_id)
                if moved is None:
                    moved = dst.allocate(tag=g)
                    mapping[block_id] = moved
                else:
                    dst.share(moved)
                table[i] = moved
                src.free(block_id, self._now)

    # -- prefixes for other replicas (KV moves) ---------------------------------------------

    def hit_blocks(self, seq: Sequence) -> list[tuple[int, int, int]]:
        """(block id, key, hashed tokens) of the full, computed blocks of `seq`'s tables that
        a prefix-cache hit on its tokens reads (a windowed group's from its live part), in
        table order across groups; each group's stop at its first block not computed."""
        bs = self.block_size
        gpu = self.gpu
        num_full = len(seq.token_ids) // bs
        found: list[tuple[int, int, int, int]] = []  # (index, block, key, tokens)
        for g, tables in enumerate(self._group_tables):
            table = tables[seq.seq_id]
            for i in range(self._live[g].get(seq.seq_id, 0), min(num_full, len(table))):
                block_id, key = table[i], group_key(g, seq.block_hash(i))
                if gpu.block_hashes[block_id] != key or not gpu.computed[block_id]:
                    break  # later blocks cannot be prefix-cache hits without this one
                found.append((i, block_id, key, (i + 1) * bs))
        found.sort(key=lambda f: f[0])
        return [(block_id, key, tokens) for _, block_id, key, tokens in found]

    # -- freeing and queries ----------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        seq_id = seq.seq_id
        if seq_id not in self._tables:
            return
        allocator = self.cpu if seq_id in self._on_cpu else self.gpu
        self._on_cpu.discard(seq_id)
        self._num_marked.pop(seq_id, None)
        self.prefix.forget(seq_id)
        if self.states is not None:
            self.states.drop(seq_id)
            self._pending_saves.pop(seq_id, None)
        for g, tables in enumerate(self._group_tables):
            table = tables.pop(seq_id)
            live = self._live[g].pop(seq_id, 0)
            self._dirty[g].pop(seq_id, None)
            # Free the tail first: at equal LRU time the evictor prefers deeper blocks anyway.
            for i in range(len(table) - 1, live - 1, -1):
                allocator.free(table[i], self._now)

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self._tables

    def state_slot(self, seq_id: int) -> int | None:
        """The state slot of a sequence holding tables (None: the model keeps no states)."""
        return None if self.states is None else self.states.slot_of(seq_id)

    def get_block_table(self, seq: Sequence, group: int = 0) -> list[int]:
        return self._group_tables[group][seq.seq_id]

    @property
    def block_tables(self) -> Mapping[int, list[int]]:
        """Group 0's table of every sequence by seq id, for readers that visit many sequences
        (do not modify)."""
        return self._tables

    @property
    def group_tables(self) -> list[dict[int, list[int]]]:
        """Per KV group, every sequence's table (do not modify)."""
        return self._group_tables

    def resident_blocks(self, seq: Sequence) -> list[int]:
        """How many device or host blocks each group's table of `seq` holds (NULL entries of
        a window left out)."""
        return [
            len(tables[seq.seq_id]) - self._live[g].get(seq.seq_id, 0)
            for g, tables in enumerate(self._group_tables)
        ]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu.get_num_free_blocks()

    def gpu_usage(self) -> float:
        return 1.0 - self.gpu.get_num_free_blocks() / max(self.num_total_gpu_blocks, 1)

    def cpu_usage(self) -> float:
        return 1.0 - self.cpu.get_num_free_blocks() / max(self.num_total_cpu_blocks, 1)

    def group_usage(self) -> list[int]:
        """Device blocks in use by each group (taken for its tables; a block shared by
        sequences counted once); blocks that transfers pinned before any sequence held them
        are not counted."""
        return self.gpu.in_use_by_tag[: self.num_groups]

    def check_invariants(self) -> None:
        """Free + in use == total on each device; ref counts equal table references; no block
        both free and referenced (a transfer's pin counts as one); every group holds a table
        for the same sequences; a windowed table holds NULL entries exactly before its live
        part, none of them referenced; the state slots are held by exactly the sequences with
        tables; and each part's own (`PrefixHits`, `TransferPins`, `StateSlots`)."""
        gpu_refs = [0] * self.num_total_gpu_blocks
        cpu_refs = [0] * self.num_total_cpu_blocks
        if self._windowed:
            gpu_refs[NULL_BLOCK] += 1
        for g, tables in enumerate(self._group_tables):
            assert tables.keys() == self._tables.keys(), f"group {g}: other sequences"
            for seq_id, table in tables.items():
                refs = cpu_refs if seq_id in self._on_cpu else gpu_refs
                live = self._live[g].get(seq_id, 0)
                if self.windows[g] is None:
                    assert live == 0
                else:
                    assert seq_id in self._live[g], f"group {g}: seq {seq_id} without a window"
                    assert all(b == NULL_BLOCK for b in table[:live])
                for block_id in table[live:]:
                    refs[block_id] += 1
        for block_id in self.transfers.held_blocks():
            gpu_refs[block_id] += 1
        assert self._on_cpu <= self._tables.keys()
        self.prefix.check_invariants(self._tables.keys())
        self.transfers.check_invariants()
        if self.states is not None:
            self.states.check_invariants(set(self._tables))
        self.gpu.check_invariants(gpu_refs)
        self.cpu.check_invariants(cpu_refs)
