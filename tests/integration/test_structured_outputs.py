"""Structured output and tool calling through the official OpenAI SDK, against a live stack
(worker on the embedded SmolLM2, scheduler, gateway as real processes). Every output is
checked against its schema with `jsonschema`, greedy and at temperature 1.0; `tool_choice`
"auto" must answer as the model does greedily, a call or text (HF's answer, the oracle)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from gateway.tool_formats.generic import system_text
from gateway.tools import parse_tools
from llmserve.limits import RequestLimits
from tests.support.models import EXACT_MODE_ARGS
from tests.support.stack import RunningStack, start_stack
from tests.support.tool_oracle import GENERIC_CALL, Answer, auto_answer, chat_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

MODEL = "smollm2"
WORKER_ARGS = [
    "--max-model-len", "2048", "--kv-cache-memory", "0.1", "--num-threads", "1",
    *EXACT_MODE_ARGS,
]  # fmt: skip
SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 3}, id="t1"),
]


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    favourite: Colour
    address: Address
    hobbies: list[str] = Field(max_length=3)
    nickname: str | None = Field(max_length=16)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use a tool."}]
# ASK, then the assistant's call and the tool's result.
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]
# Chats whose greedy answer under tool_choice="auto" is known both ways, from HF alone
# (tests/support/tool_oracle.py): a call, and text. In the generic envelope SmolLM2 leans to
# calls; it answers in text when told to.
AUTO_CHATS = {
    Answer.CALL: ASK,
    Answer.TEXT: [
        {
            "role": "user",
            "content": 'Answer with {"content": ...}. What is the capital of France?',
        }
    ],
}
AUTO_MAX_TOKENS = 100


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    running = start_stack(
        MODEL, tmp_path_factory.mktemp("structured-logs"), worker_args=WORKER_ARGS
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300
    )


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_parse_with_a_pydantic_model(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person who lives in Lyon as JSON."}],
        response_format=Person,
        max_tokens=400,
        **sampling,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_object(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a name."}],
        response_format={"type": "json_object"},
        max_tokens=300,
        **sampling,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice.finish_reason == "length"
        assert choice.message.content.startswith("{")


def stream_tool_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, dict], str, str]:
    calls: dict[int, dict] = {}
    content, finish = "", ""
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, stream=True, max_tokens=200, tools=[WEATHER, TIME], **kwargs
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id is not None:
                    assert call["id"] is None, "id sent twice"
                    call["id"] = tc.id
                    assert tc.type == "function"
                if tc.function.name is not None:
                    assert call["name"] is None, "name sent twice"
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, content, finish


def check_call(call: dict[str, Any]) -> None:
    tool = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
    assert call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


def check_answer(choice: Any, expected: Answer, call_start: str) -> None:
    """`choice` is the `expected` answer: calls valid for their tools' schemas, or text that
    holds no call (`call_start`: how the format starts one)."""
    if expected is Answer.CALL:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls, choice
        for tc in choice.message.tool_calls:
            check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments})
    else:
        assert choice.finish_reason in ("stop", "length"), choice
        assert not choice.message.tool_calls, choice
        assert choice.message.content, choice
        assert call_start not in choice.message.content, choice


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streamed_required_tool_call(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    calls, content, finish = stream_tool_calls(client, tool_choice="required", **sampling)
    assert finish == "tool_calls" and content == ""
    assert calls
    for call in calls.values():
        check_call(call)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streamed_named_tool_call(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    calls, _, finish = stream_tool_calls(
        client,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        **sampling,
    )
    assert finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_time"]
    check_call(calls[0])


def as_generic(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the generic tool format shows them to SmolLM2 when WEATHER and TIME are
    offered under "auto": its tools' system turn first (the gateway's own text, which only
    it knows; the tests check the served prompt's length against this chat's)."""
    tools = parse_tools([WEATHER, TIME], "auto", None, RequestLimits())
    return [{"role": "system", "content": system_text(tools)}, *messages]


