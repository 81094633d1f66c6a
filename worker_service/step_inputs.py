"""What a step's forward pass reads, as the model runner prepares it from the scheduled
sequences: the tensors and metadata (`PreparedInputs`), and the block tables and state slots
they are built from, checked before any kernel indexes the cache with them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_service.attention.base import AttentionMetadata
from worker_service.linear_state import StateMetadata
from worker_service.sequence_state import Scheduled, SequenceState, StateError


def state_slot(state: SequenceState) -> int:
    """The state slot of a sequence of a model with recurrent layers."""
    assert state.state_slot is not None, f"seq {state.seq_id} has no state slot"
    return state.state_slot


def block_table(state: SequenceState, group: int) -> list[int]:
    """KV group `group`'s block table of a sequence."""
    return state.block_ids if group == 0 else state.group_tables[group - 1]


def check_block_ids(
    tables: np.ndarray, states: list[SequenceState], group: int, num_blocks: int
) -> None:
    """The kernels index the cache with these ids unchecked: a bad one must stop here."""
    if tables.size and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        bad = next(
            (s.seq_id, b) for s in states for b in block_table(s, group) if not 0 <= b < num_blocks
        )
        raise StateError(
            f"seq {bad[0]}: block id {bad[1]} is outside the cache ({num_blocks} blocks)"
        )


@dataclass(slots=True)
class PreparedInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata  # KV group 0's
    logit_rows: torch.Tensor  # [num_logit_rows] int64
    sample_items: list[tuple[Scheduled, int, int]]  # (seq, logits row, position)
    prompt_items: list[tuple[Scheduled, int, int, int]]
    # One per KV group (the first is `metadata`): the same step, each group's tables and slots.
    metadatas: list[AttentionMetadata]
    # The recurrent layers' inputs (None: the model has none).
    states: StateMetadata | None = None


def pad_tables(tables: list[list[int]]) -> np.ndarray:  # [num_seqs, max_blocks] int64
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out
