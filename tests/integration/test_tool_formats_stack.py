"""Template-native tool formats against a live stack: the real SmolLM2 model and tokenizer,
with chat templates in the Hermes and Llama 3 styles given by `--chat-template FILE` (the
gateway reads the format off each). Calls, streamed and whole, greedy and at temperature 1.0,
must be valid for their tool's schema (`jsonschema`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.test_structured_outputs import (
    ASK,
    HISTORY,
    MODEL,
    SAMPLINGS,
    TIME,
    WEATHER,
    WORKER_ARGS,
    check_call,
    stream_tool_calls,
)
from tests.support.grammar import smollm2_tokenizer
from tests.support.stack import RunningStack, start_stack
from tests.support.templates import template_path, template_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

# Template file -> the format the gateway must pick for it.
TEMPLATES = {"hermes": "hermes", "llama3": "llama3_json"}


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


def prompt_tokens(name: str, messages: list[dict[str, Any]], tools: list[Any]) -> int:
    """The prompt's length as the template itself renders the chat (tools, calls, results)."""
    tokenizer = smollm2_tokenizer()
    history = json.loads(json.dumps(messages))
    for m in history:
        m["content"] = m["content"] or ""
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(
        history,
        tools=tools,
        chat_template=template_text(name),
        add_generation_prompt=True,
        tokenize=False,
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


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
        assert completion.usage.prompt_tokens == prompt_tokens(name, messages, [WEATHER, TIME])


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


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_auto_gives_text_or_a_call(
    served: tuple[str, RunningStack, openai.OpenAI], sampling: dict[str, Any]
) -> None:
    _, _, client = served
    completion = client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=[WEATHER, TIME], max_tokens=120, **sampling
    )
    choice = completion.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for tc in choice.message.tool_calls:
            check_call({"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments})
    else:
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content
        assert "<tool_call>" not in choice.message.content
