"""Beam search selection for one sequence group, after a step sampled its beams.

The worker returns, per running beam, its 2 * beam_width best next tokens. Here the group
keeps the 2 * beam_width best (beam, token) extensions overall, by cumulative logprob; the
finished ones compete for the beam_width best finished slots by length-penalised score; the
best beam_width unfinished ones continue unless early stopping says no running beam can
beat the finished ones. Continuing extensions fork from their parent beam (the parent itself
carries its best extension); beams with no continuing extension are freed.
"""

from __future__ import annotations

import itertools

from llmserve.steps import SequenceOutput, TokenLogprob
from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import WorkerEvents
from scheduler_service.engine.sequence import (
    SampleLogprobs,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)


def _stop_early(
    seq_group: SequenceGroup,
    finished: list[Sequence],
    best_running: Sequence,
) -> bool:
    """Whether no running beam can still beat the worst of the beam_width finished ones."""
    params = seq_group.sampling_params
    if len(finished) < params.num_sampled:
        return False
    if params.early_stopping is True:
        return True
    lp = params.length_penalty
    worst_finished = min(s.beam_score(lp) for s in finished)
    if params.early_stopping == "never" and lp > 0.0:
        # The longest possible continuation gives the best score a negative sum can reach.
        best_possible = best_running.beam_score(lp, length=params.max_tokens)
    else:
        best_possible = best_running.beam_score(lp)
    return worst_finished >= best_possible


def _append(
    seq: Sequence, token: TokenLogprob, top: list[TokenLogprob], keep_logprobs: bool
) -> None:
    if keep_logprobs:
        seq.append_sample(SampleLogprobs(token, top))
    else:
        seq.append_token(token)


def process_beam_group(
    seq_group: SequenceGroup,
    sampled: list[tuple[Sequence, SequenceOutput]],
    scheduler: Scheduler,
    events: WorkerEvents,
    seq_counter: itertools.count[int],
    max_model_len: int,
) -> None:
    """Select the group's beams after a step; forks and frees go to `events`."""
    params = seq_group.sampling_params
    beam_width = params.num_sampled
    lp = params.length_penalty
    keep_logprobs = params.logprobs is not None

    old_finished = seq_group.get_finished_seqs()
    candidates: list[tuple[float, int, int, Sequence, TokenLogprob, list[TokenLogprob]]] = []
    for parent_rank, (parent, out) in enumerate(sampled):
        for cand_rank, sample in enumerate(out.samples):
            score = parent.cumulative_logprob + sample.logprob
            candidates.append((score, parent_rank, cand_rank, parent, sample, out.top_logprobs))
    # Best first; ties keep the worker's order (parent order, then candidate rank).
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    candidates = candidates[: 2 * beam_width]

    # Extensions: the first one of each parent reuses the parent, the others are new children
    # (forked from the parent's tokens before the parent appends its own).
    extensions: list[tuple[Sequence, Sequence]] = []  # (extension, parent)
    parent_ext: dict[int, tuple[TokenLogprob, list[TokenLogprob]]] = {}
    for _, _, _, parent, sample, top in candidates:
        if parent.seq_id not in parent_ext:
            parent_ext[parent.seq_id] = (sample, top)
            continue
        child = parent.fork(next(seq_counter), seq_group.next_seq_index)
        seq_group.next_seq_index += 1
        _append(child, sample, top, keep_logprobs)
        child.check_stop(params, max_model_len)
        extensions.append((child, parent))
    for parent, _ in sampled:
        ext = parent_ext.get(parent.seq_id)
        if ext is not None:
            _append(parent, *ext, keep_logprobs)
            parent.check_stop(params, max_model_len)
            extensions.append((parent, parent))

    def beam_key(seq: Sequence) -> float:
        return seq.beam_score(lp)

    # Finished beams: keep the beam_width best of the old and new ones.
    new_finished = [(s, p) for s, p in extensions if s.is_finished()]
    ranked = sorted(old_finished + [s for s, _ in new_finished], key=beam_key, reverse=True)
    kept_finished = ranked[:beam_width]
    dropped: list[Sequence] = ranked[beam_width:]
    dropped.extend(p for p, _ in sampled if p.seq_id not in parent_ext)

    running = sorted(
        ((s, p) for s, p in extensions if not s.is_finished()),
        key=lambda sp: sp[0].cumulative_logprob,
        reverse=True,
    )
    stop = True if not running else _stop_early(seq_group, kept_finished, running[0][0])
    selected = [] if stop else running[:beam_width]
    dropped.extend(s for s, _ in (running if stop else running[beam_width:]))

    kept_ids = {s.seq_id for s in kept_finished} | {s.seq_id for s, _ in selected}
    # Fork the selected children before any parent is freed: they share its blocks.
    for seq, parent in new_finished + selected:
        if seq is not parent and seq.seq_id in kept_ids:
            seq_group.add(seq)
            if not seq.is_finished():
                scheduler.fork_seq(parent, seq, events.forks)
    for seq in dropped:
        if seq.status < SequenceStatus.STOPPED:
            seq.status = SequenceStatus.ABORTED
        scheduler.free_seq(seq, events.freed_seq_ids)
        seq_group.remove(seq.seq_id)
    for seq in kept_finished:
        scheduler.free_seq(seq, events.freed_seq_ids)
