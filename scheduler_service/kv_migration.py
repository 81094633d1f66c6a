"""Moving running requests between replicas with their KV blocks, rather than recomputing them.

A move takes a running request from a source replica to a target:

1. Copy rounds (pre-copy). A round exports the source's full, computed blocks that the target
   lacks (the scheduler holds both block tables and the blocks' content hashes) and imports
   them on the target, into blocks allocated there under the same hashes, while the request
   keeps decoding on the source. A round takes two steps: the source's step registers the
   export, then the target's step pulls the bytes from worker to worker
   (`worker_service.kv_transfer`). Rounds repeat while the request filled more than
   `FINAL_DELTA_BLOCKS` new blocks during the last one, `MAX_ROUNDS` at most.
2. The last round stops the request on the source first, copies the full blocks the earlier
   rounds did not cover, and then queues the request on the target as a migrated request.
   The prefix cache there finds the imported blocks computed, so the target recomputes only
   the partial last block: fewer than block_size tokens, in one step. Copying that block as
   well would save this small prefill, but it would need a second way into the engine; this
   way a moved request follows the recompute migration's path, which every fleet test covers.
   Stop-and-copy (`MigrationMode.STOP_AND_COPY`) is this last round alone.

While a round is in flight its blocks are pinned on both sides (`BlockSpaceManager.pin`), so
neither engine reuses them. The target's pins last until the request is queued there; the
source's end with the round.

Any failure falls back to the recompute migration: a failed import (the source gone, the
credential refused, a timeout), a lost target or a lost source. The request continues from
the tokens it has on a ready replica, and every pin is released.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llmserve.logs import get_logger
from llmserve.steps import TransferFailure
from scheduler_service import metrics
from scheduler_service.config import MigrationMode
from scheduler_service.engine import LLMEngine
from scheduler_service.migration import GroupSnapshot
from scheduler_service.replica_owner import ReplicaState
from scheduler_service.roles import PREFILL, role
from scheduler_service.sequence import SequenceGroup, SequenceStatus
from scheduler_service.tracing import RequestTrace
from scheduler_service.transfer_queue import TransferNews, TransferQueue

if TYPE_CHECKING:
    from scheduler_service.replica import Replica

log = get_logger(__name__)

# Pre-copy rounds before the last one, whatever they leave for it.
MAX_ROUNDS = 4
# A round that would copy this many new blocks or fewer is the last one.
FINAL_DELTA_BLOCKS = 1


class MoveHost(Protocol):
    """What moves need from the fleet."""

    def pick_target(self, source: Replica, prompt: list[int]) -> Replica | None:
        """The ready replica (not `source`) the routing policy would place `prompt` on."""

    def place_moved(
        self,
        target: Replica,
        snapshot: GroupSnapshot,
        trace: RequestTrace | None,
        source: Replica,
        cause: str,
    ) -> bool:
        """Queue a moved request on `target`; False if it could not be (then placed anywhere,
        by recompute)."""

    def on_evicted(
        self,
        replica: Replica,
        snapshots: list[GroupSnapshot],
        traces: dict[str, RequestTrace | None],
        cause: str,
    ) -> None:
        """Place requests that left `replica` by recompute on any ready replica (or fail
        them), as `ReplicaOwner.on_evicted`."""


@dataclass(eq=False, slots=True)
class _Move:
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
    # Stop the request for the first round (a hand-off after prefill).
    stop_first: bool = False


class Migrations:
    """The fleet's moves in progress, by request id and by transfer id."""

    def __init__(self, host: MoveHost, mode: MigrationMode) -> None:
        self.host = host
        self.mode = mode
        self.moves: dict[str, _Move] = {}
        self._by_transfer: dict[int, _Move] = {}
        self._transfer_ids = itertools.count(1)

    def is_moving(self, request_id: str) -> bool:
        return request_id in self.moves

    @property
    def enabled(self) -> bool:
        return self.mode is not MigrationMode.RECOMPUTE

    def drain_step(self, replica: Replica, engine: LLMEngine, late: bool) -> list[str]:
        """The drain policy (`Replica.drain`), between steps of a draining replica: start
        moving its running requests that are not moving yet; returns the requests that move
        by recompute now: waiting and swapped ones, and once `late` (its grace period over)
        every one not in a move."""
        scheduler = engine.scheduler
        if self.enabled:  # drains move running requests with their blocks
            for group in list(scheduler.running):
                key = group.request_id
                if key not in self.moves:
                    target = self.host.pick_target(replica, group.prompt_token_ids)
                    if target is not None:
                        self.start(replica, target, key, "drain")
        if late:
            keys = engine.unfinished_request_ids()
        else:
            keys = [g.request_id for q in (scheduler.waiting, scheduler.swapped) for g in q]
        return [key for key in keys if key not in self.moves]

    def after_step(self, replica: Replica, news: TransferNews | None) -> None:
        """After each finished step of `replica`: its transfer news, then, on a prefill
        worker, the hand-off of requests whose first token is out (`roles`)."""
        if news is not None:
            self.on_transfers(replica, news)
        if role(replica) == PREFILL and replica.engine is not None:
            self.hand_off(replica, replica.engine)

    def hand_off(self, replica: Replica, engine: LLMEngine) -> None:
        """Move each request that has its first token to a decode worker: stopped here at
        once, its blocks copied, then decoded there."""
        for group in list(engine.scheduler.running):
            key = group.request_id
            running = group.get_seqs(SequenceStatus.RUNNING)
            if key in self.moves or not running or not all(s.get_output_len() for s in running):
                continue
            target = self.host.pick_target(replica, group.prompt_token_ids)
            if target is not None and role(target) != PREFILL:
                self.start(replica, target, key, "prefill_done", stop_first=True)

    def start(
        self,
        source: Replica,
        target: Replica,
        request_id: str,
        cause: str,
        stop_first: bool = False,
    ) -> bool:
        """Begin moving a running request of `source` to `target`, stopping it for the first
        round if `stop_first` (else per the mode). False (and nothing started) when it is
        not running there or either side cannot take part."""
        engine, target_engine = source.engine, target.engine
        if (
            request_id in self.moves
            or engine is None
            or target_engine is None
            or source.transfers is None
            or target.transfers is None
            or not target_engine.scheduler.block_manager.enable_caching
            or target.block_size != source.block_size
        ):
            return False
        group = engine.scheduler.get_seq_group(request_id)
        if group is None or not group.get_seqs(SequenceStatus.RUNNING):
            return False
        move = _Move(
            request_id,
            source,
            engine,
            source.transfers,
            target,
            target_engine,
            target.transfers,
            cause,
            time.monotonic(),
            stop_first=stop_first,
        )
        self.moves[request_id] = move
        self._next_round(move)
        return True

    # -- rounds --------------------------------------------------------------------------------

    def _missing(self, move: _Move, group: SequenceGroup) -> list[tuple[int, int, int]]:
        """(source block, hash, hashed tokens) of the group's full, computed blocks that the
        target lacks, in table order (a prefix-cache hit needs the leading ones first)."""
        bm = move.source_engine.scheduler.block_manager
        target_gpu = move.target_engine.scheduler.block_manager.gpu
        gpu, bs = bm.gpu, bm.block_size
        found: list[tuple[int, int, int]] = []
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if not bm.has_table(seq):
                continue
            table = bm.get_block_table(seq)
            for i in range(min(len(seq.token_ids) // bs, len(table))):
                block_id, block_hash = table[i], seq.block_hash(i)
                if gpu.block_hashes[block_id] != block_hash or not gpu.computed[block_id]:
                    break  # later blocks cannot be prefix-cache hits without this one
                if block_hash in move.present:
                    continue
                move.present.add(block_hash)
                if target_gpu.lookup(block_hash) is None:
                    found.append((block_id, block_hash, (i + 1) * bs))
        return found

    def _next_round(self, move: _Move) -> None:
        group = move.source_engine.scheduler.get_seq_group(move.request_id)
        if group is None or group.is_finished() or move.source.engine is not move.source_engine:
            self._end(move)  # finished (or aborted) on the source meanwhile
            return
        present = set(move.present)
        blocks = self._missing(move, group)
        final = (
            move.stop_first
            or self.mode is MigrationMode.STOP_AND_COPY
            or move.rounds >= MAX_ROUNDS
            or len(blocks) <= FINAL_DELTA_BLOCKS
        )
        target_bm = move.target_engine.scheduler.block_manager
        room = target_bm.get_num_free_gpu_blocks() - target_bm.watermark_blocks - 1
        if len(blocks) > room:  # the rest is recomputed on the target
            blocks = blocks[: max(room, 0)]
            move.present = present | {h for _, h, _ in blocks}
        move.rounds += 1
        transfer_id = next(self._transfer_ids)
        source_bm = move.source_engine.scheduler.block_manager
        if blocks:
            # Pinned before the stop below frees the request's blocks on the source.
            source_bm.pin(transfer_id, [b for b, _, _ in blocks])
        if final:
            move.final = True
            snapshots, traces = move.source.take_requests([move.request_id])
            if not snapshots:
                source_bm.unpin(transfer_id)
                self._end(move)
                return
            move.snapshot, move.trace = snapshots[0], traces.get(move.request_id)
        if not blocks:
            if final:
                self._finish(move)
            else:
                self._next_round(move)
            return
        target_bm.allocate_pinned(transfer_id, [(h, n) for _, h, n in blocks])
        move.target_pins.append(transfer_id)
        move.transfer_id, move.exported = transfer_id, False
        self._by_transfer[transfer_id] = move
        move.source_queue.export(transfer_id, [b for b, _, _ in blocks])

    # -- news from the workers -------------------------------------------------------------------

    def on_transfers(self, replica: Replica, news: TransferNews) -> None:
        """A finished step's transfer news (from `replica`)."""
        for transfer_id in news.exported:
            move = self._by_transfer.get(transfer_id)
            if move is None or move.source is not replica or move.exported:
                continue
            move.exported = True
            target_bm = move.target_engine.scheduler.block_manager
            move.target_queue.import_blocks(
                transfer_id, move.source.address, target_bm.pins[transfer_id]
            )
        for transfer_id in news.imported:
            move = self._by_transfer.pop(transfer_id, None)
            if move is None or move.target is not replica:
                continue
            bm = move.target_engine.scheduler.block_manager
            bm.mark_imported(transfer_id)
            move.blocks_copied += len(bm.pins[transfer_id])
            self._release_source(move, transfer_id)
            move.transfer_id = None
            if move.final:
                self._finish(move)
            else:
                self._next_round(move)
        for failure in news.failed:
            move = self._by_transfer.get(failure.transfer_id)
            if move is not None and move.target is replica:
                self._fail(move, failure)

    def on_engine_dropped(self, replica: Replica, engine: LLMEngine) -> None:
        """`replica` dropped `engine` (its worker lost, a failed step, drained): moves from or
        to it fall back to recompute. A request still on a lost source was evicted with its
        other requests already."""
        for move in list(self.moves.values()):
            if move.source_engine is engine or move.target_engine is engine:
                side = "source" if move.source_engine is engine else "target"
                self._fail(move, TransferFailure(move.transfer_id or 0, f"{side} lost"))

    def abort(self, request_id: str) -> bool:
        """Forget a request the client gave up on. True if it was stopped mid-move."""
        move = self.moves.get(request_id)
        if move is None or move.snapshot is None:
            return False
        move.snapshot = None  # the round in flight completes; nothing is queued after it
        return True

    # -- endings ---------------------------------------------------------------------------------

    def _release_source(self, move: _Move, transfer_id: int) -> None:
        if move.source.engine is move.source_engine:
            move.source_engine.scheduler.block_manager.unpin(transfer_id)
        move.source_queue.release(transfer_id)

    def _release_target(self, move: _Move) -> None:
        alive = move.target.engine is move.target_engine
        for transfer_id in move.target_pins:
            if alive:
                move.target_engine.scheduler.block_manager.unpin(transfer_id)
        move.target_pins = []

    def _end(self, move: _Move) -> None:
        self.moves.pop(move.request_id, None)
        if move.transfer_id is not None:
            self._by_transfer.pop(move.transfer_id, None)
        self._release_target(move)

    def _finish(self, move: _Move) -> None:
        """The last round is done: queue the request on the target, then let the target's
        pins go (the request's allocation finds the blocks by hash)."""
        self._end(move)
        snapshot, trace = move.snapshot, move.trace
        seconds = time.monotonic() - move.started
        if snapshot is None:  # aborted meanwhile
            return
        placed = move.target.state is ReplicaState.READY and self.host.place_moved(
            move.target, snapshot, trace, move.source, move.cause
        )
        outcome = "transfer" if placed else "fallback"
        metrics.KV_MIGRATIONS.labels(outcome).inc()
        metrics.KV_MIGRATION_SECONDS.observe(seconds)
        metrics.KV_MIGRATION_BLOCKS.inc(move.blocks_copied)
        log.info(
            "request moved with its KV blocks" if placed else "moved request placed elsewhere",
            request=move.request_id,
            from_worker=move.source.address,
            to_worker=move.target.address,
            rounds=move.rounds,
            blocks=move.blocks_copied,
            seconds=round(seconds, 4),
        )
        if not placed:
            self.host.on_evicted(move.source, [snapshot], {move.request_id: trace}, move.cause)

    def _fail(self, move: _Move, failure: TransferFailure) -> None:
        """Fall back to recompute: release both sides and place or evict the request."""
        transfer_id = move.transfer_id
        if transfer_id is not None:
            move.target_queue.cancel_import(transfer_id)
            self._release_source(move, transfer_id)
        self._end(move)
        metrics.KV_MIGRATIONS.labels("fallback").inc()
        log.warning(
            "KV transfer failed; the request moves by recompute",
            request=move.request_id,
            from_worker=move.source.address,
            to_worker=move.target.address,
            reason=failure.reason,
        )
        if (
            move.snapshot is None
            and move.source.engine is move.source_engine
            and (move.source.state is ReplicaState.DRAINING)
        ):
            # Still decoding on a draining source: it moves now, by recompute.
            snapshots, traces = move.source.take_requests([move.request_id])
            if snapshots:
                move.snapshot, move.trace = snapshots[0], traces.get(move.request_id)
        if move.snapshot is not None:
            traces = {move.request_id: move.trace}
            self.host.on_evicted(move.source, [move.snapshot], traces, move.cause)
