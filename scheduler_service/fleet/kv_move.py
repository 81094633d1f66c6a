"""What a KV move is made of (`scheduler_service.fleet.kv_mover` runs them): the record of one
move, which blocks a round copies, and what moving costs as measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.sequence import SequenceGroup, SequenceStatus
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.placement import cached_prefix_blocks, prompt_block_hashes
from scheduler_service.fleet.tracing import RequestTrace
from scheduler_service.fleet.transfer_queue import TransferQueue

if TYPE_CHECKING:
    from scheduler_service.fleet.replica import Replica

# Pre-copy rounds before the last one, whatever they leave for it.
MAX_ROUNDS = 4
# A round that would copy this many new blocks or fewer is the last one.
FINAL_DELTA_BLOCKS = 1


@dataclass(slots=True)
class Round:
    """One round's pins on the source: its transfer, its blocks (source block, key, hashed
    tokens), and the state snapshot it carries (the slot held on the source, and its key)."""

    transfer_id: int
    blocks: list[tuple[int, int, int]]
    state_slot: int | None = None
    state_key: int | None = None


@dataclass(eq=False, slots=True)
class Move:
    """One request moving from `source` to `target` with its KV blocks, round by round."""

    request_id: str
    source: Replica
    source_engine: LLMEngine
    source_queue: TransferQueue
    target: Replica
    target_engine: LLMEngine
    target_queue: TransferQueue
    cause: str
    started: float
    rounds: int = 0
    # The round in flight (None between rounds), and whether its export is registered.
    transfer_id: int | None = None
    exported: bool = False
    final: bool = False
    # Block hashes the target holds for this request (imported, or cached before).
    present: set[int] = field(default_factory=set)
    # Rounds whose target blocks stay pinned until the request is queued there.
    target_pins: list[int] = field(default_factory=list)
    # Set once the request is stopped on the source (the last round).
    snapshot: GroupSnapshot | None = None
    trace: RequestTrace | None = None
    blocks_copied: int = 0
    # A prefill worker's hand-off: rounds copy the prompt's blocks as its prefill computes
    # them; the last round comes once every running sequence has its first token. Between
    # chunks with nothing new to copy the move is `parked` (`move_policy.hand_off` resumes it).
    until_prefilled: bool = False
    parked: bool = False
    # A hand-off's last round, pinned when its request stopped on the source at its first
    # token while an earlier round was in flight; sent once that round is done.
    held: Round | None = None
    # When the round in flight started (time.monotonic()), and its span.
    round_started: float = 0.0
    span: Span | None = None
    # The target's state slot the round in flight imports a snapshot into (None: none).
    import_state_slot: int | None = None


def prefilled(group: SequenceGroup) -> bool:
    """Whether every running sequence of the group has sampled its first token."""
    running = group.get_seqs(SequenceStatus.RUNNING)
    return bool(running) and all(seq.get_output_len() for seq in running)


def missing_blocks(move: Move, group: SequenceGroup) -> list[tuple[int, int, int]]:
    """(source block, key, hashed tokens) of the group's full, computed blocks, in every KV
    group, that the target lacks and the move has not copied (recorded in `move.present`), in
    table order (a prefix-cache hit needs the leading ones first)."""
    bm = move.source_engine.scheduler.block_manager
    target_gpu = move.target_engine.scheduler.block_manager.gpu
    found: list[tuple[int, int, int]] = []
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        if not bm.has_table(seq):
            continue
        for block_id, key, tokens in bm.hit_blocks(seq):
            if key in move.present:
                continue
            move.present.add(key)
            if target_gpu.lookup(key) is None:
                found.append((block_id, key, tokens))
    return found


def move_snapshot(move: Move, group: SequenceGroup) -> int | None:
    """The key of the source's state snapshot (recurrent layers) at the deepest block boundary
    of the group's first running sequence's computed tokens, for the last round to carry;
    None when there is none, or the target holds it already."""
    bm = move.source_engine.scheduler.block_manager
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        if bm.states is None or not bm.has_table(seq):
            continue
        num_blocks = seq.num_computed_tokens // bm.block_size
        key = bm.transfers.snapshot_key([seq.block_hash(i) for i in range(num_blocks)], num_blocks)
        return _unless_held(move.target_engine, key)
    return None


def cached_blocks(
    peer: LLMEngine, target: LLMEngine, prompt: list[int]
) -> tuple[list[tuple[int, int, int]], int | None]:
    """(peer block, key, hashed tokens) of the blocks of the prompt's longest prefix that the
    peer's prefix cache serves computed and the target's does not hold, in order (a prefix
    fetch); and the key of the peer's state snapshot at the deepest boundary of that prefix
    (None: no recurrent layers, none kept, or the target holds it)."""
    target_gpu = target.scheduler.block_manager.gpu
    hit, blocks = cached_prefix_blocks(peer, prompt)
    peer_bm = peer.scheduler.block_manager
    state_key = peer_bm.transfers.snapshot_key(prompt_block_hashes(peer_bm.block_size, prompt), hit)
    missing = [
        (block_id, key, tokens)
        for block_id, key, tokens in blocks
        if target_gpu.lookup(key) is None
    ]
    return missing, _unless_held(target, state_key)


def _unless_held(target: LLMEngine, key: int | None) -> int | None:
    states = target.scheduler.block_manager.states
    return None if key is None or states is None or states.is_saved(key) else key


class LinearFit:
    """seconds = fixed + per_unit * units, fitted by least squares over recent observations
    (each older one weighs `DECAY` times less than the next)."""

    DECAY = 0.95

    def __init__(self) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, units: float, seconds: float) -> None:
        d = self.DECAY
        self.n, self.sx, self.sy = self.n * d + 1, self.sx * d + units, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + units * units, self.sxy * d + units * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per unit); None before any observation. With every
        observation at one size, all of the time is per unit."""
        if self.n == 0 or self.sx == 0:
            return None
        spread = self.n * self.sxx - self.sx * self.sx
        if spread <= 1e-9 * self.sxx * self.n:
            return 0.0, self.sy / self.sx
        per_unit = (self.n * self.sxy - self.sx * self.sy) / spread
        if per_unit <= 0:
            return 0.0, self.sy / self.sx
        return max((self.sy - per_unit * self.sx) / self.n, 0.0), per_unit


class Rates:
    """What moving and computing cost, as the scheduler measures them: a round's seconds
    against its blocks, from the source's export queued to the target's import done (both
    steps' latency is its fixed part); and a step's seconds against the tokens it computes
    (the per-token part is what a prefill of more tokens costs)."""

    def __init__(self) -> None:
        self.rounds = LinearFit()
        self.steps = LinearFit()

    def on_round(self, blocks: int, seconds: float) -> None:
        if blocks and seconds > 0:
            self.rounds.add(blocks, seconds)

    def on_step(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            self.steps.add(tokens, seconds)

    def copy_beats_compute(self, blocks: int, tokens: int) -> bool:
        """Whether a round copying `blocks` takes less time than computing their `tokens`
        (True until both have been measured)."""
        copy, step = self.rounds.fit(), self.steps.fit()
        if copy is None or step is None:
            return True
        return copy[0] + copy[1] * blocks < step[1] * tokens
