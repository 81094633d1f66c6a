"""The scheduler's spans: one lifecycle span per request, one `scheduler.step` span per step.

Request spans are children of the gateway's request span (`AddRequest.traceparent`) and live
from the add until the request finishes, is aborted or fails. Their events are derived here,
in the service layer, from each step's `SchedulerOutputs` and outputs, without hooks in the
scheduler core: `queued` on add; `scheduled` (and `prefix_cache_hit` with the block count)
when a queued request is first given a batch slot; `preempted` (mode), `swapped_out` and
`swapped_in`; `first_token`; `finished` (reason).

Sampling. A step span exists only when at least one request in its batch has a recorded
span, and its parent is the first such request's span: under the default parent-based
samplers it is therefore recorded exactly when a request it serves is, and it sits in that
request's trace, with the worker's `execute` span below it. It also carries a span link to
every recorded request in its batch, so each sampled request reaches every step that
touched it (through the parent or a link) even when another request's trace holds the step.
A step of only unsampled requests makes no span at all, so the worker makes none either.

With tracing off the tracer is the API's no-op one: request spans are not recording and are
not kept, so `step_span` returns at once and builds no attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from llmserve.steps import StepInput, TokenMask
from llmserve.telemetry import context_from_traceparent, current_traceparent
from scheduler_service.engine.config import PreemptionMode
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.request_output import RequestOutput
from scheduler_service.engine.scheduler_outputs import SchedulerOutputs
from scheduler_service.engine.sequence import SequenceGroup, SequenceStatus

tracer = trace.get_tracer("llmserve.scheduler")

REQUEST_SPAN = "scheduler.request"
STEP_SPAN = "scheduler.step"

_QUEUED, _RUNNING, _SWAPPED = "queued", "running", "swapped"
_RUNNING_STATUS = SequenceStatus.RUNNING


def trace_id_of(traceparent: str) -> str | None:
    """The trace id of a W3C traceparent ("00-<trace id>-<span id>-<flags>"), for logs."""
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


@dataclass(slots=True)
class RequestTrace:
    """A recorded request span and what the events derived so far need to remember. It moves
    with its request when the request moves to another replica."""

    span: Span
    state: str = _QUEUED
    num_output_tokens: int = 0
    # Structured output: whether its first constrained sample has been recorded.
    constrained: bool = False


def start_request_trace(
    key: str, traceparent: str, num_prompt_tokens: int, shard: str = ""
) -> RequestTrace | None:
    """The request's lifecycle span (event `queued`), or None when it is not recorded; it
    names the scheduler `shard` that holds the request."""
    span = tracer.start_span(
        REQUEST_SPAN, context=context_from_traceparent(traceparent), kind=SpanKind.SERVER
    )
    if not span.is_recording():
        return None
    span.set_attributes(
        {
            "llmserve.request_id": key,
            "gen_ai.usage.input_tokens": num_prompt_tokens,
            "llmserve.scheduler.shard": shard,
        }
    )
    span.add_event("queued")
    return RequestTrace(span)


def record_routing(
    trace: RequestTrace | None, worker: str, policy: str, cached_tokens: int
) -> None:
    """Event `routed`: the replica the routing policy picked, and how much of the prompt is
    cached there."""
    if trace is None:
        return
    trace.span.add_event(
        "routed", {"worker": worker, "policy": policy, "cached_tokens": cached_tokens}
    )


def record_migration(
    trace: RequestTrace | None, source: str, target: str, cause: str, how: str = "recompute"
) -> None:
    """Event `migrated` naming both workers and how the request's KV cache got there
    (`recompute`, or `transfer` of its blocks); the request is queued again on the target."""
    if trace is None:
        return
    trace.span.add_event(
        "migrated", {"from_worker": source, "to_worker": target, "cause": cause, "how": how}
    )
    trace.state = _QUEUED


def end_request_trace(trace: RequestTrace | None, error: str | None) -> None:
    """End a span whose request will not finish on any replica (failed, or aborted while it
    waited for one)."""
    if trace is None:
        return
    if error is None:
        trace.span.add_event("finished", {"reason": "abort"})
    else:
        trace.span.set_status(Status(StatusCode.ERROR, error))
    trace.span.end()


def start_transfer_span(
    transfer_id: int,
    source: str,
    target: str,
    blocks: int,
    cause: str,
    request: RequestTrace | None,
) -> Span:
    """A span per KV transfer round, from its export queued on `source` to its import done (or
    failed) on `target`, linked to the request it moves."""
    links = [Link(request.span.get_span_context())] if request is not None else []
    return tracer.start_span(
        "scheduler.kv_transfer",
        links=links,
        attributes={
            "llmserve.transfer_id": transfer_id,
            "llmserve.transfer.from_worker": source,
            "llmserve.transfer.to_worker": target,
            "llmserve.transfer.blocks": blocks,
            "llmserve.transfer.cause": cause,
        },
    )


def end_transfer_span(span: Span | None, error: str | None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


class ReplicaTracer:
    """Request and step spans of one replica. Called from the replica's loop only."""

    def __init__(self, replica_id: int, block_size: int) -> None:
        self.replica_id = replica_id
        self.block_size = block_size
        self._requests: dict[str, RequestTrace] = {}

    # -- requests ------------------------------------------------------------------------------

    def attach(self, key: str, trace: RequestTrace | None) -> None:
        """The request (with its span, if recorded) is now on this replica."""
        if trace is not None:
            trace.span.set_attribute("llmserve.replica", self.replica_id)
            self._requests[key] = trace

    def detach(self, key: str) -> RequestTrace | None:
        """The request leaves this replica; its span goes with it."""
        return self._requests.pop(key, None)

    def get(self, key: str) -> RequestTrace | None:
        return self._requests.get(key)

    def abort(self, key: str) -> None:
        end_request_trace(self._requests.pop(key, None), None)

    # -- steps ---------------------------------------------------------------------------------

    def on_masks(self, sched_out: SchedulerOutputs, masks: list[TokenMask]) -> None:
        """A step's deferred masks were computed: the grammar events of the traced requests
        that get their first one."""
        by_seq = {m.seq_id: m for m in masks}
        for scheduled in sched_out.scheduled:
            entry = self._requests.get(scheduled.seq_group.request_id)
            if entry is not None and not entry.constrained:
                _record_first_constrained(entry, scheduled.seq_group, by_seq)

    def step_span(
        self,
        engine: LLMEngine,
        sched_out: SchedulerOutputs,
        step_input: StepInput,
        start_ns: int,
        free_blocks_before: int,
    ) -> Span | None:
        """Record the step's lifecycle events; the step's span (started at `start_ns`), or
        None when no request in the batch is traced."""
        requests = self._requests
        if not requests:
            return None
        for preempted in sched_out.preempted:
            entry = requests.get(preempted.request_id)
            if entry is None:
                continue
            swap = preempted.mode is PreemptionMode.SWAP
            entry.span.add_event("preempted", {"mode": "swap" if swap else "recompute"})
            if swap:
                entry.span.add_event("swapped_out")
            entry.state = _SWAPPED if swap else _QUEUED
        links: list[Link] = []
        parent: Span | None = None
        num_prefill = num_decode = num_seqs = 0
        masks = {m.seq_id: m for m in step_input.token_masks}
        for scheduled in sched_out.scheduled:
            group = scheduled.seq_group
            running = group.num_seqs(_RUNNING_STATUS)
            num_seqs += running
            if scheduled.token_chunk_size == 1 and group.seqs[0].get_output_len():
                num_decode += running
            else:
                num_prefill += scheduled.token_chunk_size * running
            entry = requests.get(group.request_id)
            if entry is None:
                continue
            if entry.state == _QUEUED:
                entry.span.add_event("scheduled")
                # A queued group's computed tokens before its first chunk are prefix hits.
                cached_blocks = group.seqs[0].num_computed_tokens // self.block_size
                if cached_blocks:
                    entry.span.add_event("prefix_cache_hit", {"blocks": cached_blocks})
            elif entry.state == _SWAPPED:
                entry.span.add_event("swapped_in")
            entry.state = _RUNNING
            if masks and not entry.constrained:
                _record_first_constrained(entry, group, masks)
            if parent is None:
                parent = entry.span
            links.append(Link(entry.span.get_span_context()))
        if parent is None:
            return None
        span = tracer.start_span(
            STEP_SPAN,
            context=trace.set_span_in_context(parent),
            links=links,
            start_time=start_ns,
        )
        if span.is_recording():
            stats = engine.get_stats()
            free_blocks_after = engine.scheduler.block_manager.get_num_free_gpu_blocks()
            span.set_attributes(
                {
                    "llmserve.replica": self.replica_id,
                    "llmserve.step.id": step_input.step_id,
                    "llmserve.step.requests": len(sched_out.scheduled),
                    "llmserve.step.sequences": num_seqs,
                    "llmserve.step.prefill_tokens": num_prefill,
                    "llmserve.step.decode_tokens": num_decode,
                    "llmserve.step.blocks_allocated": max(
                        free_blocks_before - free_blocks_after, 0
                    ),
                    "llmserve.step.blocks_swapped_in": len(sched_out.blocks_to_swap_in),
                    "llmserve.step.blocks_swapped_out": len(sched_out.blocks_to_swap_out),
                    "llmserve.step.blocks_copied": len(sched_out.blocks_to_copy),
                    "llmserve.step.preemptions": len(sched_out.preempted),
                    "llmserve.step.spec_draft_tokens": sum(map(len, sched_out.drafts.values())),
                    "llmserve.kv_cache.gpu_usage": stats.gpu_kv_usage,
                    "llmserve.kv_cache.cpu_usage": stats.cpu_kv_usage,
                    "llmserve.requests.waiting": stats.num_waiting,
                    "llmserve.requests.running": stats.num_running,
                    "llmserve.requests.swapped": stats.num_swapped,
                }
            )
        return span

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        requests = self._requests
        if not requests:
            return
        for output in outputs:
            entry = requests.get(output.request_id)
            if entry is None:
                continue
            new_tokens = sum(len(c.token_ids) for c in output.outputs)
            if new_tokens and not entry.num_output_tokens:
                entry.span.add_event("first_token")
            entry.num_output_tokens += new_tokens
            if output.finished:
                del requests[output.request_id]
                reasons = sorted({str(c.finish_reason) for c in output.outputs if c.finish_reason})
                if output.error is not None:
                    reasons = ["error"]
                entry.span.add_event("finished", {"reason": ",".join(reasons)})
                entry.span.set_attributes(
                    {
                        "gen_ai.response.finish_reasons": reasons,
                        "gen_ai.usage.output_tokens": entry.num_output_tokens,
                    }
                )
                entry.span.end()


