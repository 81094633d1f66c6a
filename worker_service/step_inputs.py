"""What a step's forward pass reads, as the model runner prepares it from the scheduled
sequences: the tensors and metadata (`PreparedInputs`), and the block tables and state slots
they are built from, checked before any kernel indexes the cache with them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from worker_service.attention.base import AttentionMetadata
from worker_service.linear_state import DraftRows, StateMetadata
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


@dataclass(frozen=True, slots=True)
class InputGeometry:
    """What a step's inputs are laid out by: the cache's block size and KV groups, whether
    sequences hold recurrent state slots, and where the tensors go."""

    block_size: int
    num_groups: int
    num_state_slots: int
    device: torch.device


def prepare_inputs(
    layout: list[Scheduled], num_blocks: int, geometry: InputGeometry
) -> PreparedInputs:
    """The step's model inputs: `layout` prefill-first, its rows and where their logits
    sample."""
    if all(s.is_decode and s.samples for s in layout) and not any(
        s.state.params.prompt_logprobs is not None for s in layout
    ):
        return _prepare_decodes(layout, num_blocks, geometry)
    bs = geometry.block_size
    n_pre = sum(not s.is_decode for s in layout)  # layout is prefill-first
    # (sequence, first position, count) per part: a prefill chunk is one part, a decode
    # row computes one position (a sequence with drafts has a row for each).
    parts = [(s, s.start, s.count) for s in layout[:n_pre]]
    parts += [(s, p, 1) for s in layout[n_pre:] for p in range(s.start, s.start + s.count)]
    counts = np.array([c for _, _, c in parts], dtype=np.int64)
    starts = np.array([p for _, p, _ in parts], dtype=np.int64)
    ends = starts + counts
    # Positions: per part arange(start, end), concatenated without a Python loop.
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    num_tokens = int(counts.sum())
    positions = np.arange(num_tokens) - np.repeat(offsets - starts, counts)
    input_ids = np.fromiter(
        (t for s, p, c in parts for t in s.state.token_ids[p : p + c]),
        dtype=np.int64,
        count=num_tokens,
    )
    seq_of_token = np.repeat(np.arange(len(parts)), counts)
    group_tables = []  # per KV group: [num_parts, max_blocks] int64
    group_slots = []  # per KV group: [num_tokens] int64
    for g in range(geometry.num_groups):
        tables = pad_tables([block_table(s.state, g)[: -(-(p + c) // bs)] for s, p, c in parts])
        check_block_ids(tables, [s.state for s in layout], g, num_blocks)
        group_tables.append(tables)
        group_slots.append(tables[seq_of_token, positions // bs] * bs + positions % bs)
    tables, slots = group_tables[0], group_slots[0]

    logit_rows: list[int] = []
    sample_items: list[tuple[Scheduled, int, int]] = []  # (seq, logits row, position)
    prompt_items: list[tuple[Scheduled, int, int, int]] = []  # (seq, first row, n, first pos)
    for (s, start, count), offset in zip(parts, offsets.tolist(), strict=True):
        # Prompt logprobs come from the first prefill only, not from a recompute.
        first_prefill = len(s.state.token_ids) == s.state.num_prompt_tokens
        if s.state.params.prompt_logprobs is not None and first_prefill:
            last = min(start + count, s.state.num_prompt_tokens - 1)
            if last > start:
                n = last - start
                prompt_items.append((s, len(logit_rows), n, start + 1))
                logit_rows.extend(range(offset, offset + n))
        position = start + count - 1
        if s.samples and position in s.rows():
            sample_items.append((s, len(logit_rows), position))
            logit_rows.append(offset + count - 1)

    device = geometry.device

    def tensor(a: np.ndarray | list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)

    pre_counts, pre_starts = counts[:n_pre], starts[:n_pre]
    metadata = AttentionMetadata(
        num_prefills=n_pre,
        num_prefill_tokens=int(pre_counts.sum()),
        num_decodes=len(parts) - n_pre,
        slot_mapping=tensor(slots, torch.int64),
        prefill_query_start_loc=tensor(np.concatenate(([0], np.cumsum(pre_counts)))),
        prefill_query_lens=tensor(pre_counts),
        prefill_context_lens=tensor(pre_starts),
        prefill_seq_lens=tensor(ends[:n_pre]),
        prefill_block_tables=tensor(tables[:n_pre]),
        max_prefill_query_len=int(pre_counts.max(initial=0)),
        max_prefill_seq_len=int(ends[:n_pre].max(initial=0)),
        prefill_no_context=not bool(pre_starts.any()),
        decode_seq_lens=tensor(ends[n_pre:]),
        decode_block_tables=tensor(tables[n_pre:]),
        max_decode_seq_len=int(ends[n_pre:].max(initial=0)),
        block_size=bs,
    )
    metadatas = [metadata] + [
        replace(
            metadata,
            slot_mapping=tensor(group_slots[g], torch.int64),
            prefill_block_tables=tensor(group_tables[g][:n_pre]),
            decode_block_tables=tensor(group_tables[g][n_pre:]),
        )
        for g in range(1, geometry.num_groups)
    ]
    states = None
    if geometry.num_state_slots:
        states = StateMetadata(
            num_prefills=n_pre,
            num_decodes=len(parts) - n_pre,
            query_start_loc=tensor(np.concatenate(([0], np.cumsum(counts)))),
            state_slots=tensor([state_slot(s.state) for s, _, _ in parts]),
            has_initial_state=tensor(starts > 0, torch.bool),
            draft_rows=DraftRows.build(
                [(state_slot(s.state), p - s.start) for s, p, _ in parts[n_pre:]], device
            ),
        )
    return PreparedInputs(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        metadata=metadata,
        metadatas=metadatas,
        logit_rows=tensor(logit_rows, torch.int64),
        sample_items=sample_items,
        prompt_items=prompt_items,
        states=states,
    )


def _prepare_decodes(
    layout: list[Scheduled], num_blocks: int, geometry: InputGeometry
) -> PreparedInputs:
    """`prepare_inputs` for a step of decodes only, each sampling (at each of its drafts too):
    the same inputs from plain lists (a few sequences cost microseconds here, numpy's
    set-up more)."""
    bs = geometry.block_size
    rows = [(s, p) for s in layout for p in s.rows()]
    positions = [p for _, p in rows]
    device = geometry.device
    n = len(rows)
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device)
    metadatas = []
    for g in range(geometry.num_groups):
        tables = [block_table(s.state, g)[: p // bs + 1] for s, p in rows]
        for (s, _), table in zip(rows, tables, strict=True):
            if min(table) < 0 or max(table) >= num_blocks:
                bad = next(b for b in table if not 0 <= b < num_blocks)
                raise StateError(
                    f"seq {s.state.seq_id}: block id {bad} is outside the cache "
                    f"({num_blocks} blocks)"
                )
        width = max(len(t) for t in tables)
        metadatas.append(
            AttentionMetadata.for_decodes(
                slot_mapping=torch.tensor(
                    [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)],
                    dtype=torch.int64,
                    device=device,
                ),
                seq_lens=seq_lens,
                block_tables=torch.tensor(
                    [t + [0] * (width - len(t)) for t in tables],
                    dtype=torch.int32,
                    device=device,
                ),
                max_seq_len=max(positions) + 1,
                block_size=bs,
            )
        )
    metadata = metadatas[0]
    states = None
    if geometry.num_state_slots:
        slots = [state_slot(s.state) for s, _ in rows]
        states = StateMetadata(
            num_prefills=0,
            num_decodes=n,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
            has_initial_state=torch.ones(n, dtype=torch.bool, device=device),
            draft_rows=DraftRows.build(
                [(slot, p - s.start) for slot, (s, p) in zip(slots, rows, strict=True)],
                device,
            ),
        )
    return PreparedInputs(
        input_ids=torch.tensor(
            [s.state.token_ids[p] for s, p in rows], dtype=torch.int64, device=device
        ),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        metadata=metadata,
        logit_rows=torch.arange(n, device=device),
        metadatas=metadatas,
        sample_items=[(s, i, p) for i, (s, p) in enumerate(rows)],
        prompt_items=[],
        states=states,
    )
