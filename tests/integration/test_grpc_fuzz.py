"""Hypothesis fuzz of the gateway's gRPC Generate through a live stack: random and malformed
field values (any uint32 / int64, NaN and infinite floats, empty and odd strings, unknown
roles, out-of-vocabulary ids) get either a complete stream or a client error naming a field,
never INTERNAL / UNKNOWN or a stream that breaks; the KV cache ends with every block free."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.support.hardening import blocks, gateway_gauges, is_idle, wait_idle
from tests.support.stack import TINY_SERVED_NAME, RunningStack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

MODEL = TINY_SERVED_NAME
UINT32 = 2**32 - 1
INT64 = 2**63 - 1
# What a malformed request may get: a client error, never INTERNAL, UNKNOWN or UNAVAILABLE.
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}


@pytest.fixture(scope="module")
def stack(tiny_stack: RunningStack) -> RunningStack:
    return tiny_stack


def _uint32(small: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, small), st.integers(0, UINT32))


_wild_floats = st.floats(allow_nan=True, allow_infinity=True)
_text = st.text(max_size=24)

# Each field's ordinary values, and anything its proto type can carry. A request takes up to
# two fields from the wild side, so that both refusals and complete streams are common.
_VALID: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 2),
    "use_beam_search": st.just(False),
    "temperature": st.floats(0, 1.5),
    "top_p": st.floats(0.1, 1),
    "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 0.5),
    "presence_penalty": st.floats(-1, 1),
    "frequency_penalty": st.floats(-1, 1),
    "repetition_penalty": st.floats(0.5, 1.5),
    "seed": st.integers(-INT64 - 1, INT64),
    "min_tokens": st.integers(0, 2),
    "stop_token_ids": st.lists(st.integers(0, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 3),
    "max_tokens": st.integers(1, 6),
}
_WILD: dict[str, st.SearchStrategy[Any]] = {
    "n": _uint32(3),
    "best_of": _uint32(4),
    "use_beam_search": st.booleans(),
    "length_penalty": _wild_floats,
    "temperature": _wild_floats,
    "top_p": _wild_floats,
    "top_k": _uint32(50),
    "min_p": _wild_floats,
    "presence_penalty": _wild_floats,
    "frequency_penalty": _wild_floats,
    "repetition_penalty": _wild_floats,
    "seed": st.integers(-INT64 - 1, INT64),
    "min_tokens": _uint32(4),
    "stop_token_ids": st.lists(_uint32(100), max_size=80),
    "ignore_eos": st.booleans(),
    "logprobs": _uint32(25),
    "prompt_logprobs": _uint32(25),
    "early_stopping": st.sampled_from([0, 1, 2, 3]),
    "max_tokens": _uint32(6),
}
_WILD_NAMES = [*_WILD, "model", "prompt", "stop", "priority"]

_message = st.builds(
    generation_pb2.ChatMessage,
    role=st.sampled_from(["user", "system", "assistant", "", "tool", "robot"]),
    content=_text,
)


@st.composite
def _sampling(draw: st.DrawFn, wild: set[str]) -> common_pb2.SamplingParams:
    values = {"max_tokens": draw(_VALID["max_tokens"])}
    for name in _WILD:
        if name in wild:
            values[name] = draw(_WILD[name])
        elif name in _VALID and draw(st.booleans()):
            values[name] = draw(_VALID[name])
    return common_pb2.SamplingParams(**values)


@st.composite
def generate_requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    wild = draw(st.sets(st.sampled_from(_WILD_NAMES), max_size=2))
    request = generation_pb2.GenerateRequest(
        model=draw(
            st.sampled_from(["", MODEL, "other-model"])
            if "model" in wild
            else st.sampled_from(["", MODEL])
        ),
        stop=draw(
            st.lists(_text, max_size=20)
            if "stop" in wild
            else st.lists(st.text(min_size=1, max_size=4), max_size=2)
        ),
        include_stop_str_in_output=draw(st.booleans()),
        echo=draw(st.booleans()),
        priority=draw(
            st.integers(-(2**31), 2**31 - 1) if "priority" in wild else st.integers(-2, 2)
        ),
        sampling_params=draw(_sampling(wild)),
    )
    for name in ("skip_special_tokens", "detokenize"):
        if draw(st.booleans()):
            setattr(request, name, draw(st.booleans()))
    kinds = ["text", "token_ids", "chat", "none"] if "prompt" in wild else ["text", "chat"]
    kind = draw(st.sampled_from(kinds))
    if kind == "text":
        request.text = draw(_text if "prompt" in wild else st.text(min_size=1, max_size=24))
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(_uint32(60_000), max_size=6)))
    elif kind == "chat":
        messages = (
            st.lists(_message, max_size=3)
            if "prompt" in wild
            else st.lists(
                st.builds(generation_pb2.ChatMessage, role=st.just("user"), content=_text),
                min_size=1,
                max_size=2,
            )
        )
        request.chat.messages.extend(draw(messages))
    return request


def _run(
    stub: generation_pb2_grpc.GenerationStub, request: generation_pb2.GenerateRequest
) -> tuple[grpc.StatusCode, Any]:
    responses = []
    try:
        for response in stub.Generate(request, timeout=120):
            responses.append(response)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, responses


def test_fuzzed_generate_requests_never_fail_inside(stack: RunningStack) -> None:
    outcomes: Counter[str] = Counter()
    with grpc.insecure_channel(stack.gateway) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @given(request=generate_requests())
        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def check(request: generation_pb2.GenerateRequest) -> None:
            code, result = _run(stub, request)
            outcomes[code.name] += 1
            if code != grpc.StatusCode.OK:
                assert code in CLIENT_ERRORS, (code, result, request)
                # The message starts with the field at fault ("sampling_params.n: ...").
                assert isinstance(result, str) and ":" in result, (result, request)
                return
            assert result, request
            last = result[-1]
            assert last.HasField("usage"), (result, request)
            n = request.sampling_params.n if request.sampling_params.HasField("n") else 1
            finished = {c.index for r in result for c in r.choices if c.finish_reason}
            assert finished == set(range(n)), (result, request)
            assert all(
                not math.isnan(lp.token.logprob)
                for r in result
                for c in r.choices
                for lp in c.logprobs
            )

        check()
    print(dict(outcomes))
    # Both kinds were exercised: some requests ran, some were refused.
    assert outcomes["OK"] > 0 and outcomes["INVALID_ARGUMENT"] > 0, dict(outcomes)
    stats = wait_idle(stack.scheduler)
    assert is_idle(stats), (stats.num_unfinished_requests, blocks(stats))
    gauges = gateway_gauges(httpx.get(stack.http_url + "/metrics", timeout=10).text)
    assert set(gauges.values()) == {0.0}, gauges
