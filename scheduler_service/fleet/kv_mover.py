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

While a round is in flight its blocks are pinned on both sides (`TransferPins.pin`), so
neither engine reuses them. The target's pins last until the request is queued there; the
source's end with the round.

A model with recurrent layers keeps no K/V to copy for them: its last round (and a prefix
fetch) also carries the source's state snapshot at the deepest block boundary of the copied
prefix (`kv_move.move_snapshot`), pinned on the source and received into a slot taken for it
on the target, saved there once the import is done. The target's prefix cache then serves
the request from that boundary (a hit needs the snapshot as much as the blocks); without one
it recomputes from the deepest boundary it has a snapshot for.

Two more kinds of move take the same rounds (`move_policy` says when): a prefill worker's
hand-off (`Move.until_prefilled`: the prompt's blocks copied chunk by chunk as its prefill
computes them, the last round once its first token is out; if a round is still in flight
then, the request stops on the source at once and its last round waits, pinned, in
`Move.held`), and a prefix fetch (`fetch`: the source is a peer whose prefix cache holds the
blocks, and the request, not yet queued anywhere, waits in the move until they have arrived
on the target).

Any failure falls back to the recompute migration: a failed import (the source gone, the
credential refused, a timeout), a lost target or a lost source. The request continues from
the tokens it has on a ready replica, and every pin is released.

The mover belongs to the fleet, which calls it: `after_step` and `on_engine_dropped` as its
replicas report steps and dropped engines, `start` and `fetch` through the move policy. It
places nothing itself: a request whose last round is done is reported (`MoveFinished`), and
one that falls back is reported as `Evicted` from its source, through the fleet's `report`.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from llmserve.logs import get_logger
from llmserve.steps import TransferFailure
from scheduler_service.engine import metrics
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.sequence import SequenceGroup, SequenceStatus
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.fleet_config import MigrationMode
from scheduler_service.fleet.kv_move import (
    FINAL_DELTA_BLOCKS,
    MAX_ROUNDS,
    Move,
    Rates,
    Round,
    cached_blocks,
    missing_blocks,
    move_snapshot,
    prefilled,
)
from scheduler_service.fleet.replica_events import Evicted, MoveFinished, ReplicaState, Report
from scheduler_service.fleet.tracing import (
    RequestTrace,
    end_request_trace,
    end_transfer_span,
    start_transfer_span,
)
from scheduler_service.fleet.transfer_queue import TransferNews

if TYPE_CHECKING:
    from scheduler_service.fleet.replica import Replica

# The cause of a prefix fetch's move (`migrated` event, llmserve_request_migrations).
FETCH = "prefix_fetch"

log = get_logger(__name__)