def _record_first_constrained(
    entry: RequestTrace, group: SequenceGroup, masks: dict[int, TokenMask]
) -> None:
    """Events `grammar_compiled` (how long the compile took, off the TTFT path) and
    `first_constrained_sample` (the first mask sent for the request)."""
    mask = next((masks[s.seq_id] for s in group.seqs if s.seq_id in masks), None)
    if mask is None:
        return
    entry.constrained = True
    grammar = group.seqs[0].grammar
    compile_seconds = grammar.compile_seconds() if grammar is not None else None
    if compile_seconds is not None:
        entry.span.add_event("grammar_compiled", {"seconds": compile_seconds})
    entry.span.add_event(
        "first_constrained_sample",
        {"mask_kind": mask.kind.name.lower(), "mask_tokens": len(mask.token_ids)},
    )


def step_traceparent(span: Span | None) -> str:
    """The traceparent the worker's execute span uses as its parent ("" without a span)."""
    if span is None:
        return ""
    with trace.use_span(span, end_on_exit=False):
        return current_traceparent()


def end_step_span(
    span: Span | None,
    forward_ns: int,
    sample_ns: int,
    error: BaseException | None = None,
    accepted_drafts: int | None = None,
) -> None:
    """`accepted_drafts`: the draft tokens kept, for a step that carried drafts."""
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    elif span.is_recording():
        span.set_attributes(
            {
                "llmserve.worker.forward_s": forward_ns / 1e9,
                "llmserve.worker.sample_s": sample_ns / 1e9,
            }
        )
        if accepted_drafts is not None:
            span.set_attribute("llmserve.step.spec_accepted_tokens", accepted_drafts)
    span.end()
