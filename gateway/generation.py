"""The gateway's request path, shared by the gRPC and OpenAI APIs.

`GenerationCore.prompt_from_*` tokenize and check prompts, `sampling_params` checks what a
request asks for (both APIs, one path; errors name the field); `generate()` sends
the request to the scheduler and turns its token deltas into text deltas per choice:
incremental detokenization, stop strings, logprobs with token text. Usage and timings are
the scheduler's, carried from its last message; finish reasons stay common.proto's
FinishReason until an API shapes them. A chat whose reasoning parser reads tags that are
special tokens (harmony's headers) has those decoded even when special tokens are skipped;
the parser keeps them out of what the client is sent.

Stop strings are sent to the scheduler, which finishes each choice at the token that completes
one (scheduler_service/engine/text_stops.py says why there). Here the same text is matched again only
to shape it: cut at the stop string (or after it, `include_stop_str_in_output`), with the text
that could begin a stop string held back until it is decided. A choice the gateway sees stop
takes no further tokens, text or usage.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from gateway import metrics
from gateway.admission import Admission
from gateway.generation_types import (
    ChoiceUpdate,
    GenerationInput,
    GenerationUpdate,
    LogprobEntry,
    Prompt,
    TokenInfo,
    Usage,
)
from gateway.request_spans import set_request_attributes, set_response_attributes
from gateway.scheduler_client import SchedulerClient
from gateway.tokenization import Tokenization, check_unicode
from llmserve.detokenizer import IncrementalDetokenizer
from llmserve.errors import FieldError, ModelNotFoundError, UnavailableError
from llmserve.limits import (
    RequestLimits,
    check_prompt_fits,
    check_prompt_tokens,
    check_sampling,
    check_stop,
)
from llmserve.logs import get_logger
from llmserve.proto_convert import finish_reason_name
from llmserve.sampling_params import SamplingParams, with_admission_seed
from llmserve.stop_strings import StopStringMatcher
from llmserve.telemetry import current_traceparent
from llmserve.v1 import common_pb2, scheduler_pb2

tracer = trace.get_tracer("llmserve.gateway")
log = get_logger(__name__)


@dataclass(slots=True)
class _ChoiceState:
    detokenizer: IncrementalDetokenizer | None
    matcher: StopStringMatcher | None
    done: bool = False


class GenerationCore:
    """Everything between an API request and the scheduler stream, for one served model."""

    def __init__(
        self,
        model_name: str,
        tokenization: Tokenization,
        scheduler: SchedulerClient,
        max_model_len: int | None = None,
        limits: RequestLimits | None = None,
        admission: Admission | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        self.model_name = model_name
        self.tokenization = tokenization
        self.scheduler = scheduler
        # The scheduler's (GetStatsResponse.max_model_len), learned once a worker has
        # connected there (gateway.readiness); None until then.
        self.max_model_len = max_model_len
        self.limits = limits or RequestLimits()
        self.admission = admission or Admission(1024)
        self.request_timeout_s = request_timeout_s
        self.created = int(time.time())
        # Seeds for requests that sample without one (with_admission_seed).
        self._seed_rng = random.Random()

    # -- validation and tokenization ---------------------------------------------------------

    def check_model(self, model: str | None, field_name: str = "model") -> None:
        if model and model != self.model_name:
            raise ModelNotFoundError(
                f"{field_name}: model {model!r} is not served here (serving {self.model_name!r})",
                field_name,
            )

    def prompt_from_text(self, text: str, field_name: str = "prompt") -> Prompt:
        if not isinstance(text, str) or not text:
            raise FieldError(field_name, "must be a non-empty string")
        check_unicode(text, field_name)
        return self._checked(Prompt(self.tokenization.encode(text), text), field_name)

    def timeout_for(self, client_timeout_s: float | None) -> float | None:
        """The request's time limit: the client's, capped by --request-timeout-s."""
        limits = [t for t in (client_timeout_s, self.request_timeout_s) if t is not None]
        return min(limits) if limits else None

    def prompt_from_ids(self, token_ids: Sequence[int], field_name: str = "prompt") -> Prompt:
        ids = list(token_ids)
        if not ids:
            raise FieldError(field_name, "must contain at least one token id")
        vocab = self.tokenization.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError(field_name, f"token id {bad!r} is outside [0, {vocab})")
        return self._checked(Prompt(ids), field_name)

    def prompt_from_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        field_name: str = "messages",
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        text = self.tokenization.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            field_name=field_name,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        ids = self.tokenization.encode(text, add_special_tokens=False)
        return self._checked(Prompt(ids, text), field_name)

    @property
    def context_len(self) -> int:
        """`max_model_len`; UNAVAILABLE until the scheduler has told it."""
        if self.max_model_len is None:
            raise UnavailableError(
                "the scheduler has no connected worker yet, so the model's context length "
                "is not known; retry later"
            )
        return self.max_model_len

    def _checked(self, prompt: Prompt, field_name: str) -> Prompt:
        check_prompt_tokens(self.limits, len(prompt.token_ids), field_name)
        check_prompt_fits(len(prompt.token_ids), self.context_len, field_name)
        return prompt

    def sampling_params(
        self,
        prompt: Prompt,
        build: Callable[[int], SamplingParams],
        stop: Sequence[str],
        client_name: Callable[[str], str],
    ) -> SamplingParams:
        """A request's sampling parameters, checked the one way both APIs check them.

        `build(max_tokens_left)` makes them (`max_tokens_left`: the default for a request
        that sets no max_tokens) and names its own errors; `client_name` maps a SamplingParams
        field to the request's name for it, so that every check here names what the client
        sent: max_tokens within what the prompt leaves of the context, this server's limits
        (llmserve.limits), then logprobs within the vocabulary."""
        left = self.context_len - len(prompt.token_ids)
        params = build(left)
        if params.max_tokens > left:
            raise FieldError(
                client_name("max_tokens"),
                f"{params.max_tokens} requested, but the prompt ({len(prompt.token_ids)} "
                f"tokens) leaves {left} of the model's {self.context_len}-token context",
            )
        check_sampling(self.limits, params, client_name)
        check_stop(self.limits, stop)
        vocab = self.tokenization.vocab_size
        for f in ("logprobs", "prompt_logprobs"):
            value = getattr(params, f)
            if value is not None and value > vocab:
                raise FieldError(
                    client_name(f),
                    f"{value} alternatives per token is more than the vocabulary holds "
                    f"({vocab} tokens)",
                )
        return params

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self, inp: GenerationInput, parent: otel_context.Context | None = None
    ) -> AsyncIterator[GenerationUpdate]:
        """Stream updates until every choice is finished. Closing the iterator aborts."""
        if inp.text.stop and not inp.text.detokenize:
            raise FieldError("stop", "stop strings need detokenize")
        # The span shows the client's seed; the assigned one stays internal (logs only).
        params = with_admission_seed(inp.params, self._seed_rng)
        # The span is never made current: this generator may be closed (a client went away)
        # from another task, where detaching a current-span token fails and OpenTelemetry
        # logs "Failed to detach context" with a traceback.
        span = tracer.start_span(
            f"{inp.operation} {self.model_name}", context=parent, kind=trace.SpanKind.SERVER
        )
        try:
            set_request_attributes(span, inp, self.model_name)
            async for update in self._generate(inp, params, span):
                yield update
        except Exception as exc:  # as start_as_current_span records: errors, not GeneratorExit
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()

    async def _generate(
        self, inp: GenerationInput, params: SamplingParams, span: trace.Span
    ) -> AsyncIterator[GenerationUpdate]:
        # The gateway's own clock feeds only its latency histograms (what a client sees, the
        # scheduler hop included); what the client is told is the scheduler's count.
        start = time.perf_counter_ns()
        first_token_ns = 0
        tokenizer = self.tokenization.tokenizer
        states = [
            _ChoiceState(
                IncrementalDetokenizer(
                    tokenizer,
                    inp.prompt.token_ids,
                    skip_special_tokens=inp.text.skip_special_tokens,
                    skip_ids=self._skipped_ids(inp),
                )
                if inp.text.detokenize
                else None,
                StopStringMatcher(
                    inp.text.stop, include_stop_str_in_output=inp.text.include_stop_str_in_output
                )
                if inp.text.stop
                else None,
            )
            for _ in range(params.n)
        ]
        finish_reasons: list[str] = []
        span_context = span.get_span_context()
        rlog = log.bind(
            request_id=inp.request_id,
            trace_id=format(span_context.trace_id, "032x") if span_context.is_valid else None,
        )
        rlog.info(
            "request received",
            operation=inp.operation,
            prompt_tokens=len(inp.prompt.token_ids),
            max_tokens=params.max_tokens,
            n=params.n,
            seed=params.seed,
            priority=inp.priority,
        )
        stream = self.scheduler.submit(
            inp.request_id,
            inp.prompt.token_ids,
            params,
            self.tokenization.eos_token_id,
            current_traceparent(span),
            inp.priority,
            inp.text.stop,
            not inp.text.skip_special_tokens,
            timeout_s=inp.timeout_s,
            grammar=inp.grammar,
            reasoning=None
            if inp.reasoning is None
            else inp.reasoning.scheduler_spec(self.tokenization.tag_ids, inp.grammar is not None),
        )
        try:
            first = True
            async for out in stream:
                update = GenerationUpdate(choices=[])
                if first and out.prompt_logprobs:
                    update.prompt_logprobs = self._prompt_logprobs(inp.prompt, out)
                first = False
                for delta in out.choices:
                    choice = self._choice_update(states[delta.index], delta)
                    if choice is None:
                        continue
                    if choice.token_ids and not first_token_ns:
                        first_token_ns = time.perf_counter_ns() - start
                        span.add_event("first_token")
                    if choice.finish_reason:
                        finish_reasons.append(finish_reason_name(choice.finish_reason) or "")
                    update.choices.append(choice)
                # The scheduler stops every choice (stop strings included) and sends the
                # request's usage and timings with its last output.
                if out.finished:
                    update.finished = True
                    update.usage = Usage.from_proto(out.usage)
                    update.metrics = out.metrics
                    set_response_attributes(span, update, finish_reasons)
                    metrics.record_finished(
                        finish_reasons,
                        update.usage,
                        first_token_ns,
                        time.perf_counter_ns() - start,
                    )
                    rlog.info(
                        "request finished",
                        finish_reasons=finish_reasons,
                        completion_tokens=update.usage.completion_tokens,
                        time_to_first_token_s=out.metrics.first_token_ns / 1e9,
                        e2e_s=out.metrics.e2e_ns / 1e9,
                    )
                    yield update
                    return
                if update.choices or update.prompt_logprobs:
                    yield update
        finally:
            # Sends Abort when the request is not finished (the client went away).
            await stream.aclose()

    def _skipped_ids(self, inp: GenerationInput) -> frozenset[int] | None:
        """Special tokens skipped but the tags the chat's reasoning parser reads (harmony's
        headers), which it takes out of what the client gets; None: the tokenizer's own
        skip_special_tokens decides."""
        fmt = None if inp.reasoning is None else inp.reasoning.format
        if not inp.text.skip_special_tokens or fmt is None or not fmt.special_tags:
            return None
        return self.tokenization.special_ids_but(fmt.special_tags)

    def _choice_update(
        self, state: _ChoiceState, delta: scheduler_pb2.ChoiceDelta
    ) -> ChoiceUpdate | None:
        if state.done:
            return None  # already finished here (the scheduler stops it in the same step)
        token_ids = list(delta.token_ids)
        finish = delta.finish_reason
        choice = ChoiceUpdate(delta.index, "", token_ids, finish_reason=finish)
        if (
            delta.HasField("stop_token_id")
            and delta.stop_token_id != self.tokenization.eos_token_id
        ):
            choice.stop_reason = delta.stop_token_id  # EOS is the normal end: no stop reason
        if delta.logprobs:
            choice.logprobs = [self._logprob_entry(lp.token, lp.top) for lp in delta.logprobs]
        if state.detokenizer is not None:
            text = state.detokenizer.add(token_ids)
            if finish:
                text += state.detokenizer.flush()
            if state.matcher is not None:
                check = state.matcher.feed(text)
                text = check.text
                if check.stop is not None:
                    choice.finish_reason = common_pb2.FINISH_REASON_STOP
                    choice.stop_reason = check.stop
                elif finish:
                    text += state.matcher.flush()
            choice.text = text
        state.done = choice.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        return choice

    def _token_info(self, t: common_pb2.TokenLogprob) -> TokenInfo:
        return TokenInfo(
            t.token_id, self.tokenization.tokenizer.decode([t.token_id]), t.logprob, t.rank
        )

    def _logprob_entry(self, token: common_pb2.TokenLogprob, top: Any) -> LogprobEntry:
        return LogprobEntry(self._token_info(token), [self._token_info(t) for t in top])

    def _prompt_logprobs(
        self, prompt: Prompt, out: scheduler_pb2.RequestOutput
    ) -> list[LogprobEntry | None]:
        entries: list[LogprobEntry | None] = [None] * len(prompt.token_ids)
        for p in out.prompt_logprobs:
            if p.position < len(entries):
                entries[p.position] = self._logprob_entry(p.token, p.top)
        return entries