class KvMover:
    """The fleet's moves in progress, by request id and by transfer id."""

    def __init__(self, report: Report[Replica], mode: MigrationMode) -> None:
        self.report = report
        self.mode = mode
        self.moves: dict[str, Move] = {}
        self._by_transfer: dict[int, Move] = {}
        self._transfer_ids = itertools.count(1)
        self.rates = Rates()

    @property
    def enabled(self) -> bool:
        return self.mode is not MigrationMode.RECOMPUTE

    def after_step(
        self, replica: Replica, news: TransferNews | None, tokens: int = 0, seconds: float = 0.0
    ) -> None:
        """After each finished step of `replica` (`tokens` computed in `seconds`): its transfer
        news."""
        self.rates.on_step(tokens, seconds)
        if news is not None:
            self.on_transfers(replica, news)

    def start(
        self,
        source: Replica,
        target: Replica,
        request_id: str,
        cause: str,
        until_prefilled: bool = False,
    ) -> bool:
        """Begin moving a running request of `source` to `target`: rounds per the mode, or a
        hand-off's (`until_prefilled`, kv_move.Move). False (and nothing started) when it is
        not running there or either side cannot take part."""
        if not self._can_take_part(request_id, source, target):
            return False
        engine, target_engine = source.engine, target.engine
        assert engine is not None and target_engine is not None
        group = engine.scheduler.get_seq_group(request_id)
        if group is None or not group.get_seqs(SequenceStatus.RUNNING):
            return False
        move = self._new_move(request_id, source, target, cause, until_prefilled=until_prefilled)
        self._next_round(move)
        return True

    def _can_take_part(self, request_id: str, source: Replica, target: Replica) -> bool:
        """Whether a move of `request_id` from `source` to `target` can start: none already,
        both connected, the target caching prefixes, the same block size, KV groups and
        recurrent layers (whose states travel as prefix snapshots)."""
        target_engine = target.engine
        if source.engine is None or target_engine is None:
            return False
        source_bm, target_bm = (
            source.engine.scheduler.block_manager,
            target_engine.scheduler.block_manager,
        )
        return not (
            request_id in self.moves
            or source.transfers is None
            or target.transfers is None
            or not target_bm.enable_caching
            or target.block_size != source.block_size
            or target_bm.windows != source_bm.windows
            or (target_bm.states is None) != (source_bm.states is None)
        )

    def _new_move(
        self, request_id: str, source: Replica, target: Replica, cause: str, **fields: Any
    ) -> Move:
        """Record a move between two connected replicas (`_can_take_part`)."""
        assert source.engine is not None and source.transfers is not None
        assert target.engine is not None and target.transfers is not None
        move = Move(
            request_id,
            source,
            source.engine,
            source.transfers,
            target,
            target.engine,
            target.transfers,
            cause,
            time.monotonic(),
            **fields,
        )
        self.moves[request_id] = move
        return move

    # -- rounds --------------------------------------------------------------------------------

    def _next_round(self, move: Move) -> None:
        held, move.held = move.held, None
        if held is not None:  # pinned when the request stopped on the source (stop_if_prefilled)
            self._run(move, held)
            return
        group = move.source_engine.scheduler.get_seq_group(move.request_id)
        if group is None or group.is_finished() or move.source.engine is not move.source_engine:
            self._end(move)  # finished (or aborted) on the source meanwhile
            return
        blocks = missing_blocks(move, group)
        move.parked = False
        if move.until_prefilled:
            final = prefilled(group)
        else:
            final = (
                self.mode is MigrationMode.STOP_AND_COPY
                or move.rounds >= MAX_ROUNDS
                or len(blocks) <= FINAL_DELTA_BLOCKS
            )
        pinned = self._pin_round(move, group, blocks, final)
        if pinned is not None:
            self._run(move, pinned)

    def _pin_round(
        self, move: Move, group: SequenceGroup, blocks: list[tuple[int, int, int]], final: bool
    ) -> Round | None:
        """Pin on the source a round's `blocks` (`missing_blocks`) and, for the last round,
        the group's state snapshot; then, the last round, stop the request there (its blocks
        are freed, the pinned ones held until the round ends). None when the request has left
        the source (the move ends)."""
        move.rounds += 1
        pinned = Round(next(self._transfer_ids), blocks)
        source_bm = move.source_engine.scheduler.block_manager
        pinned.state_key = move_snapshot(move, group) if final else None
        if blocks or pinned.state_key is not None:
            pinned.state_slot = source_bm.transfers.pin(
                pinned.transfer_id, [b for b, _, _ in blocks], pinned.state_key
            )
        if final:
            move.final = True
            snapshots, traces = move.source.take_requests([move.request_id])
            if not snapshots:
                source_bm.transfers.unpin(pinned.transfer_id)
                self._end(move)
                return None
            move.snapshot, move.trace = snapshots[0], traces.get(move.request_id)
        return pinned

    def _run(self, move: Move, pinned: Round) -> None:
        """Send a pinned round, as many of its blocks as the target has room for (it
        recomputes the rest); with nothing to send, finish a last round, park a hand-off
        until its prefill computes more, or go on to the next round."""
        target_bm = move.target_engine.scheduler.block_manager
        room = target_bm.get_num_free_gpu_blocks() - target_bm.watermark_blocks - 1
        if len(pinned.blocks) > room:
            move.present.difference_update(h for _, h, _ in pinned.blocks[max(room, 0) :])
            pinned.blocks = pinned.blocks[: max(room, 0)]
        if pinned.blocks or pinned.state_slot is not None:
            self._send(move, pinned)
            return
        move.source_engine.scheduler.block_manager.transfers.unpin(pinned.transfer_id)
        if move.final:
            self._finish(move)
        elif move.until_prefilled:
            move.parked = True  # until the prefill's next chunk
        else:
            self._next_round(move)

    def stop_if_prefilled(self, move: Move) -> None:
        """A hand-off with a round in flight whose request has its first token now: stop the
        request on the source at once, its last round pinned (`Move.held`) and sent when the
        round in flight is done. Left there, it would decode until then, and a short request
        could finish before the hand-off."""
        group = move.source_engine.scheduler.get_seq_group(move.request_id)
        if (
            move.until_prefilled
            and not move.final
            and move.transfer_id is not None
            and move.source.engine is move.source_engine
            and group is not None
            and not group.is_finished()
            and prefilled(group)
        ):
            move.held = self._pin_round(move, group, missing_blocks(move, group), final=True)

    def resume(self, move: Move) -> None:
        """Another round for a parked hand-off (its prefill computed more, or finished)."""
        if move.parked:
            self._next_round(move)

    def _send(self, move: Move, pinned: Round) -> None:
        """Start a round: the source's blocks (pinned already) exported, and blocks under the
        same hashes pinned on the target for the import that follows the export; the source's
        pinned snapshot, if any, goes into a slot taken for it there."""
        target_bm = move.target_engine.scheduler.block_manager
        transfer_id, blocks = pinned.transfer_id, pinned.blocks
        source_slot, state_key = pinned.state_slot, pinned.state_key
        _, target_slot = target_bm.transfers.allocate_pinned(
            transfer_id,
            [(h, n) for _, h, n in blocks],
            state_key if source_slot is not None else None,
        )
        move.import_state_slot = target_slot
        move.target_pins.append(transfer_id)
        move.transfer_id, move.exported = transfer_id, False
        move.round_started = time.monotonic()
        tracer = move.source.tracer
        request = move.trace or (tracer.get(move.request_id) if tracer is not None else None)
        move.span = start_transfer_span(
            transfer_id, move.source.address, move.target.address, len(blocks), move.cause, request
        )
        self._by_transfer[transfer_id] = move
        move.source_queue.export(
            transfer_id, [b for b, _, _ in blocks], source_slot if target_slot is not None else None
        )

    # -- prefix fetch (move_policy.maybe_fetch) --------------------------------------------

    def fetch(
        self, peer: Replica, target: Replica, snapshot: GroupSnapshot, trace: RequestTrace | None
    ) -> bool:
        if not self._can_take_part(snapshot.request_id, peer, target):
            return False
        assert peer.engine is not None and target.engine is not None
        blocks, state_key = cached_blocks(peer.engine, target.engine, snapshot.prompt_token_ids)
        target_bm = target.engine.scheduler.block_manager
        room = max(target_bm.get_num_free_gpu_blocks() - target_bm.watermark_blocks - 1, 0)
        if len(blocks) > room:
            blocks, state_key = blocks[:room], None  # the snapshot may lie past what fits
        if not blocks:
            return False
        move = self._new_move(
            snapshot.request_id, peer, target, FETCH, final=True, snapshot=snapshot, trace=trace
        )
        transfer_id = next(self._transfer_ids)
        peer_bm = peer.engine.scheduler.block_manager
        state_slot = peer_bm.transfers.pin(transfer_id, [b for b, _, _ in blocks], state_key)
        self._send(move, Round(transfer_id, blocks, state_slot, state_key))
        return True

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
                transfer_id,
                move.source.address,
                target_bm.transfers.pins[transfer_id],
                move.import_state_slot,
            )
        for transfer_id in news.imported:
            move = self._by_transfer.pop(transfer_id, None)
            if move is None or move.target is not replica:
                continue
            transfers = move.target_engine.scheduler.block_manager.transfers
            transfers.mark_imported(transfer_id)
            copied = len(transfers.pins[transfer_id])
            move.blocks_copied += copied
            self.rates.on_round(copied, time.monotonic() - move.round_started)
            self._release_source(move, transfer_id)
            move.transfer_id = None
            end_transfer_span(move.span, None)
            move.span = None
            if move.final and move.held is None:
                self._finish(move)
            else:
                self._next_round(move)
        for failure in news.failed:
            move = self._by_transfer.get(failure.transfer_id)
            if move is not None and move.target is replica:
                self._fail(move, failure)

    def on_engine_dropped(self, engine: LLMEngine) -> None:
        """A replica dropped `engine` (its worker lost, a failed step, drained): moves from or
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
        end_request_trace(move.trace, None)
        move.trace = None
        return True

    # -- endings ---------------------------------------------------------------------------------

    def _release_source(self, move: Move, transfer_id: int) -> None:
        if move.source.engine is move.source_engine:
            move.source_engine.scheduler.block_manager.transfers.unpin(transfer_id)
        move.source_queue.release(transfer_id)

    def _release_target(self, move: Move) -> None:
        alive = move.target.engine is move.target_engine
        for transfer_id in move.target_pins:
            if alive:
                move.target_engine.scheduler.block_manager.transfers.unpin(transfer_id)
        move.target_pins = []

    def _end(self, move: Move, error: str = "cancelled") -> None:
        self.moves.pop(move.request_id, None)
        held, move.held = move.held, None
        if held is not None and move.source.engine is move.source_engine:
            move.source_engine.scheduler.block_manager.transfers.unpin(held.transfer_id)
        if move.transfer_id is not None:
            self._by_transfer.pop(move.transfer_id, None)
        end_transfer_span(move.span, error)  # a round still in flight
        move.span = None
        self._release_target(move)

    def _finish(self, move: Move) -> None:
        """The last round is done: report the request, to be queued on the target, then let
        the target's pins go (the request's allocation finds the blocks by hash)."""
        self._end(move)
        snapshot, trace = move.snapshot, move.trace
        if snapshot is None:  # aborted meanwhile
            return
        seconds = time.monotonic() - move.started
        self.report(
            MoveFinished(
                move.source,
                move.target,
                snapshot,
                trace,
                move.cause,
                move.rounds,
                move.blocks_copied,
                seconds,
            )
        )

    def _fail(self, move: Move, failure: TransferFailure) -> None:
        """Fall back to recompute: release both sides, and report the request evicted from
        its source if it was stopped for its last round or is still on a draining source."""
        transfer_id = move.transfer_id
        if transfer_id is not None:
            move.target_queue.cancel_import(transfer_id)
            self._release_source(move, transfer_id)
        self._end(move, failure.reason)
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
            self.report(Evicted(move.source, [move.snapshot], traces, move.cause))


def record_landing(moved: MoveFinished[Replica], placed: bool) -> None:
    """A finished move's outcome, once the fleet has tried its target (`placed`: queued there,
    else placed elsewhere by recompute)."""
    metrics.KV_MIGRATIONS.labels("transfer" if placed else "fallback").inc()
    metrics.KV_MIGRATION_SECONDS.observe(moved.seconds)
    metrics.KV_MIGRATION_BLOCKS.inc(moved.blocks)
    log.info(
        "request moved with its KV blocks" if placed else "moved request placed elsewhere",
        request=moved.snapshot.request_id,
        from_worker=moved.source.address,
        to_worker=moved.target.address,
        rounds=moved.rounds,
        blocks=moved.blocks,
        seconds=round(moved.seconds, 4),
    )
