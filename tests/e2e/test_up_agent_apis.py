"""The official `openai` and `anthropic` SDKs, unchanged, against `llmserve up` on the embedded
SmolLM2 (issue 51): OpenAI's Responses API (plain, streamed, a function call and its output in
a second turn) and Anthropic's Messages API (plain, streamed, tool use and its result,
count_tokens), behind an API key, with refusals in each API's own error shape.

One `up` serves the module; every answer is greedy and a few dozen tokens at most. Where the
model is free to call a tool again after a tool's result, SmolLM2 does; the second turns say
tool_choice "none" so that the answer is text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from anthropic.types import RawContentBlockDeltaEvent, RawMessageStartEvent, RawMessageStopEvent
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
)

from tests.support.models import EXACT_MODE_ARGS
from tests.support.up import interrupt, start_up

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.services]

KEY = "sk-llmserve-agent-apis"
FRANCE = "What is the capital of France?"
WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
RESULT = "Sunny, 24 degrees Celsius"
# SDK 2.x's messages.create has no temperature argument; the gateway takes the field.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def http_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp_path = tmp_path_factory.mktemp("up")
    keys = tmp_path / "api_keys"
    keys.write_text(KEY + "\n")
    # Exact mode: the answers checked below are HF's model's.
    proc, log, _, port = start_up(tmp_path, "--api-key-file", str(keys), *EXACT_MODE_ARGS)
    try:
        yield port
    finally:
        interrupt(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def oai(http_port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key=KEY, max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def claude(http_port: int) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key.
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{http_port}", api_key=KEY, max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    served = [m.id for m in oai.models.list()]
    assert len(served) == 1, served
    return served[0]


# -- OpenAI's Responses API -------------------------------------------------------------------


def test_responses_plain(oai: openai.OpenAI, model: str) -> None:
    response = oai.responses.create(
        model=model, input=FRANCE, max_output_tokens=24, temperature=0.0
    )
    assert response.status == "completed", response
    [message] = response.output
    assert (message.type, message.status) == ("message", "completed")
    assert "Paris" in response.output_text
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_responses_streamed(oai: openai.OpenAI, model: str) -> None:
    events = list(
        oai.responses.create(
            model=model, input=FRANCE, max_output_tokens=24, temperature=0.0, stream=True
        )
    )
    # The SDK parsed each event into its own class.
    assert isinstance(events[0], ResponseCreatedEvent)
    assert events[1].type == "response.in_progress"
    assert isinstance(events[-1], ResponseCompletedEvent)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(isinstance(e, ResponseTextDeltaEvent) for e in deltas)
    final = events[-1].response
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    assert "".join(e.delta for e in deltas) == final.output_text
    assert "Paris" in final.output_text


def test_responses_function_call_and_its_output(oai: openai.OpenAI, model: str) -> None:
    tool: Any = {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_SCHEMA,
    }
    # "required" with one call: the tool grammar makes the model call it, and stop.
    with oai.responses.stream(
        model=model,
        input=WEATHER_QUESTION,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0.0,
    ) as stream:
        streamed = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        first = stream.get_final_response()
    assert first.status == "completed", first
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.status == "completed"
    assert streamed == call.arguments
    arguments = json.loads(call.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    output: Any = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}

    # The whole conversation again, the call as the first response gave it...
    # (OpenAI's own way: the output items go back as they are, then the call's output.)
    conversation: Any = [{"role": "user", "content": WEATHER_QUESTION}, *first.output, output]
    explicit = oai.responses.create(
        model=model,
        input=conversation,
        tools=[tool],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0.0,
    )
    # ... or only the output, after the stored response: the same prompt.
    chained = oai.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[output],
        tools=[tool],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0.0,
    )
    assert chained.previous_response_id == first.id
    for second in (explicit, chained):
        assert [item.type for item in second.output] == ["message"], second
        assert second.output_text.strip()
    assert explicit.usage is not None and chained.usage is not None
    assert explicit.usage.input_tokens == chained.usage.input_tokens


def test_responses_unknown_previous_response_id(oai: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(
            model=model, input="Hi", previous_response_id="resp_never_made", max_output_tokens=4
        )
    body: Any = caught.value.body
    assert body["param"] == "previous_response_id"
    assert "resp_never_made" in body["message"]


def test_responses_wrong_key(http_port: int, model: str) -> None:
    stranger = openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as caught:
        stranger.responses.create(model=model, input="Hi", max_output_tokens=4)
    body: Any = caught.value.body
    assert body["code"] == "invalid_api_key"


# -- Anthropic's Messages API -----------------------------------------------------------------


def test_messages_plain_multi_turn(claude: anthropic.Anthropic, model: str) -> None:
    conversation: Any = {
        "system": "You are a geography teacher. Answer in one sentence.",
        "messages": [
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! Ask me about any country."},
            {"role": "user", "content": FRANCE},
        ],
    }
    message = claude.messages.create(model=model, max_tokens=24, extra_body=GREEDY, **conversation)
    assert message.type == "message" and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    assert "Paris" in message.content[0].text  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn", message
    assert 0 < message.usage.output_tokens < 24
    counted = claude.messages.count_tokens(model=model, **conversation)
    assert counted.input_tokens == message.usage.input_tokens


def test_messages_streamed(claude: anthropic.Anthropic, model: str) -> None:
    ask: Any = [{"role": "user", "content": "Write a long story about a ship at sea."}]
    with claude.messages.stream(
        model=model, max_tokens=12, messages=ask, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ]
    assert len(deltas) > 1
    assert [block.type for block in final.content] == ["text"]
    assert "".join(deltas) == final.content[0].text  # type: ignore[union-attr]
    # A long story does not fit in 12 tokens.
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 12)
    start = events[0]
    assert start.type == "message_start"
    assert start.message.usage.input_tokens == final.usage.input_tokens > 0

    # The raw events of stream=True, each parsed into its class.
    raw = list(
        claude.messages.create(
            model=model, max_tokens=12, messages=ask, extra_body=GREEDY, stream=True
        )
    )
    assert isinstance(raw[0], RawMessageStartEvent) and isinstance(raw[-1], RawMessageStopEvent)
    assert [e.type for e in raw[-2:]] == ["message_delta", "message_stop"]
    ending = raw[-2]
    assert ending.type == "message_delta"
    assert (ending.delta.stop_reason, ending.usage.output_tokens) == ("max_tokens", 12)
    text = [e.delta for e in raw if isinstance(e, RawContentBlockDeltaEvent)]
    assert text and all(delta.type == "text_delta" for delta in text)


def test_messages_tool_use_and_its_result(claude: anthropic.Anthropic, model: str) -> None:
    tool: Any = {
        "name": "get_weather",
        "description": "The current weather in a city",
        "input_schema": WEATHER_SCHEMA,
    }
    question: Any = {"role": "user", "content": WEATHER_QUESTION}
    # "any" with one call: the tool grammar makes the model call it, and stop.
    with claude.messages.stream(
        model=model,
        max_tokens=40,
        messages=[question],
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use", first
    assert [block.type for block in first.content] == ["tool_use"]
    use = first.content[0]
    assert use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str)
    assert json.loads(partial) == use.input

    result: Any = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
    }
    conversation: Any = {
        "messages": [question, {"role": "assistant", "content": first.content}, result],
        "tools": [tool],
        "tool_choice": {"type": "none"},
    }
    second = claude.messages.create(model=model, max_tokens=16, extra_body=GREEDY, **conversation)
    assert [block.type for block in second.content] == ["text"], second
    assert second.content[0].text.strip()  # type: ignore[union-attr]
    assert second.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=model, **conversation)
    assert counted.input_tokens == second.usage.input_tokens


def _anthropic_error(body: object, kind: str) -> str:
    """The message of Anthropic's error body of type `kind`; nothing of OpenAI's shape."""
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("messages", "max_tokens", "field"),
    [
        ([{"role": "user", "content": "Hi"}], 0, "max_tokens"),
        ([{"role": "system", "content": "Hi"}], 8, "messages[0].role"),
    ],
)
def test_messages_bad_request(
    claude: anthropic.Anthropic, model: str, messages: Any, max_tokens: int, field: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model, max_tokens=max_tokens, messages=messages)
    assert field in _anthropic_error(caught.value.body, "invalid_request_error")


def test_messages_unknown_model(claude: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(
            model=f"{model}-nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert f"{model}-nope" in _anthropic_error(caught.value.body, "not_found_error")


def test_messages_wrong_key(http_port: int, model: str) -> None:
    stranger = anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{http_port}", api_key="sk-wrong", max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    _anthropic_error(caught.value.body, "authentication_error")