@pytest.mark.parametrize("expected", list(Answer))
def test_auto_answers_as_the_model_would(client: openai.OpenAI, expected: Answer) -> None:
    messages = AUTO_CHATS[expected]
    prompt = chat_tokens(as_generic(messages))
    assert auto_answer("generic", prompt, AUTO_MAX_TOKENS) is expected  # the chat still does
    completion = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=AUTO_MAX_TOKENS,
        temperature=0.0,
    )
    assert completion.usage.prompt_tokens == len(prompt)  # the oracle read the served prompt
    check_answer(completion.choices[0], expected, GENERIC_CALL)


def test_auto_sampled_answer_is_well_formed(client: openai.OpenAI) -> None:
    """At temperature 1.0 either answer may come; whichever does is well-formed."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=AUTO_CHATS[Answer.CALL],
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=AUTO_MAX_TOKENS,
        temperature=1.0,
        seed=3,
    )
    choice = completion.choices[0]
    check_answer(choice, Answer.CALL if choice.message.tool_calls else Answer.TEXT, GENERIC_CALL)


def test_tool_results_are_rendered_into_the_prompt(client: openai.OpenAI) -> None:
    """The call and its result reach the prompt as the generic format writes them: the call
    as the envelope the model would have answered, the result as a user turn naming it."""
    seen = as_generic(
        [
            *ASK,
            {
                "role": "assistant",
                "content": '{"tool_calls": [{"name": "get_weather", '
                '"arguments": {"city": "Paris", "unit": "celsius"}}]}',
            },
            {"role": "user", "content": "Result of tool call call_1: 18 degrees, sunny"},
        ]
    )
    completion = client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=[WEATHER, TIME], max_tokens=1, temperature=0.0
    )
    assert completion.usage.prompt_tokens == len(chat_tokens(seen))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_regex_and_choice_through_extra_body(
    client: openai.OpenAI, sampling: dict[str, Any]
) -> None:
    regex = r"[0-9]{3}-[A-Z]{2}"
    out = client.completions.create(
        model=MODEL,
        prompt="A code:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex}},
        **sampling,
    )
    assert re.fullmatch(regex, out.choices[0].text)
    assert out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
        **sampling,
    )
    assert chat.choices[0].message.content in ("yes", "no", "maybe not")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"not": {}}}},
                    },
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "format": "bogus-format"},
                    },
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1, 2]},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        (
            {"structured_outputs": {"grammar": "start: nothing_defined"}},
            "structured_outputs.grammar",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
    ],
)
def test_bad_grammars_are_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=body)
    assert exc.value.body["param"] == param, exc.value.body


def test_scheduler_metrics_count_grammar_work(client: openai.OpenAI, stack: RunningStack) -> None:
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is it raining?"}],
        max_tokens=10,
        temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["it is raining now", "it is dry now"]}},
    )
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['scheduler']}/metrics").text
    worker_text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics").text

    def value(name: str, source: str = text) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in source.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    assert value("llmserve_grammar_compile_seconds_count") >= 1
    assert value("llmserve_grammar_mask_seconds_count") >= 1
    assert value("llmserve_grammar_masked_rows_total") >= 1
    # "it is " is forced once the grammar has seen "it": both choices share it.
    assert value("llmserve_grammar_forced_tokens_total") >= 1
    # The masks follow their steps: each constrained step's wait for them is counted.
    assert value("llmserve_worker_mask_wait_seconds_count", worker_text) >= 1


def test_grpc_generate_takes_a_grammar_and_refuses_a_bad_one(stack: RunningStack) -> None:
    from llmserve.client import build_request
    from llmserve.grammar.spec import GrammarKind, GrammarSpec
    from llmserve.grpc_utils import channel_options
    from llmserve.v1 import common_pb2, generation_pb2_grpc

    with grpc.insecure_channel(stack.gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        good = GrammarSpec(GrammarKind.REGEX, "[0-9]{4}", "")
        responses = list(
            stub.Generate(
                build_request("Year:", max_tokens=10, temperature=0.0, grammar=good), timeout=120
            )
        )
        text = "".join(c.text for r in responses for c in r.choices)
        assert re.fullmatch("[0-9]{4}", text), text
        assert responses[-1].choices[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        bad = GrammarSpec(GrammarKind.REGEX, "[0-", "")
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(build_request("Year:", max_tokens=10, grammar=bad), timeout=60))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grammar" in exc.value.details()
