"""Which replica a request goes to.

The scheduler owns every replica's block tables and prefix-cache hashes, so it knows exactly
how much of a prompt each replica holds computed, not an estimate. The currency of every policy
is tokens of work ahead of the request's first token:

    cost(replica) = load + (prompt tokens - prompt tokens cached there) + shortfall

- load: prompt tokens still to compute on the replica's waiting and running groups, plus one
  token per running sequence (the decode it owes every step);
- shortfall: when the replica has fewer free blocks than the uncached prompt needs, the
  missing blocks in tokens (it would wait, or preempt, to admit the request).

A replica's load is computed over its queues at most once per scheduled step or change of
its requests (`SchedulerQueues.state_stamp`): it is O(sequences), and a fleet places requests
far more often than any one replica steps.

`cache_aware` (the default) minimises that cost; `least_loaded` minimises load alone;
`round_robin` takes the ready replicas in turn. Ties go to the replica with more free blocks,
then the lower id.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.sequence import SequenceStatus, chain_block_hash


class RoutingPolicy(StrEnum):
    CACHE_AWARE = "cache_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A ready replica as routing sees it."""

    replica_id: int
    engine: LLMEngine


@dataclass(frozen=True, slots=True)
class Decision:
    replica_id: int
    # Prompt tokens the chosen replica holds computed in its prefix cache.
    cached_tokens: int
    load_tokens: int


def load_tokens(engine: LLMEngine) -> int:
    """Tokens of work the replica owes before a new request's prefill (see the module doc)."""
    scheduler = engine.scheduler
    total = 0
    for queue in (scheduler.waiting, scheduler.running, scheduler.swapped):
        for group in queue:
            for seq in group.seqs:
                if seq.status < SequenceStatus.STOPPED:
                    total += max(len(seq.token_ids) - seq.num_computed_tokens, 1)
    return total


def cached_prefix_blocks(
    engine: LLMEngine, prompt: Sequence[int]
) -> tuple[int, list[tuple[int, int, int]]]:
    """The prompt's leading full blocks that every KV group of the replica's prefix cache
    serves computed, and (block id, key, hashed tokens) of the blocks such a hit reads
    (`PrefixHits.cached_prefix`)."""
    bm = engine.scheduler.block_manager
    if not bm.enable_caching:
        return 0, []
    return bm.prefix.cached_prefix(prompt_block_hashes(bm.block_size, prompt), len(prompt))


def prompt_block_hashes(block_size: int, prompt: Sequence[int]) -> list[int]:
    """The chain hashes of the prompt's full blocks (the prefix cache's names for them)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = chain_block_hash(parent, tuple(prompt[start : start + block_size]))
        hashes.append(parent)
    return hashes


def cached_prefix_tokens(engine: LLMEngine, prompt: Sequence[int]) -> int:
    """Leading prompt tokens whose full blocks the replica's prefix cache serves computed."""
    num_blocks, _ = cached_prefix_blocks(engine, prompt)
    return num_blocks * engine.scheduler.block_manager.block_size


class ReplicaChooser:
    """Chooses the replica for each placement under one policy."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self._turn = itertools.count()
        # Per replica: the engine, its state stamp and the load computed then.
        self._loads: dict[int, tuple[LLMEngine, tuple[int, int], int]] = {}

    def _load(self, candidate: Candidate) -> int:
        engine, stamp = candidate.engine, candidate.engine.scheduler.state_stamp
        memo = self._loads.get(candidate.replica_id)
        if memo is not None and memo[0] is engine and memo[1] == stamp:
            return memo[2]
        load = load_tokens(engine)
        self._loads[candidate.replica_id] = (engine, stamp, load)
        return load

    def pick(self, candidates: list[Candidate], prompt: Sequence[int]) -> Decision | None:
        if len(self._loads) > len(candidates):  # forget replicas that left (and their engines)
            ids = {c.replica_id for c in candidates}
            self._loads = {rid: memo for rid, memo in self._loads.items() if rid in ids}
        if not candidates:
            return None
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            chosen = candidates[next(self._turn) % len(candidates)]
            return Decision(chosen.replica_id, 0, self._load(chosen))
        best: tuple[tuple[int, int, int], Decision] | None = None
        for candidate in candidates:
            engine = candidate.engine
            load = self._load(candidate)
            free_blocks = engine.scheduler.block_manager.get_num_free_gpu_blocks()
            if self.policy is RoutingPolicy.LEAST_LOADED:
                cached, cost = 0, load
            else:
                cached = cached_prefix_tokens(engine, prompt)
                uncached = len(prompt) - cached
                bs = engine.cache_config.block_size
                shortfall = max(-(-uncached // bs) - free_blocks, 0) * bs
                cost = load + uncached + shortfall
            key = (cost, -free_blocks, candidate.replica_id)
            if best is None or key < best[0]:
                best = (key, Decision(candidate.replica_id, cached, load))
        assert best is not None
        return best[1]
