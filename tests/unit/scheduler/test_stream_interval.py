"""A stream interval (`FleetConfig.stream_interval`): the router holds a request's deltas until a
choice has gathered that many tokens, sends its first tokens and its end at once, and a request
resumed from what its gateway was sent never sends the held tokens it dropped."""

from __future__ import annotations

import asyncio

import pytest

from gateway.inflight import unbatched
from llmserve.errors import FieldError
from llmserve.proto_convert import sampling_params_to_proto
from llmserve.sampling_params import SamplingParams
from llmserve.steps import TokenLogprob
from llmserve.v1 import scheduler_pb2
from scheduler_service.engine import SchedulerConfig
from scheduler_service.engine.request_output import (
    CompletionOutput,
    RequestOutput,
    extend_delta,
    owned_delta,
)
from scheduler_service.engine.sequence import FinishReason, SampleLogprobs
from scheduler_service.fleet.fleet_config import FleetConfig, ReplicaConfig
from scheduler_service.fleet.router import GatewayStream, Router

PROMPT = [1, 2, 3]


def fleet_config(stream_interval: int) -> FleetConfig:
    return FleetConfig(
        ReplicaConfig(SchedulerConfig(8, 64, 64, True)), stream_interval=stream_interval
    )


def delta(key: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    choice = CompletionOutput(
        0, tokens, -0.5 * tokens[-1], None, FinishReason.LENGTH if finished else None
    )
    return RequestOutput(key, PROMPT, [choice], finished)


def sent(stream: GatewayStream) -> list[scheduler_pb2.RequestOutput]:
    outputs = []
    while not stream.outbox.empty():
        message = stream.outbox.get_nowait()
        assert message is not None
        for m in unbatched(message):
            assert m.WhichOneof("kind") == "output", m
            outputs.append(m.output)
    return outputs


def run_with_router(interval: int, body) -> None:  # type: ignore[no-untyped-def]
    """`body(router, stream, key)` with one request added (no worker: it waits unplaced, and
    the test feeds the router its deltas)."""

    async def main() -> None:
        router = Router(fleet_config(interval))
        stream = router.open_stream("gateway")
        router.add(
            stream,
            scheduler_pb2.AddRequest(
                request_id="r",
                prompt_token_ids=PROMPT,
                sampling_params=sampling_params_to_proto(SamplingParams(max_tokens=16)),
            ),
        )
        assert stream.outbox.empty()  # admitted, no error
        body(router, stream, stream.key("r"))
        router.close_stream(stream)

    asyncio.run(main())


def test_deltas_wait_for_the_interval_but_the_first_tokens_and_the_end_go_at_once() -> None:
    def body(router: Router, stream: GatewayStream, key: str) -> None:
        router.on_outputs([delta(key, [10])])
        first = sent(stream)
        assert [list(o.choices[0].token_ids) for o in first] == [[10]]
        eleven = delta(key, [11])
        router.on_outputs([eleven])
        router.on_outputs([delta(key, [12])])
        assert sent(stream) == []
        router.on_outputs([delta(key, [13])])
        third = sent(stream)
        assert [list(o.choices[0].token_ids) for o in third] == [[11, 12, 13]]
        assert third[0].choices[0].cumulative_logprob == pytest.approx(-6.5)
        router.on_outputs([delta(key, [14])])
        assert sent(stream) == []
        router.on_outputs([delta(key, [15], finished=True)])
        (last,) = sent(stream)
        assert list(last.choices[0].token_ids) == [14, 15]
        assert last.finished and last.choices[0].finish_reason != 0
        assert last.usage.completion_tokens == 6
        assert last.usage.prompt_tokens == len(PROMPT)
        assert eleven.outputs[0].token_ids == [11]  # the router held a copy, not the delta

    run_with_router(3, body)


def test_an_interval_of_one_sends_every_delta_as_it_comes() -> None:
    def body(router: Router, stream: GatewayStream, key: str) -> None:
        for token in (10, 11, 12):
            router.on_outputs([delta(key, [token])])
            assert [list(o.choices[0].token_ids) for o in sent(stream)] == [[token]]

    run_with_router(1, body)


def test_a_resumed_request_drops_what_it_held_and_goes_on_from_what_was_sent() -> None:
    def body(router: Router, stream: GatewayStream, key: str) -> None:
        router.on_outputs([delta(key, [10])])
        router.on_outputs([delta(key, [11])])  # held
        assert [list(o.choices[0].token_ids) for o in sent(stream)] == [[10]]
        snapshot = router.resume_snapshot(key)
        assert snapshot is not None
        assert [s.output_token_ids for s in snapshot.seqs] == [[10]]
        # The request's next replica computes token 11 again (as 21 here) and goes on.
        router.on_outputs([delta(key, [21])])
        router.on_outputs([delta(key, [22], finished=True)])
        (last,) = sent(stream)
        assert list(last.choices[0].token_ids) == [21, 22]
        assert last.usage.completion_tokens == 3

    run_with_router(4, body)


def test_an_error_goes_at_once_and_ends_the_request() -> None:
    def body(router: Router, stream: GatewayStream, key: str) -> None:
        router.on_outputs([delta(key, [10])])
        router.on_outputs([delta(key, [11])])
        sent(stream)
        failed = RequestOutput(key, PROMPT, [], True, error=FieldError("grammar", "no match"))
        router.on_outputs([failed])
        (message,) = [m for item in drain(stream) for m in unbatched(item)]
        assert message.WhichOneof("kind") == "error"
        assert message.error.request_id == "r" and message.error.field == "grammar"
        assert not router.is_routed(key)

    run_with_router(4, body)


def drain(stream: GatewayStream) -> list[scheduler_pb2.SchedulerMessage]:
    items = []
    while not stream.outbox.empty():
        item = stream.outbox.get_nowait()
        assert item is not None
        items.append(item)
    return items


def logprob(token: int) -> SampleLogprobs:
    return SampleLogprobs(TokenLogprob(token, -float(token), 1))


def test_extended_deltas_keep_each_choice_in_order_with_its_latest_state() -> None:
    first = RequestOutput(
        "r",
        PROMPT,
        [
            CompletionOutput(0, [1], -1.0, [logprob(1)]),
            CompletionOutput(1, [5], -5.0, [logprob(5)]),
        ],
        False,
    )
    then = RequestOutput(
        "r",
        PROMPT,
        [
            CompletionOutput(1, [6, 7], -18.0, [logprob(6), logprob(7)], FinishReason.STOP, 7),
            CompletionOutput(2, [9], -9.0, [logprob(9)]),
        ],
        False,
    )
    both = owned_delta(first)
    extend_delta(both, then)
    assert [c.index for c in both.outputs] == [0, 1, 2]
    zero, one, two = both.outputs
    assert (zero.token_ids, zero.cumulative_logprob) == ([1], -1.0)
    assert one.token_ids == [5, 6, 7]
    assert [lp.token.token_id for lp in one.logprobs or []] == [5, 6, 7]
    assert (one.cumulative_logprob, one.finish_reason, one.stop_token_id) == (
        -18.0,
        FinishReason.STOP,
        7,
    )
    assert two.token_ids == [9]
    # The original deltas are left as they were.
    assert first.outputs[1].token_ids == [5] and then.outputs[0].token_ids == [6, 7]
    assert [lp.token.token_id for lp in first.outputs[1].logprobs or []] == [5]


def test_a_stream_interval_below_one_is_refused_naming_the_field() -> None:
    with pytest.raises(FieldError) as err:
        fleet_config(0)
    assert err.value.field == "stream_interval"
