"""Turning a worker's sampled tokens into sequence updates and request deltas.

`OutputProcessor.process` appends sampled tokens, forks n > 1 children at the first sample,
runs beam search selection, applies stops (`Sequence.check_stop`: tokens, stop strings,
lengths), frees finished sequences, and emits one `RequestOutput` delta per request that has
something new. The forks and frees it made go back to the engine in `WorkerEvents`, for the
next step's diff.
"""

from __future__ import annotations

import itertools
import time

from llmserve.grammar.backend import GrammarError
from llmserve.sampling_params import SamplingParams
from llmserve.steps import PromptLogprob, SequenceOutput, StepResult, TokenLogprob
from scheduler_service.engine.beam_search import process_beam_group
from scheduler_service.engine.request_output import CompletionOutput, RequestOutput, final_output
from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs, WorkerEvents
from scheduler_service.engine.sequence import (
    FINISH_REASONS,
    FinishReason,
    SampleLogprobs,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

_RUNNING = SequenceStatus.RUNNING


def _runs(result: StepResult, drafts: dict[int, list[int]]) -> dict[int, list[SequenceOutput]]:
    """The outputs of each sequence that had drafts, in order (one per token produced)."""
    runs: dict[int, list[SequenceOutput]] = {}
    for out in result.outputs:
        if out.seq_id in drafts:
            runs.setdefault(out.seq_id, []).append(out)
    return runs


class WorkerOutputError(RuntimeError):
    """The worker's StepResult does not match the step (a missing or malformed sample)."""


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, seq_counter: itertools.count[int]) -> None:
        self.scheduler = scheduler
        self.seq_counter = seq_counter
        self.max_model_len = scheduler.scheduler_config.model_len
        self.force_tokens = scheduler.scheduler_config.enable_forced_tokens
        self._events = WorkerEvents()
        # Tokens the last `process` appended from samples, kept drafts included (a
        # continuation step's outputs for sequences that finished meanwhile are dropped, and
        # not counted).
        self.num_generated = 0
        # Draft tokens the last `process` kept (speculative decoding).
        self.num_accepted_drafts = 0
        # Tokens appended because the grammar forced them (structured output), in total.
        self.num_forced_tokens = 0
        # Tokens each sequence gained in this step beyond its sample (forced ones).
        self._num_forced: dict[int, int] = {}

    def _append_forced(self, seq: Sequence, params: SamplingParams) -> int:
        """Append the tokens the grammar allows as the only continuation of a running
        constrained sequence: they are inputs of its next step, not samples (logprob 0, rank
        1: certain under the grammar). Returns how many; each goes through `check_stop`.

        Only single-sequence requests get forced tokens: siblings (n > 1, best_of, beam
        search) run in lockstep, one chunk size per group, so they must stay equally long."""
        grammar = seq.grammar
        if grammar is None or not self.force_tokens or seq.status != _RUNNING:
            return 0
        try:
            forced = grammar.forced_tokens()
        except GrammarError:
            return 0
        keep_logprobs = params.logprobs is not None
        count = 0
        for token_id in forced:
            token = TokenLogprob(token_id, 0.0, 1)
            if keep_logprobs:
                seq.append_sample(SampleLogprobs(token))
            else:
                seq.append_token(token)
            count += 1
            seq.check_stop(params, self.max_model_len)
            if seq.status != _RUNNING:
                break
        if count:
            self.num_forced_tokens += count
            self._num_forced[seq.seq_id] = count
            grammar.forced_end = len(seq.token_ids)
        return count

    def process(
        self,
        sched_out: SchedulerOutputs,
        result: StepResult,
        next_step: SchedulerOutputs | None = None,
    ) -> tuple[list[RequestOutput], WorkerEvents]:
        """The step's deltas, and the forks and frees the worker must hear of. `next_step`:
        the continuation in flight after the step, if any (its updates `after_drafts` hold or
        are dropped here)."""
        self._events = events = WorkerEvents()
        self.num_generated = 0
        self.num_accepted_drafts = 0
        if self._num_forced:
            self._num_forced = {}
        by_seq = {o.seq_id: o for o in result.outputs}
        drafts = sched_out.drafts
        runs = _runs(result, drafts) if drafts else {}
        request_outputs: list[RequestOutput] = []
        finished_groups: list[SequenceGroup] = []
        now = time.monotonic()
        for scheduled in sched_out.scheduled:
            seq_group = scheduled.seq_group
            params = seq_group.sampling_params
            if runs and (run := runs.get(seq_group.seqs[0].seq_id)) is not None:
                seq_id = seq_group.seqs[0].seq_id
                delta = self._process_run(seq_group, run, len(drafts[seq_id]), now, next_step)
            elif (
                params.best_of == 1
                and not params.use_beam_search
                and params.prompt_logprobs is None
                and len(seq_group.seqs) == 1
            ):
                delta = self._process_single(seq_group, by_seq, now)
            else:
                delta = self._process_group(seq_group, by_seq, now)
            if delta is None:
                continue
            if delta.finished:
                finished_groups.append(seq_group)
            request_outputs.append(delta)
        for seq_group in sched_out.ignored:
            request_outputs.append(self._ignored_output(seq_group))
        self.scheduler.free_finished_seq_groups(finished_groups)
        return request_outputs, events

    def _process_single(
        self, seq_group: SequenceGroup, by_seq: dict[int, SequenceOutput], now: float
    ) -> RequestOutput | None:
        """`_process_group` for the usual request: one sequence that never forks, streamed
        token by token, no prompt logprobs. It runs for nearly every group every step."""
        seq = seq_group.seqs[0]
        if seq.status != _RUNNING or seq.num_computed_tokens != len(seq.token_ids):
            return None  # finished since it was scheduled, or a prefill chunk short of the end
        out = by_seq.get(seq.seq_id)
        if out is None or not out.samples:
            raise WorkerOutputError(f"no sample for sequence {seq.seq_id}")
        metrics = seq_group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        self.num_generated += 1
        params = seq_group.sampling_params
        sample = out.samples[0]
        want_logprobs = params.logprobs is not None
        if want_logprobs:
            seq.append_sample(SampleLogprobs(sample, out.top_logprobs))
        else:
            seq.append_token(sample)
        seq.check_stop(params, self.max_model_len)
        forced = self._append_forced(seq, params) if seq.grammar is not None else 0
        seq_group.has_sampled = True
        return self._single_delta(seq_group, 1 + forced, want_logprobs, now)

    def _single_delta(
        self, seq_group: SequenceGroup, num_new: int, want_logprobs: bool, now: float
    ) -> RequestOutput:
        """The delta of a one-sequence group that gained `num_new` tokens; frees it if it
        finished."""
        seq = seq_group.seqs[0]
        metrics = seq_group.metrics
        status = seq.status
        finished = status >= SequenceStatus.STOPPED
        if finished:
            self.scheduler.free_seq(seq, self._events.freed_seq_ids)
            metrics.finished_time = now
        choice = CompletionOutput(
            seq.seq_index,
            seq.token_ids[-num_new:],
            seq.cumulative_logprob,
            seq.output_logprobs[-num_new:] if want_logprobs else None,
            FINISH_REASONS.get(status),
            seq.stop_token_id,
        )
        return RequestOutput(
            seq_group.request_id,
            seq_group.prompt_token_ids,
            [choice],
            finished,
            None,
            None,
            metrics,
        )

    def _process_run(
        self,
        seq_group: SequenceGroup,
        run: list[SequenceOutput],
        num_drafts: int,
        now: float,
        next_step: SchedulerOutputs | None,
    ) -> RequestOutput | None:
        """`_process_single` for a sequence that verified `num_drafts` drafts: the tokens of
        `run` (the kept drafts, then a sample) are appended one by one, each through the stop
        checks, so a stop inside the run ends the sequence where a step-by-step run would; a
        grammar's forced tokens follow. A continuation in flight that assumed all drafts kept
        keeps its slots if they were, and drops the sequence if not (the worker skips it)."""
        seq = seq_group.seqs[0]
        if seq.status != _RUNNING:
            return None  # finished (aborted) since it was scheduled
        if not 1 <= len(run) <= num_drafts + 1:
            raise WorkerOutputError(
                f"sequence {seq.seq_id}: {len(run)} tokens for {num_drafts} drafts"
            )
        params = seq_group.sampling_params
        want_logprobs = params.logprobs is not None
        max_model_len = self.max_model_len
        num_new = 0
        for out in run:
            if not out.samples:
                raise WorkerOutputError(f"no sample for sequence {seq.seq_id}")
            if want_logprobs:
                seq.append_sample(SampleLogprobs(out.samples[0], out.top_logprobs))
            else:
                seq.append_token(out.samples[0])
            num_new += 1
            seq.check_stop(params, max_model_len)
            if seq.status != _RUNNING:
                break
        self.num_generated += num_new
        kept = len(run) - 1
        speculator = self.scheduler.speculator
        if not speculator.own_samples:
            self.num_accepted_drafts += kept
        ahead, dropped = 0, False
        if next_step is not None and seq.seq_id in next_step.after_drafts:
            if kept < num_drafts and seq.status == _RUNNING:  # or its run was ended early
                next_step.drop(seq_group)
                self._events.skipped.append(seq.seq_id)
                dropped = True
            else:
                ahead = len(next_step.drafts.get(seq.seq_id, ()))
        speculator.commit(seq_group, num_drafts, kept, ahead, dropped)
        if seq.status == _RUNNING:
            self._events.kept_drafts.append((seq.seq_id, kept))
        num_new += self._append_forced(seq, params) if seq.grammar is not None else 0
        return self._single_delta(seq_group, num_new, want_logprobs, now)

    def _process_group(
        self, seq_group: SequenceGroup, by_seq: dict[int, SequenceOutput], now: float
    ) -> RequestOutput | None:
        """Append the group's samples (forking, beam search), apply stops, free what finished;
        returns the request's delta, if it has one."""
        if seq_group.is_finished():  # aborted between schedule and now
            return None
        new_prompt_logprobs = self._take_prompt_logprobs(seq_group, by_seq)
        sampled: list[tuple[Sequence, SequenceOutput]] = []
        for seq in seq_group.seqs:
            if seq.status == _RUNNING and seq.num_computed_tokens == len(seq.token_ids):
                out = by_seq.get(seq.seq_id)
                if out is None or not out.samples:
                    raise WorkerOutputError(f"no sample for sequence {seq.seq_id}")
                sampled.append((seq, out))
        if not sampled and new_prompt_logprobs is None:
            return None
        num_seqs_before = len(seq_group.seqs)
        self.num_generated += len(sampled)
        if sampled:
            if seq_group.metrics.first_token_time is None:
                seq_group.metrics.first_token_time = now
            if seq_group.sampling_params.use_beam_search:
                process_beam_group(
                    seq_group,
                    sampled,
                    self.scheduler,
                    self._events,
                    self.seq_counter,
                    self.max_model_len,
                )
            else:
                self._process_sampling_group(seq_group, sampled)
            seq_group.has_sampled = True
        finished = seq_group.is_finished()
        if finished:
            seq_group.metrics.finished_time = now
        # Without beam search each sampled sequence gained one token; forked children
        # (appended to the group) hold just their first one.
        changed = [seq for seq, _ in sampled]
        changed.extend(seq_group.seqs[num_seqs_before:])
        return self._delta(seq_group, changed, new_prompt_logprobs, finished)

    def _take_prompt_logprobs(
        self, seq_group: SequenceGroup, by_seq: dict[int, SequenceOutput]
    ) -> list[PromptLogprob] | None:
        if seq_group.sampling_params.prompt_logprobs is None:
            return None
        new: list[PromptLogprob] = []
        stored = seq_group.prompt_logprobs
        next_position = stored[-1].position + 1 if stored else 0
        for seq in seq_group.seqs:
            out = by_seq.get(seq.seq_id)
            if out is None:
                continue
            for entry in out.prompt_logprobs:
                if entry.position >= next_position:  # a recompute sends earlier ones again
                    new.append(entry)
                    next_position = entry.position + 1
        stored.extend(new)
        return new or None

    def _process_sampling_group(
        self, seq_group: SequenceGroup, sampled: list[tuple[Sequence, SequenceOutput]]
    ) -> None:
        params = seq_group.sampling_params
        keep_logprobs = params.logprobs is not None
        scheduler = self.scheduler
        for seq, out in sampled:
            samples = out.samples
            if not seq_group.has_sampled and params.num_sampled > 1:
                if len(samples) != params.num_sampled:
                    raise WorkerOutputError(
                        f"sequence {seq.seq_id}: expected best_of={params.num_sampled} "
                        f"samples at the first sample, got {len(samples)}"
                    )
                # Sample i belongs to the sequence with seq_index i; the parent has index 0.
                for sample in samples[1:]:
                    child = seq.fork(next(self.seq_counter), seq_group.next_seq_index)
                    seq_group.next_seq_index += 1
                    if keep_logprobs:
                        child.append_sample(SampleLogprobs(sample, out.top_logprobs))
                    else:
                        child.append_token(sample)
                    child.check_stop(params, self.max_model_len)
                    seq_group.add(child)
                    if not child.is_finished():
                        scheduler.fork_seq(seq, child, self._events.forks)
            if keep_logprobs:
                seq.append_sample(SampleLogprobs(samples[0], out.top_logprobs))
            else:
                seq.append_token(samples[0])
            seq.check_stop(params, self.max_model_len)
            if seq.status >= SequenceStatus.STOPPED:
                scheduler.free_seq(seq, self._events.freed_seq_ids)

    def _delta(
        self,
        seq_group: SequenceGroup,
        changed: list[Sequence],
        prompt_logprobs: list[PromptLogprob] | None,
        finished: bool,
    ) -> RequestOutput | None:
        params = seq_group.sampling_params
        choices: list[CompletionOutput] = []
        if not params.streams_choices:
            if finished:
                output = final_output(seq_group)
                output.prompt_logprobs = prompt_logprobs
                return output
            if prompt_logprobs is None:
                return None
        else:
            want_logprobs = params.logprobs is not None
            num_forced = self._num_forced
            for seq in changed:
                new = 1 + num_forced.get(seq.seq_id, 0)
                choices.append(
                    CompletionOutput(
                        seq.seq_index,
                        seq.token_ids[-new:],
                        seq.cumulative_logprob,
                        seq.output_logprobs[-new:] if want_logprobs else None,
                        FINISH_REASONS.get(seq.status),
                        seq.stop_token_id,
                    )
                )
            if len(choices) > 1:
                choices.sort(key=lambda c: c.index)
        return RequestOutput(
            seq_group.request_id,
            seq_group.prompt_token_ids,
            choices,
            finished,
            prompt_logprobs,
            None,
            seq_group.metrics,
        )

    def _ignored_output(self, seq_group: SequenceGroup) -> RequestOutput:
        seq_group.metrics.finished_time = time.monotonic()
        choice = CompletionOutput(0, [], 0.0, None, FinishReason.IGNORED)
        return RequestOutput(
            request_id=seq_group.request_id,
            prompt_token_ids=seq_group.prompt_token_ids,
            outputs=[choice],
            finished=True,
            error=seq_group.error,
            metrics=seq_group.metrics,
        )
