"""Small factories for scheduler tests."""

from __future__ import annotations

import itertools

from scheduler_service.engine import SamplingParams, Sequence, SequenceGroup

_ids = itertools.count(1000)


def make_seq_group(
    request_id: str,
    prompt: list[int],
    block_size: int = 4,
    seq_id: int | None = None,
    params: SamplingParams | None = None,
    arrival_time: float = 0.0,
) -> SequenceGroup:
    seq = Sequence(next(_ids) if seq_id is None else seq_id, prompt, block_size)
    return SequenceGroup(request_id, [seq], params or SamplingParams(), arrival_time)


def decode(bm, seq_group: SequenceGroup, token_id: int) -> list[tuple[int, int]]:
    """Mark every running sequence's tokens computed, append one token, append slots."""
    copies = []
    for seq in seq_group.get_seqs():
        seq.num_computed_tokens = seq.get_len()
        seq.append_token_id(token_id, {token_id: -1.0})
        copies += bm.append_slots(seq)
    return copies
