"""State slots: the per-sequence memory of a model's recurrent layers (DESIGN.md, section 13).

A Gated DeltaNet layer keeps one fixed-size state per sequence instead of K/V per token. The
worker holds `num_slots` of them in pools (`worker_service.linear_state`); the scheduler
decides which slot each sequence uses, as it decides blocks.

A request takes its slots at admission, as many as its sequences can ever hold at once
(`slots_needed`), so a fork (n > 1 at the first sample, a new beam) always finds one: the
request's sequences take slots from its reservation and give them back to it when freed. When
none of its sequences holds a slot any more (it finished, or was preempted by recompute) the
reservation goes back to the pool. A slot's contents belong to the sequence holding it: a
sequence that starts computing from its first token reads none of it.

Prefix caching: a **snapshot** is a slot holding the state after a sequence's first tokens up
to a block boundary (in its prompt, or in its output: a later turn's prompt holds it), keyed
by that block's hash (the chain of the tokens, as the blocks are). The worker copies a
sequence's slot into it after the step that reaches the boundary (`StepInput.state_saves`);
once that step is done (`mark_saved`) a later request whose prompt shares the prefix starts
from a copy of it (`NewSequence.state_from_slot`). Snapshots are cached, not held: a request
that needs slots takes free ones first, then evicts the least recently used snapshots, never
one read or written in the step being built (its copy has not run yet), nor one pinned for a
transfer: a KV move exports a snapshot beside its blocks (`pin`) and imports it on the
target into a slot taken for it (`receive`), saved once the import is done.

Swap preemption moves a sequence's state to a host slot (the worker keeps as many host slots
as device slots) and gives its device slot back; swapped in, it takes a device slot of its
request's new reservation, which may be another one.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler_service.engine.sequence import SequenceGroup


def slots_needed(seq_group: SequenceGroup) -> int:
    """The most slots the group's sequences hold at once from now on: beam search forks up to
    width new beams (when a parent's own extension finished) before it frees the parents
    (2 * width); a group that has not sampled yet forks into `best_of` sequences at its first
    sample; otherwise its live sequences."""
    params = seq_group.sampling_params
    live = len(seq_group.get_unfinished_seqs())
    if params.use_beam_search:
        return max(2 * params.num_sampled, live)
    if not seq_group.has_sampled:
        return max(params.num_sampled, live)
    return live


class StateSlotError(RuntimeError):
    """A slot was asked of a request that has none left (a scheduler bug)."""


class StateSlots:
    """The device state slots: free ones, each request's reservation, each sequence's slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # Lowest first, so a lightly loaded worker touches few slots.
        self._free = list(range(num_slots - 1, -1, -1))
        self._reserved: dict[str, list[int]] = {}  # request id -> slots no sequence holds
        self._holders: dict[str, int] = {}  # request id -> how many of its sequences hold one
        self._slot: dict[int, int] = {}  # seq id -> slot
        self._owner: dict[int, str] = {}  # seq id -> request id
        # Snapshots by key, least recently used first: (slot, saved, last step used).
        self._snapshots: OrderedDict[int, tuple[int, bool, float]] = OrderedDict()
        # Snapshots a transfer holds (an export reading, an import writing): key -> holds.
        self._pins: dict[int, int] = {}
        # The step being built (the block manager's clock): snapshots used in it stay.
        self.now = 0.0
        self._host_free = list(range(num_slots - 1, -1, -1))
        self._host_slot: dict[int, int] = {}  # seq id -> host slot (swapped out)

    def num_free(self) -> int:
        """Slots a request may take now: free ones and snapshots it may evict."""
        return len(self._free) + sum(1 for key in self._snapshots if self._evictable(key))

    def _evictable(self, key: int) -> bool:
        return self._snapshots[key][2] < self.now and key not in self._pins

    def num_unheld(self) -> int:
        """Slots no sequence holds or reserves: free ones and every snapshot (the next step
        may evict any of them)."""
        return len(self._free) + len(self._snapshots)

    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def _pop_free(self) -> int:
        """A free slot, else the least recently used snapshot's, evicted."""
        if self._free:
            return self._free.pop()
        for key, (slot, _, _) in self._snapshots.items():
            if self._evictable(key):
                del self._snapshots[key]
                return slot
        raise StateSlotError("no free state slot and no snapshot to evict")

    def reserve(self, request_id: str, count: int) -> None:
        """Set aside `count` slots for the request (more if it already has some: it tops up)."""
        pool = self._reserved.setdefault(request_id, [])
        self._holders.setdefault(request_id, 0)
        wanted = count - len(pool) - self._holders[request_id]
        if wanted > self.num_free():
            raise StateSlotError(
                f"request {request_id}: {wanted} slots wanted, {self.num_free()} free"
            )
        for _ in range(max(wanted, 0)):
            pool.append(self._pop_free())

    def take(self, request_id: str, seq_id: int) -> int:
        """A slot of the request's reservation for `seq_id`."""
        assert seq_id not in self._slot, f"seq {seq_id} already holds slot {self._slot[seq_id]}"
        pool = self._reserved.get(request_id)
        if not pool:
            raise StateSlotError(f"request {request_id}: no reserved slot left for seq {seq_id}")
        slot = pool.pop()
        self._slot[seq_id] = slot
        self._owner[seq_id] = request_id
        self._holders[request_id] += 1
        return slot

    def take_for_fork(self, parent_seq_id: int, child_seq_id: int) -> int:
        """A slot of the parent's request for its new child."""
        return self.take(self._owner[parent_seq_id], child_seq_id)

    def slot_of(self, seq_id: int) -> int:
        return self._slot[seq_id]

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._slot

    def release(self, seq_id: int) -> None:
        """The sequence's slot back to its request; the request's reservation back to the
        pool once no sequence of it holds one."""
        slot = self._slot.pop(seq_id, None)
        if slot is None:
            return
        request_id = self._owner.pop(seq_id)
        self._reserved[request_id].append(slot)
        self._holders[request_id] -= 1
        if self._holders[request_id] == 0:
            self._free.extend(self._reserved.pop(request_id))
            self._free.sort(reverse=True)
            del self._holders[request_id]

    # -- swapping --------------------------------------------------------------------------

    def num_host_free(self) -> int:
        return len(self._host_free)

    def swap_out(self, seq_id: int) -> tuple[int, int]:
        """Move the sequence's state to a host slot: (device slot, host slot)."""
        device = self._slot[seq_id]
        self.release(seq_id)
        host = self._host_free.pop()
        self._host_slot[seq_id] = host
        return device, host

    def swap_in(self, request_id: str, seq_id: int) -> tuple[int, int]:
        """Move the sequence's state back into a slot of its request's reservation:
        (host slot, device slot)."""
        host = self._host_slot.pop(seq_id)
        device = self.take(request_id, seq_id)
        self._host_free.append(host)
        return host, device

    def drop(self, seq_id: int) -> None:
        """Forget the sequence's state, on the device or the host."""
        host = self._host_slot.pop(seq_id, None)
        if host is None:
            self.release(seq_id)
        else:
            self._host_free.append(host)

    # -- snapshots (prefix caching) ------------------------------------------------------

    def save(self, key: int, evict: bool = True) -> int | None:
        """A slot for a new snapshot under `key`, written after the step being built; None
        when one is cached or pending under it already, or no slot can be had (without
        `evict`, only a free one: no other snapshot is evicted for it)."""
        if key in self._snapshots:
            slot, saved, _ = self._snapshots.pop(key)
            self._snapshots[key] = (slot, saved, self.now)
            return None
        if self.num_free() == 0 or not (evict or self._free):
            return None
        slot = self._pop_free()
        self._snapshots[key] = (slot, False, self.now)
        return slot

    def mark_saved(self, key: int) -> None:
        """The step that writes the snapshot is done: hits may read it from now on."""
        entry = self._snapshots.get(key)
        if entry is not None:
            self._snapshots[key] = (entry[0], True, entry[2])

    def lookup(self, key: int) -> int | None:
        """The slot of the saved snapshot under `key` (marked used in this step), or None."""
        entry = self._snapshots.get(key)
        if entry is None or not entry[1]:
            return None
        del self._snapshots[key]
        self._snapshots[key] = (entry[0], True, self.now)
        return entry[0]

    def is_saved(self, key: int) -> bool:
        entry = self._snapshots.get(key)
        return entry is not None and entry[1]

    # -- transfers (KV moves) --------------------------------------------------------------

    def pin(self, key: int) -> int | None:
        """Hold the saved snapshot under `key` for an export until `unpin`: its slot, or None
        when none is saved."""
        slot = self.lookup(key)
        if slot is not None:
            self._pins[key] = self._pins.get(key, 0) + 1
        return slot

    def receive(self, key: int) -> int | None:
        """A slot for a snapshot an import writes under `key`, held until `unpin`: hits read
        it once `mark_saved` (the import done). None when one is kept under `key` already,
        or no slot can be had."""
        if key in self._snapshots or self.num_free() == 0:
            return None
        slot = self._pop_free()
        self._snapshots[key] = (slot, False, self.now)
        self._pins[key] = 1
        return slot

    def unpin(self, key: int) -> None:
        """Let go of a transfer's hold; a snapshot whose import never finished is dropped."""
        holds = self._pins.pop(key, 0) - 1
        if holds > 0:
            self._pins[key] = holds
            return
        entry = self._snapshots.get(key)
        if entry is not None and not entry[1]:
            del self._snapshots[key]
            self._free.append(entry[0])
            self._free.sort(reverse=True)

    def check_invariants(self, seq_ids: set[int]) -> None:
        """Every slot is free, reserved, held or a snapshot, exactly once; the holders are
        `seq_ids` (the sequences with block tables); every reservation has a holder."""
        reserved = [s for pool in self._reserved.values() for s in pool]
        snapshots = [slot for slot, _, _ in self._snapshots.values()]
        everywhere = self._free + reserved + list(self._slot.values()) + snapshots
        assert sorted(everywhere) == list(range(self.num_slots)), "state slots lost or doubled"
        host = self._host_free + list(self._host_slot.values())
        assert sorted(host) == list(range(self.num_slots)), "host state slots lost or doubled"
        assert not self._slot.keys() & self._host_slot.keys(), "a state on device and host"
        assert self._slot.keys() | self._host_slot.keys() == seq_ids, (
            f"states of {sorted(self._slot)} (device), {sorted(self._host_slot)} (host); "
            f"block tables of {sorted(seq_ids)}"
        )
        assert self._pins.keys() <= self._snapshots.keys(), "a pin on no snapshot"
        for request_id, count in self._holders.items():
            assert count == sum(1 for o in self._owner.values() if o == request_id)
            assert count > 0, f"request {request_id} reserves slots with no sequence"
        assert self._holders.keys() == self._reserved.keys()
