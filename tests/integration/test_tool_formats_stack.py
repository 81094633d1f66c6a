"""Template-native tool formats against a live stack: the real SmolLM2 model and tokenizer,
with chat templates in the Hermes and Llama 3 styles given by `--chat-template FILE` (the
gateway reads the format off each). Calls, streamed and whole, greedy and at temperature 1.0,
must be valid for their tool's schema (`jsonschema`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.test_structured_outputs import (
    ASK,
    AUTO_MAX_TOKENS,
    HISTORY,
    MODEL,
    SAMPLINGS,
    TIME,
    WEATHER,
    WORKER_ARGS,
    check_answer,
    check_call,
    stream_tool_calls,
)
from tests.support.stack import RunningStack, start_stack
from tests.support.templates import template_path
from tests.support.tool_oracle import Answer, auto_answer, chat_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

# Template file -> the format the gateway must pick for it.
TEMPLATES = {"hermes": "hermes", "llama3": "llama3_json"}
# How each template's format starts a call, which a text answer must not hold.
CALL_STARTS = {"hermes": "<tool_call>", "llama3": '{"name"'}
# Chats whose greedy answer under tool_choice="auto" is known both ways, by template, from HF
# alone (tests/support/tool_oracle.py): a call, and text. SmolLM2 calls only when shown or
# told how: the Hermes chat answered an earlier question with a call.
SEA = [{"role": "user", "content": "Write one sentence about the sea."}]
AUTO_CHATS = {
    "hermes": {
        Answer.CALL: [
            {"role": "user", "content": "What's the weather in London in celsius?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "London", "unit": "celsius"}',
                        },
                    }
                ],
            },
            {"role": "user", "content": "What's the weather in Paris in celsius?"},
        ],
        Answer.TEXT: SEA,
    },
    "llama3": {
        Answer.CALL: [
            {
                "role": "user",
                "content": "What's the weather in Paris in celsius? Reply with only the JSON object.",
            }
        ],
        Answer.TEXT: SEA,
    },
}


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, RunningStack, openai.OpenAI]]:
    name = request.param
    stack = start_stack(
        MODEL,
        tmp_path_factory.mktemp(f"tools-{name}"),
        worker_args=WORKER_ARGS,
        gateway_args=["--chat-template", str(template_path(name))],
    )
    client = openai.OpenAI(
        base_url=stack.http_url + "/v1", api_key="none", max_retries=0, timeout=300
    )
    yield name, stack, client
    stack.stop()


def test_the_format_is_read_off_the_template(served: tuple[str, RunningStack, Any]) -> None:
    name, stack, _ = served
    assert f'"format": "{TEMPLATES[name]}"' in stack.logs("gateway") or (
        f"format={TEMPLATES[name]}" in stack.logs("gateway")
    )


def test_prompt_is_the_templates_own_rendering(
    served: tuple[str, RunningStack, openai.OpenAI],
) -> None:
    name, _, client = served
    for messages in (ASK, HISTORY):
        completion = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=1, temperature=0.0
        )
        assert completion.usage.prompt_tokens == len(chat_tokens(messages, [WEATHER, TIME], name))


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streamed_required_calls(
    served: tuple[str, RunningStack, openai.OpenAI], sampling: dict[str, Any]
) -> None:
    _, _, client = served
    calls, content, finish = stream_tool_calls(
        client, tool_choice="required", parallel_tool_calls=False, **sampling
    )
    assert finish == "tool_calls" and content == ""
    assert len(calls) == 1
    check_call(calls[0])


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_streamed_named_call(
    served: tuple[str, RunningStack, openai.OpenAI], sampling: dict[str, Any]
) -> None:
    _, _, client = served
    calls, _, finish = stream_tool_calls(
        client,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        **sampling,
    )
    assert finish == "tool_calls"
    assert {c["name"] for c in calls.values()} == {"get_time"}
    for call in calls.values():
        check_call(call)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_whole_named_and_required_calls(
    served: tuple[str, RunningStack, openai.OpenAI], sampling: dict[str, Any]
) -> None:
    _, _, client = served
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        completion = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=200,
            **sampling,
        )
        out = completion.choices[0]
        assert out.finish_reason == "tool_calls"
        (tc,) = out.message.tool_calls
        check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments})
        if isinstance(choice, dict):
            assert tc.function.name == "get_weather"


@pytest.mark.parametrize("expected", list(Answer))
def test_auto_answers_as_the_model_would(
    served: tuple[str, RunningStack, openai.OpenAI], expected: Answer
) -> None:
    name, _, client = served
    messages = AUTO_CHATS[name][expected]
    prompt = chat_tokens(messages, [WEATHER, TIME], name)
    assert auto_answer(TEMPLATES[name], prompt, AUTO_MAX_TOKENS) is expected  # the chat still does
    completion = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=AUTO_MAX_TOKENS,
        temperature=0.0,
    )
    assert completion.usage.prompt_tokens == len(prompt)  # the oracle read the served prompt
    check_answer(completion.choices[0], expected, CALL_STARTS[name])


def test_auto_sampled_answer_is_well_formed(
    served: tuple[str, RunningStack, openai.OpenAI],
) -> None:
    """At temperature 1.0 either answer may come; whichever does is well-formed."""
    name, _, client = served
    completion = client.chat.completions.create(
        model=MODEL,
        messages=AUTO_CHATS[name][Answer.CALL],
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=AUTO_MAX_TOKENS,
        temperature=1.0,
        seed=3,
    )
    choice = completion.choices[0]
    got = Answer.CALL if choice.message.tool_calls else Answer.TEXT
    check_answer(choice, got, CALL_STARTS[name])
