"""The step contract (steps.py) to and from worker.proto's ExecuteRequest / ExecuteResult.

These run once per scheduler iteration for up to a few hundred sequences, so they build
messages with `add(...)`/`extend` and read repeated scalars with `list(...)`, and do nothing
else. Per-sequence lists travel as ragged columns: one flat repeated field and the lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmserve.proto_convert import (
    add_prompt_logprobs,
    prompt_logprob_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from llmserve.proto_masks import add_masks, token_mask_from_proto
from llmserve.steps import (
    BlockExport,
    BlockImport,
    CachedSequence,
    Fork,
    NewSequence,
    SequenceOutput,
    StepInput,
    StepResult,
    TableEdit,
    TokenLogprob,
    TransferFailure,
)
from llmserve.v1 import worker_pb2

# --- ragged columns -------------------------------------------------------------------------


def _split(lengths: list[int], flat: list[Any]) -> list[list[Any]]:
    """Inverse of concatenation: the i-th list holds the next lengths[i] items of flat."""
    if len(flat) != sum(lengths):
        raise ValueError(f"ragged column has {len(flat)} items, its lengths sum to {sum(lengths)}")
    if lengths.count(1) == len(lengths):  # the decode case: one item each
        return [[x] for x in flat]
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


def _check_columns(what: str, columns: dict[str, int]) -> int:
    sizes = set(columns.values())
    if len(sizes) > 1:
        raise ValueError(f"{what}: per-sequence columns differ in length: {columns}")
    return sizes.pop() if sizes else 0


# --- step input -----------------------------------------------------------------------------


def _set_mapping(msg: worker_pb2.BlockMapping, pairs: Sequence[tuple[int, int]]) -> None:
    if pairs:
        msg.src.extend([src for src, _ in pairs])
        msg.dst.extend([dst for _, dst in pairs])


def _mapping(msg: worker_pb2.BlockMapping) -> list[tuple[int, int]]:
    if len(msg.src) != len(msg.dst):
        raise ValueError(f"block mapping has {len(msg.src)} sources but {len(msg.dst)} targets")
    return list(zip(msg.src, msg.dst, strict=True))


def _set_cached(msg: worker_pb2.CachedSequences, seqs: list[CachedSequence]) -> None:
    if not seqs:
        return
    msg.seq_ids.extend([c.seq_id for c in seqs])
    msg.num_new_tokens.extend([len(c.new_token_ids) for c in seqs])
    msg.new_token_ids.extend([t for c in seqs for t in c.new_token_ids])
    msg.block_offsets.extend([c.block_offset for c in seqs])
    msg.num_block_ids.extend([len(c.block_ids) for c in seqs])
    msg.block_ids.extend([b for c in seqs for b in c.block_ids])
    msg.num_scheduled_tokens.extend([c.num_scheduled_tokens for c in seqs])
    if any(c.draft_token_ids for c in seqs):
        msg.num_draft_tokens.extend([len(c.draft_token_ids) for c in seqs])
        msg.draft_token_ids.extend([t for c in seqs for t in c.draft_token_ids])
    if any(c.after_drafts for c in seqs):
        msg.after_drafts.extend([c.after_drafts for c in seqs])
    if seqs[0].group_edits:
        edits = [e for c in seqs for e in c.group_edits]
        msg.group_block_offsets.extend([e.offset for e in edits])
        msg.num_group_block_ids.extend([len(e.block_ids) for e in edits])
        msg.group_block_ids.extend([b for e in edits for b in e.block_ids])


def _cached(msg: worker_pb2.CachedSequences) -> list[CachedSequence]:
    n = _check_columns(
        "cached_seqs",
        {
            "seq_ids": len(msg.seq_ids),
            "num_new_tokens": len(msg.num_new_tokens),
            "block_offsets": len(msg.block_offsets),
            "num_block_ids": len(msg.num_block_ids),
            "num_scheduled_tokens": len(msg.num_scheduled_tokens),
        },
    )
    if n == 0:
        return []
    new_tokens = _split(list(msg.num_new_tokens), list(msg.new_token_ids))
    if msg.block_ids:
        block_ids = _split(list(msg.num_block_ids), list(msg.block_ids))
    else:
        block_ids = [[] for _ in range(n)]
    seqs = list(
        map(
            CachedSequence,
            msg.seq_ids,
            new_tokens,
            msg.block_offsets,
            block_ids,
            msg.num_scheduled_tokens,
        )
    )
    if msg.num_draft_tokens or msg.draft_token_ids:
        _check_columns("cached_seqs", {"seq_ids": n, "num_draft_tokens": len(msg.num_draft_tokens)})
        drafts = _split(list(msg.num_draft_tokens), list(msg.draft_token_ids))
        for seq, seq_drafts in zip(seqs, drafts, strict=True):
            seq.draft_token_ids = seq_drafts
    if msg.after_drafts:
        _check_columns("cached_seqs", {"seq_ids": n, "after_drafts": len(msg.after_drafts)})
        for seq, after in zip(seqs, msg.after_drafts, strict=True):
            seq.after_drafts = after
    if msg.group_block_offsets:
        rows = _check_columns(
            "cached_seqs",
            {
                "group_block_offsets": len(msg.group_block_offsets),
                "num_group_block_ids": len(msg.num_group_block_ids),
            },
        )
        if rows % n:
            raise ValueError(
                f"cached_seqs: {rows} group table edits for {n} sequences (not a multiple)"
            )
        per_seq = rows // n
        ids = _split(list(msg.num_group_block_ids), list(msg.group_block_ids))
        edits = list(map(TableEdit, msg.group_block_offsets, ids))
        for i, seq in enumerate(seqs):
            seq.group_edits = edits[i * per_seq : (i + 1) * per_seq]
    return seqs


def step_input_to_proto(step: StepInput) -> worker_pb2.ExecuteRequest:
    msg = worker_pb2.ExecuteRequest(step_id=step.step_id, freed_seq_ids=step.freed_seq_ids)
    for s in step.new_seqs:
        msg.new_seqs.add(
            seq_id=s.seq_id,
            request_id=s.request_id,
            seq_index=s.seq_index,
            token_ids=s.token_ids,
            num_prompt_tokens=s.num_prompt_tokens,
            num_computed_tokens=s.num_computed_tokens,
            block_ids=s.block_ids,
            group_tables=[worker_pb2.BlockTable(block_ids=t) for t in s.group_block_ids],
            num_scheduled_tokens=s.num_scheduled_tokens,
            sampling_params=sampling_params_to_proto(s.sampling_params),
            state_slot=s.state_slot,
            state_from_slot=s.state_from_slot,
        )
    _set_cached(msg.cached_seqs, step.cached_seqs)
    for f in step.forks:
        msg.forks.add(
            parent_seq_id=f.parent_seq_id,
            child_seq_id=f.child_seq_id,
            child_seq_index=f.child_seq_index,
            child_state_slot=f.child_state_slot,
        )
    _set_mapping(msg.state_saves, step.state_saves)
    _set_mapping(msg.states_to_swap_out, step.states_to_swap_out)
    _set_mapping(msg.states_to_swap_in, step.states_to_swap_in)
    _set_mapping(msg.blocks_to_swap_out, step.blocks_to_swap_out)
    _set_mapping(msg.blocks_to_swap_in, step.blocks_to_swap_in)
    _set_mapping(msg.blocks_to_copy, step.blocks_to_copy)
    add_masks(msg.token_masks, step.token_masks)
    if step.deferred_mask_seq_ids:
        msg.deferred_mask_seq_ids.extend(step.deferred_mask_seq_ids)
    if step.released_transfer_ids:
        msg.released_transfer_ids.extend(step.released_transfer_ids)
    for e in step.exports:
        msg.exports.add(transfer_id=e.transfer_id, block_ids=e.block_ids, state_slot=e.state_slot)
    for i in step.imports:
        msg.imports.add(
            transfer_id=i.transfer_id, peer=i.peer, block_ids=i.block_ids, state_slot=i.state_slot
        )
    return msg


def step_input_from_proto(msg: worker_pb2.ExecuteRequest) -> StepInput:
    """Raises ValueError when the columns are inconsistent (a malformed request)."""
    return StepInput(
        step_id=msg.step_id,
        new_seqs=[
            NewSequence(
                seq_id=s.seq_id,
                request_id=s.request_id,
                seq_index=s.seq_index,
                token_ids=list(s.token_ids),
                num_prompt_tokens=s.num_prompt_tokens,
                num_computed_tokens=s.num_computed_tokens,
                block_ids=list(s.block_ids),
                num_scheduled_tokens=s.num_scheduled_tokens,
                sampling_params=sampling_params_from_proto(s.sampling_params),
                group_block_ids=[list(t.block_ids) for t in s.group_tables],
                state_slot=s.state_slot if s.HasField("state_slot") else None,
                state_from_slot=s.state_from_slot if s.HasField("state_from_slot") else None,
            )
            for s in msg.new_seqs
        ],
        cached_seqs=_cached(msg.cached_seqs),
        forks=[
            Fork(
                f.parent_seq_id,
                f.child_seq_id,
                f.child_seq_index,
                f.child_state_slot if f.HasField("child_state_slot") else None,
            )
            for f in msg.forks
        ],
        freed_seq_ids=list(msg.freed_seq_ids),
        blocks_to_swap_out=_mapping(msg.blocks_to_swap_out),
        blocks_to_swap_in=_mapping(msg.blocks_to_swap_in),
        blocks_to_copy=_mapping(msg.blocks_to_copy),
        state_saves=_mapping(msg.state_saves),
        states_to_swap_out=_mapping(msg.states_to_swap_out),
        states_to_swap_in=_mapping(msg.states_to_swap_in),
        token_masks=[token_mask_from_proto(m) for m in msg.token_masks],
        deferred_mask_seq_ids=list(msg.deferred_mask_seq_ids),
        released_transfer_ids=list(msg.released_transfer_ids),
        exports=[
            BlockExport(
                e.transfer_id, list(e.block_ids), e.state_slot if e.HasField("state_slot") else None
            )
            for e in msg.exports
        ],
        imports=[
            BlockImport(
                i.transfer_id,
                i.peer,
                list(i.block_ids),
                i.state_slot if i.HasField("state_slot") else None,
            )
            for i in msg.imports
        ],
    )


# --- step result ----------------------------------------------------------------------------


def _set_outputs(msg: worker_pb2.SequenceOutputs, outputs: list[SequenceOutput]) -> None:
    if not outputs:
        return
    msg.seq_ids.extend([o.seq_id for o in outputs])
    msg.num_samples.extend([len(o.samples) for o in outputs])
    samples = [t for o in outputs for t in o.samples]
    msg.sample_token_ids.extend([t.token_id for t in samples])
    msg.sample_logprobs.extend([t.logprob for t in samples])
    msg.sample_ranks.extend([t.rank for t in samples])
    top = [t for o in outputs for t in o.top_logprobs]
    if top:
        msg.num_top_logprobs.extend([len(o.top_logprobs) for o in outputs])
        msg.top_token_ids.extend([t.token_id for t in top])
        msg.top_logprobs.extend([t.logprob for t in top])
        msg.top_ranks.extend([t.rank for t in top])


def _token_logprob_column(ids: Any, logprobs: Any, ranks: Any) -> list[TokenLogprob]:
    if not len(ids) == len(logprobs) == len(ranks):
        raise ValueError("token id, logprob and rank columns differ in length")
    return list(map(TokenLogprob, ids, logprobs, ranks))


def _outputs(msg: worker_pb2.SequenceOutputs) -> list[SequenceOutput]:
    n = _check_columns(
        "outputs", {"seq_ids": len(msg.seq_ids), "num_samples": len(msg.num_samples)}
    )
    if n == 0:
        return []
    samples = _split(
        list(msg.num_samples),
        _token_logprob_column(msg.sample_token_ids, msg.sample_logprobs, msg.sample_ranks),
    )
    if msg.num_top_logprobs:
        _check_columns("outputs", {"seq_ids": n, "num_top_logprobs": len(msg.num_top_logprobs)})
        top = _split(
            list(msg.num_top_logprobs),
            _token_logprob_column(msg.top_token_ids, msg.top_logprobs, msg.top_ranks),
        )
    else:
        top = [[] for _ in range(n)]
    return [SequenceOutput(i, s, t) for i, s, t in zip(msg.seq_ids, samples, top, strict=True)]


def step_result_to_proto(result: StepResult) -> worker_pb2.ExecuteResult:
    msg = worker_pb2.ExecuteResult(
        step_id=result.step_id,
        forward_ns=result.forward_ns,
        sample_ns=result.sample_ns,
        mask_wait_ns=result.mask_wait_ns,
        imported_transfer_ids=result.imported_transfer_ids,
    )
    for f in result.failed_imports:
        msg.failed_imports.add(transfer_id=f.transfer_id, reason=f.reason)
    _set_outputs(msg.outputs, result.outputs)
    for o in result.outputs:
        if o.prompt_logprobs:
            entry = msg.prompt_logprobs.add(seq_id=o.seq_id)
            add_prompt_logprobs(entry.prompt_logprobs, o.prompt_logprobs)
    return msg


def step_result_from_proto(msg: worker_pb2.ExecuteResult) -> StepResult:
    """Raises ValueError when the columns are inconsistent (a malformed result)."""
    outputs = _outputs(msg.outputs)
    if msg.prompt_logprobs:
        by_seq = {o.seq_id: o for o in outputs}
        for entry in msg.prompt_logprobs:
            if entry.seq_id not in by_seq:
                raise ValueError(f"prompt logprobs for seq {entry.seq_id}, which has no output")
            by_seq[entry.seq_id].prompt_logprobs = [
                prompt_logprob_from_proto(p) for p in entry.prompt_logprobs
            ]
    return StepResult(
        step_id=msg.step_id,
        outputs=outputs,
        forward_ns=msg.forward_ns,
        sample_ns=msg.sample_ns,
        mask_wait_ns=msg.mask_wait_ns,
        imported_transfer_ids=list(msg.imported_transfer_ids),
        failed_imports=[TransferFailure(f.transfer_id, f.reason) for f in msg.failed_imports],
    )
