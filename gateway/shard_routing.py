"""Which scheduler shard a request goes to: by its prompt's prefix, within a bound on load.

Each shard owns its own workers and their prefix caches, so requests that share a prefix (a
system prompt, few-shot examples) should land on the same shard, where the scheduler's
cache-aware routing finds the worker that holds it. A shard's preference order for a request
is rendezvous hashing of the prompt's first `PREFIX_TOKENS` tokens with each shard's address:
every gateway computes the same order without talking to the others, and a lost shard moves
only its own share of the prefixes. Load bounds the choice ("consistent hashing with bounded
loads", Mirrokni, Thorup and Zadimoghaddam, 2018): the request takes the first shard in its
order whose requests in flight from this gateway, this one included, stay within
`LOAD_BOUND` times the mean, so a hot prefix spills over instead of saturating one shard.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

# Tokens of the prompt that choose its shard: past a chat template's header and into the
# system prompt, short of the question that follows it.
PREFIX_TOKENS = 64
# A shard may hold up to this many times the mean of the shards' requests in flight.
LOAD_BOUND = 1.25


def prefix_key(prompt_token_ids: Sequence[int], tokens: int = PREFIX_TOKENS) -> bytes:
    """The bytes that place a prompt: its first `tokens` token ids."""
    return b"".join(t.to_bytes(4, "little") for t in prompt_token_ids[:tokens])


def preference(key: bytes, shards: Sequence[str]) -> list[str]:
    """`shards` in the order `key` prefers them (rendezvous hashing: highest score first)."""

    def score(shard: str) -> bytes:
        return hashlib.blake2b(key + b"\0" + shard.encode(), digest_size=8).digest()

    return sorted(shards, key=score, reverse=True)


def pick_shard(key: bytes, loads: Mapping[str, int], bound: float = LOAD_BOUND) -> str | None:
    """The shard for a new request among `loads` (shard -> requests in flight there); None
    when there is no shard. The cap, ceil(bound * mean with the new request), is at least the
    mean, so some shard is always under it."""
    if not loads:
        return None
    cap = math.ceil(bound * (sum(loads.values()) + 1) / len(loads))
    for shard in preference(key, list(loads)):
        if loads[shard] + 1 <= cap:
            return shard
    raise AssertionError("unreachable: the least loaded shard is under the cap")
