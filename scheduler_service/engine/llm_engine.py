"""LLMEngine: the in-process step loop of one replica (scheduler + one `Executor`).

Each `step()` schedules, turns the decision into a `StepInput` diff against what the worker
already knows, runs the executor, and processes the sampled tokens into per-request deltas.
No model and no network here: the executor is a worker in-process, a gRPC client, or a fake.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from typing import Any

from llmserve.errors import ApiError, FieldError
from llmserve.grammar.backend import CompiledGrammar
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import check_prompt_fits
from llmserve.priority import check_priority
from llmserve.sampling_params import SamplingParams
from llmserve.steps import Executor, StepInput, StepResult, TokenMask
from scheduler_service.engine import metrics
from scheduler_service.engine.config import CacheConfig, SchedulerConfig
from scheduler_service.engine.grammar import GrammarCompiler
from scheduler_service.engine.grammar_requests import GrammarRequests, default_grammar_cache
from scheduler_service.engine.outputs import OutputProcessor
from scheduler_service.engine.pipelined_steps import (
    commit_continuation,
    plan_continuation,
)
from scheduler_service.engine.request_output import RequestOutput, final_output
from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs, SchedulerStats
from scheduler_service.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_service.engine.snapshots import (
    GroupSnapshot,
    SequenceSnapshot,
    rebuild_group,
    snapshot_group,
)
from scheduler_service.engine.step_builder import StepBuilder
from scheduler_service.engine.text_stops import StopStrings, TokenizerLoader


class LLMEngine:
    """One replica's step loop, driven by whoever owns it (a server loop, a test, a bench).

    `add_request` queues a request; each `step()` runs one iteration and returns the
    requests' deltas; `abort_request` drops a request and frees its blocks.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        executor: Executor,
        tokenizer: TokenizerLoader | None = None,
        grammar_cache: GrammarCache | None = None,
    ) -> None:
        """`tokenizer` loads the model's tokenizer: called once, when the first request with
        stop strings or a grammar arrives (None: such requests are refused).
        `grammar_cache`: compiled grammars, shared by the replicas (default: the process's)."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.executor = executor
        self.scheduler = Scheduler(scheduler_config, cache_config)
        self._seq_counter = itertools.count()
        self._builder = StepBuilder(self.scheduler)
        self._processor = OutputProcessor(self.scheduler, self._seq_counter)
        self.last_step_input: StepInput | None = None
        # Steps begun and not finished (at most two: a step and its continuation), and the
        # continuation not yet committed (`scheduler_service.engine.pipelined_steps`).
        self._num_in_flight = 0
        self._continuation: tuple[SchedulerOutputs, int] | None = None
        # Imported requests with nothing left to run: their final outputs go out next step.
        self._finished_on_import: list[RequestOutput] = []
        self._load_tokenizer = tokenizer
        self._tokenizer: Any = None
        compiler = (
            None
            if tokenizer is None
            else GrammarCompiler(
                tokenizer,
                grammar_cache or default_grammar_cache(),
                on_error=metrics.record_grammar_setup_error,
            )
        )
        # Constrained groups whose grammar may still fail to compile (checked every step).
        self._grammars = GrammarRequests(compiler, scheduler_config.max_grammar_compile_ms)

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
        priority: int = 0,
        stop_strings: StopStrings | None = None,
        grammar: GrammarSpec | None = None,
        reasoning: ReasoningSpec | None = None,
    ) -> None:
        """Queue a request. Raises `FieldError` (naming the field) on bad input. A `grammar`
        is compiled in the background; one that fails finishes the request (ABORT). With
        `reasoning`, the grammar applies after the output's reasoning block."""
        if not isinstance(request_id, str) or not request_id:
            raise FieldError("request_id", "must be a non-empty string")
        if self.scheduler.get_seq_group(request_id) is not None:
            raise FieldError("request_id", f"{request_id!r} is already in use")
        if not prompt_token_ids:
            raise FieldError("prompt_token_ids", "must not be empty")
        if any(not isinstance(t, int) or t < 0 for t in prompt_token_ids):
            raise FieldError("prompt_token_ids", "must be non-negative integers")
        if not isinstance(sampling_params, SamplingParams):
            raise FieldError("sampling_params", "must be a SamplingParams")
        if eos_token_id is not None and eos_token_id < 0:
            raise FieldError("eos_token_id", f"must be non-negative, got {eos_token_id}")
        self._check_num_seqs(sampling_params)
        check_priority(priority)
        seq = Sequence(
            next(self._seq_counter),
            list(prompt_token_ids),
            self.cache_config.block_size,
            eos_token_id,
        )
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = SequenceGroup(
            request_id,
            [seq],
            sampling_params,
            arrival,
            priority,
            stop_strings or None,
            grammar,
            reasoning,
        )
        self._start_text_stops(group)
        self._grammars.start(group)
        self.scheduler.add_seq_group(group)

    def _start_text_stops(self, group: SequenceGroup) -> None:
        """Start decoding the unfinished sequences of a group that has stop strings."""
        stops = group.stop_strings
        if stops is None:
            return
        if not stops.strings or any(not s for s in stops.strings):
            raise FieldError("stop", "stop strings must not be empty")
        if self._tokenizer is None:
            if self._load_tokenizer is None:
                raise FieldError("stop", "this scheduler has no tokenizer to match stop strings")
            try:
                self._tokenizer = self._load_tokenizer()
            except Exception as exc:  # the model's tokenizer files are not reachable here
                raise FieldError(
                    "stop", f"the model's tokenizer cannot be loaded to match stop strings: {exc}"
                ) from exc
        for seq in group.get_unfinished_seqs():
            seq.start_text_stop(self._tokenizer, stops)

    def warm_grammars(self) -> None:
        """Prepare grammar compilation (the tokenizer and its backend) in the background."""
        self._grammars.warm()

    def grammar_compiles_due(self) -> tuple[list[Future[CompiledGrammar]], float]:
        """Compilations the next step may wait for (those of groups whose prompt could
        finish prefilling in it), and the seconds a caller may wait for them before the
        first of them is past its deadline (`SchedulerConfig.max_grammar_compile_ms`). A
        caller with an event loop awaits them before `begin_step`, so the wait does not
        block the loop (the step builder would otherwise block on them)."""
        return self._grammars.due(self.scheduler_config.token_budget)

    def _abort_failed_grammars(self, failures: list[tuple[SequenceGroup, ApiError]]) -> None:
        """Finish (ABORT) groups whose grammar failed, with the error the client gets;
        blocks freed at once (a step already built for them writes into them before any
        later step reuses them), final outputs with the next step's."""
        for group, error in failures:
            self._grammars.discard(group.request_id)
            group.error = error
            freed: list[int] = []
            if self.scheduler.abort_seq_group(group.request_id, freed) is not None:
                self._builder.add_freed(freed)
                self._finished_on_import.append(final_output(group))

    def _check_num_seqs(self, params: SamplingParams) -> None:
        max_seqs = self.scheduler_config.max_num_seqs
        if params.num_sampled > max_seqs:
            name = "n" if params.use_beam_search else "best_of"
            raise FieldError(
                f"sampling_params.{name}",
                f"{params.num_sampled} sequences can never run at once on this replica "
                f"(max_num_seqs={max_seqs})",
            )

    def check_admissible(self, snapshot: GroupSnapshot) -> None:
        """Raise `FieldError` if this replica can never run the request: more sequences
        than `max_num_seqs`, a prompt that leaves no room in `max_model_len`
        (`llmserve.limits.prompt_too_long`), or more KV blocks than the cache
        holds (less the watermark)."""
        self._check_num_seqs(snapshot.sampling_params)
        prompt_len = len(snapshot.prompt_token_ids)
        check_prompt_fits(prompt_len, self.scheduler_config.model_len, "prompt")
        bs = self.cache_config.block_size
        unfinished: list[SequenceSnapshot | None] = [
            s for s in snapshot.seqs if s.finish_reason is None
        ] or [None]
        lengths = [prompt_len + (len(s.output_token_ids) if s else 0) for s in unfinished]
        if len(set(lengths)) > 1:
            raise FieldError(
                "seqs", "the unfinished sequences of a request must have the same length"
            )
        # Siblings share the prompt's full blocks through the prefix cache (or not at all).
        shared = prompt_len // bs if self.cache_config.enable_prefix_caching else 0
        needed = shared + sum(-(-n // bs) - shared for n in lengths)
        bm = self.scheduler.block_manager
        if bm.num_total_gpu_blocks - needed < bm.watermark_blocks:
            raise FieldError(
                "prompt",
                f"the request needs {needed} KV blocks, more than the cache can ever hold "
                f"({bm.num_total_gpu_blocks} blocks, watermark {bm.watermark_blocks})",
            )

    def import_request(self, snapshot: GroupSnapshot) -> None:
        """Queue a request moved here (or a new one, as a snapshot with no sequences). Its
        unfinished sequences are recomputed, by arrival order among the waiting requests.
        Raises `FieldError` if the id is in use or `check_admissible` refuses it."""
        request_id = snapshot.request_id
        if not request_id:
            raise FieldError("request_id", "must be a non-empty string")
        if self.scheduler.get_seq_group(request_id) is not None or any(
            o.request_id == request_id for o in self._finished_on_import
        ):
            raise FieldError("request_id", f"{request_id!r} is already in use")
        if not snapshot.prompt_token_ids:
            raise FieldError("prompt_token_ids", "must not be empty")
        check_priority(snapshot.priority)
        self.check_admissible(snapshot)
        group = rebuild_group(
            snapshot, lambda: next(self._seq_counter), self.cache_config.block_size
        )
        for seq in group.get_unfinished_seqs():
            params = snapshot.sampling_params
            if seq.tokens_left(params.max_tokens, self.scheduler_config.model_len) <= 0:
                seq.status = SequenceStatus.LENGTH_CAPPED
        if group.is_finished():
            self._finished_on_import.append(final_output(group))
            return
        self._start_text_stops(group)
        self._grammars.start(group)
        self.scheduler.add_seq_group(group)

    def export_requests(self, request_ids: list[str] | None = None) -> list[GroupSnapshot]:
        """Take unfinished requests out of this engine (all of them by default; unknown ids
        are skipped) and return their snapshots. Their blocks are freed and no output is
        emitted for them. Also valid between `begin_step` and `finish_step`: the step's
        results for these requests are then ignored."""
        scheduler = self.scheduler
        ids = scheduler.unfinished_request_ids() if request_ids is None else request_ids
        snapshots = []
        for request_id in ids:
            group = scheduler.get_seq_group(request_id)
            if group is None:
                continue
            snapshots.append(snapshot_group(group))
            freed: list[int] = []
            scheduler.abort_seq_group(request_id, freed)  # frees its blocks; no output follows
            self._builder.add_freed(freed)
        return snapshots

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks. False if it is unknown or already finished."""
        freed: list[int] = []
        aborted = self.scheduler.abort_seq_group(request_id, freed) is not None
        self._builder.add_freed(freed)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_seqs() or bool(self._finished_on_import)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seq_groups()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns a delta for each request with something new."""
        sched_out, step_input = self.begin_step()
        self.attach_masks(step_input)
        result = None if step_input.is_empty() else self.executor.execute(step_input)
        return self.finish_step(sched_out, step_input, result)

    def compute_masks(self, step_id: int) -> tuple[list[TokenMask], float]:
        """The token masks of a built step's constrained rows (`StepInput.deferred_mask_seq_ids`)
        and the seconds they took. Call it once per such step: for a step built by
        `begin_step`, any time before its `finish_step` (the gRPC service runs it off the event
        loop while the worker runs the forward pass); for a continuation, after the previous
        step's `finish_step` (the masks depend on the token it sampled). Nothing may advance
        the step's grammars meanwhile; other engine calls may run."""
        return self._builder.masks(step_id)

    def attach_masks(self, step_input: StepInput) -> None:
        """For an executor in process: compute the step's deferred masks into the step."""
        if step_input.deferred_mask_seq_ids:
            step_input.token_masks.extend(self.compute_masks(step_input.step_id)[0])
            step_input.deferred_mask_seq_ids = []

    def begin_step(self) -> tuple[SchedulerOutputs, StepInput]:
        """First half of `step()`: schedule and build the diff. A caller that executes steps
        itself (the gRPC service awaits a remote worker) runs the step in between, then calls
        `finish_step`. Nothing else may touch the engine in between."""
        assert self._num_in_flight == 0, "a synchronous step waits for the steps in flight"
        if failures := self._grammars.take_failures():
            self._abort_failed_grammars(failures)
        sched_out = self.scheduler.schedule()
        self.scheduler.speculator.draft(sched_out, self._builder.views)
        step_input = self._builder.build(sched_out)
        self.last_step_input = step_input
        self._num_in_flight = 1
        return sched_out, step_input

    def begin_continuation(
        self, prev: SchedulerOutputs
    ) -> tuple[SchedulerOutputs, StepInput] | None:
        """Asynchronous scheduling: the step after `prev`, the one step in flight, built
        before `prev`'s result is back (`scheduler_service.engine.pipelined_steps`); None when the
        next step must wait for that result. Run it after `prev`; finish `prev` first."""
        if self._num_in_flight != 1 or self._builder.has_pending_forks():
            return None
        cont = plan_continuation(self.scheduler, prev)
        if cont is None:
            return None
        step_input = self._builder.build_continuation(cont)
        self.last_step_input = step_input
        self._num_in_flight = 2
        self._continuation = (cont, step_input.step_id)
        return cont, step_input

    def finish_step(
        self, sched_out: SchedulerOutputs, step_input: StepInput, result: StepResult | None
    ) -> list[RequestOutput]:
        """Second half of `step()`: `result` is the executed step's (None when it was empty)."""
        if result is None:
            result = StepResult(step_input.step_id)
        if self._builder.grammar_failures:  # found computing this step's masks
            self._abort_failed_grammars(self._builder.grammar_failures)
            self._builder.grammar_failures = []
        self.scheduler.on_step_executed(sched_out)
        cont, cont_step_id = self._continuation or (None, None)
        outputs, events = self._processor.process(sched_out, result, cont)
        self._builder.add_events(events)
        self._num_in_flight -= 1
        if cont is not None:
            assert cont_step_id == step_input.step_id + 1, "steps finish in order"
            self._continuation = None
            commit_continuation(self.scheduler, cont)
        if self._finished_on_import:
            outputs.extend(self._finished_on_import)
            self._finished_on_import = []
        return outputs

    @property
    def num_forced_tokens(self) -> int:
        """Tokens grammars have forced so far (structured output)."""
        return self._processor.num_forced_tokens

    @property
    def last_mask_seconds(self) -> float:
        """Time the last `compute_masks` took."""
        return self._builder.grammar_timings.last_step_seconds

    @property
    def last_num_accepted_drafts(self) -> int:
        """Draft tokens kept in the last finished step."""
        return self._processor.num_accepted_drafts

    @property
    def last_num_generated(self) -> int:
        """Tokens sequences got in the last finished step (several for a kept draft run)."""
        return self._processor.num_generated

    def unfinished_request_ids(self) -> list[str]:
        return self.scheduler.unfinished_request_ids()
