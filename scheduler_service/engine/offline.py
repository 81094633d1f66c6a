"""Driving an engine in-process: running prompts to completion (`generate`), one step ahead of
the results (`PipelinedStepper`), and merging a request's streamed deltas into its whole output
(`accumulate`). Tests, benchmarks and offline use drive an engine this way; the fleet's replicas
drive theirs over a worker stream (`scheduler_service.fleet.replica_steps`)."""

from __future__ import annotations

import itertools
from collections import deque

from llmserve.errors import FieldError
from llmserve.sampling_params import SamplingParams
from llmserve.steps import StepInput, StepResult
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.request_output import CompletionOutput, RequestOutput
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs


class EngineStalledError(RuntimeError):
    """`generate` made no progress: the remaining requests can never be scheduled."""


# Request ids of `generate`, unique in the process (so across engines too).
_ids = itertools.count()


def generate(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    eos_token_id: int | None = None,
    priorities: list[int] | None = None,
    async_scheduling: bool = False,
) -> list[RequestOutput]:
    """Run the prompts to completion; returns their final outputs in prompt order.
    `priorities`: one per prompt (default 0 each). `async_scheduling`: build each step
    before the previous one's result is processed where possible (`PipelinedStepper`).

    Other requests in the engine keep running, but their deltas are not returned.
    """
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise FieldError("params", f"{len(params)} params for {len(prompts)} prompts")
        params_list = params
    else:
        params_list = [params] * len(prompts)
    ids = [f"generate-{next(_ids)}" for _ in prompts]
    if priorities is not None and len(priorities) != len(prompts):
        raise FieldError("priorities", f"{len(priorities)} priorities for {len(prompts)} prompts")
    for i, (request_id, prompt, p) in enumerate(zip(ids, prompts, params_list, strict=True)):
        priority = 0 if priorities is None else priorities[i]
        engine.add_request(request_id, prompt, p, eos_token_id=eos_token_id, priority=priority)
    results: dict[str, RequestOutput] = {}
    pending = set(ids)
    idle_steps = 0
    stepper = PipelinedStepper(engine) if async_scheduling else None
    while pending or (stepper is not None and stepper.in_flight):
        deltas = engine.step() if stepper is None else stepper.step()
        progressed = bool(deltas) or not (
            engine.last_step_input is None or engine.last_step_input.is_empty()
        )
        idle_steps = 0 if progressed else idle_steps + 1
        if idle_steps > 2:
            raise EngineStalledError(f"{len(pending)} requests can never be scheduled")
        for delta in deltas:
            if delta.request_id not in pending:
                continue
            results[delta.request_id] = accumulate(results.get(delta.request_id), delta)
            if delta.finished:
                pending.discard(delta.request_id)
    return [results[i] for i in ids]


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """`total` (None before the first delta) with `delta` appended: tokens and logprobs
    extended per choice, the rest replaced by the delta's."""
    if total is None:
        total = RequestOutput(
            request_id=delta.request_id,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
            finished=False,
            prompt_logprobs=None,
            metrics=delta.metrics,
        )
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = (total.prompt_logprobs or []) + delta.prompt_logprobs
    choices = {c.index: c for c in total.outputs}
    for new in delta.outputs:
        old = choices.get(new.index)
        if old is None:
            choices[new.index] = CompletionOutput(
                new.index,
                list(new.token_ids),
                new.cumulative_logprob,
                list(new.logprobs) if new.logprobs is not None else None,
                new.finish_reason,
                new.stop_token_id,
            )
            continue
        old.token_ids.extend(new.token_ids)
        if old.logprobs is not None and new.logprobs is not None:
            old.logprobs.extend(new.logprobs)
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason = new.finish_reason
        old.stop_token_id = new.stop_token_id
    total.outputs = sorted(choices.values(), key=lambda c: c.index)
    total.finished = delta.finished
    total.error = delta.error
    return total


class PipelinedStepper:
    """Runs an engine's steps one ahead of their results: the next step is built before the
    previous one is processed. The in-process executor runs a step at once, so a step runs
    when its masks can be computed: at once for a step begun alone, after the previous step is
    finished for a continuation (its constrained rows' masks need that step's tokens); a
    remote worker would start it earlier. `step()` returns the oldest step's outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # [scheduling decision, step, result (None until run, or for an empty step)]
        self._in_flight: deque[tuple[SchedulerOutputs, StepInput, list[StepResult | None]]] = (
            deque()
        )
        self.num_continuations = 0

    def _run(self, step_input: StepInput) -> StepResult | None:
        self.engine.attach_masks(step_input)
        return None if step_input.is_empty() else self.engine.executor.execute(step_input)

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        if not self._in_flight:
            sched_out, step_input = engine.begin_step()
            self._in_flight.append((sched_out, step_input, [self._run(step_input)]))
        if len(self._in_flight) == 1:
            cont = engine.begin_continuation(self._in_flight[0][0])
            if cont is not None:
                self.num_continuations += 1
                self._in_flight.append((*cont, [None]))
        sched_out, step_input, (result,) = self._in_flight.popleft()
        outputs = engine.finish_step(sched_out, step_input, result)
        if self._in_flight:
            _, cont_input, cont_result = self._in_flight[0]
            cont_result[0] = self._run(cont_input)
        return outputs

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
