"""When requests move with their KV blocks (`scheduler_service.fleet.kv_mover` does the moving):

- a drain moves a replica's running requests at once (`drain_moves`, `Replica.drain`);
- a prefill worker hands each request to a decode worker, its blocks copied as its prefill
  computes them, and stops it once its first token is out (`after_step`, `hand_off`, `roles`);
- a request about to be queued where little of its prompt is cached first fetches a longer
  cached prefix from another replica, when copying it costs less time than computing it
  (`maybe_fetch`, `--prefix-fetch-min-tokens`).

The fleet calls these as its replicas report (`DrainStep`, `StepDone`) and as it places
requests; where a move needs a target, the fleet hands in its routing (`PickTarget`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.sequence import SequenceStatus
from scheduler_service.engine.snapshots import GroupSnapshot
from scheduler_service.fleet.kv_mover import KvMover
from scheduler_service.fleet.placement import cached_prefix_tokens
from scheduler_service.fleet.replica_events import StepDone
from scheduler_service.fleet.roles import PREFILL, role
from scheduler_service.fleet.tracing import RequestTrace

if TYPE_CHECKING:
    from scheduler_service.fleet.replica import Replica

# The ready replica (not the given source) that the fleet's routing would move `prompt` to.
PickTarget = Callable[["Replica", list[int]], "Replica | None"]


def drain_moves(
    moves: KvMover, replica: Replica, engine: LLMEngine, late: bool, pick_target: PickTarget
) -> list[str]:
    """Between steps of a draining replica: start moving its running requests that are not
    moving yet (unless `--drain-migration recompute`); returns the requests that move by
    recompute now: waiting and swapped ones, and once `late` (the grace period over) every one
    not in a move."""
    scheduler = engine.scheduler
    if moves.enabled:
        for group in list(scheduler.running):
            key = group.request_id
            if key not in moves.moves:
                target = pick_target(replica, group.prompt_token_ids)
                if target is not None:
                    moves.start(replica, target, key, "drain")
    if late:
        keys = engine.unfinished_request_ids()
    else:
        keys = [g.request_id for q in (scheduler.waiting, scheduler.swapped) for g in q]
    return [key for key in keys if key not in moves.moves]


def after_step(moves: KvMover, step: StepDone[Replica], pick_target: PickTarget) -> None:
    """After each finished step of a replica: the mover takes its transfer news and timing,
    then, on a prefill worker, the requests whose first token is out are handed off."""
    replica = step.replica
    moves.after_step(replica, step.news, step.tokens, step.seconds)
    if role(replica) == PREFILL and replica.engine is not None:
        hand_off(moves, replica, replica.engine, pick_target)


def hand_off(moves: KvMover, replica: Replica, engine: LLMEngine, pick_target: PickTarget) -> None:
    """On a prefill worker, after each step: move each running request to a decode worker,
    its prompt's blocks copied chunk by chunk as its prefill computes them; once every running
    sequence has its first token it stops here, the rest is copied, and it decodes there."""
    for move in [m for m in moves.moves.values() if m.source is replica]:
        if move.parked:
            moves.resume(move)
        else:
            moves.stop_if_prefilled(move)
    for group in list(engine.scheduler.running):
        key = group.request_id
        if key in moves.moves or not group.get_seqs(SequenceStatus.RUNNING):
            continue
        target = pick_target(replica, group.prompt_token_ids)
        if target is not None and role(target) != PREFILL:
            moves.start(replica, target, key, "prefill_done", until_prefilled=True)


def maybe_fetch(
    moves: KvMover,
    peers: list[Replica],
    target: Replica,
    target_cached: int,
    snapshot: GroupSnapshot,
    trace: RequestTrace | None,
    min_tokens: int,
) -> bool:
    """For a request about to be queued on `target` (which holds `target_cached` of its
    prompt's tokens): when one of `peers` holds at least `min_tokens` more of the prompt
    computed, and the measured rates say copying them takes less time than computing them
    (`kv_move.Rates`), copy them to `target` and queue the request there once they arrive.
    True if a fetch started (the request belongs to the move then)."""
    prompt = snapshot.prompt_token_ids
    if not min_tokens or len(prompt) - target_cached < min_tokens:
        return False
    best, best_cached = None, target_cached
    for peer in peers:
        if peer is not target and peer.engine is not None:
            cached = cached_prefix_tokens(peer.engine, prompt)
            if cached > best_cached:
                best, best_cached = peer, cached
    gain = best_cached - target_cached
    if best is None or gain < min_tokens:
        return False
    if not moves.rates.copy_beats_compute(gain // target.block_size, gain):
        return False
    return moves.fetch(best, target, snapshot, trace)
