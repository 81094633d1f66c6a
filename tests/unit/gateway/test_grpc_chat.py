"""Chats on the gRPC API, in process against the fake scheduler: tools, chat_template_kwargs and
a thinking budget in; reasoning, answer and tool calls out as fields of their own, read by the
HTTP chat route's parsers. The think_tokenizer with tests/support/templates/think.jinja thinks
in <think> blocks and writes calls the Hermes way; hermes.jinja only writes calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from gateway.generation import GenerationCore
from gateway.generation_types import GenerationInput
from gateway.grpc_api import GenerationServicer
from gateway.openai_api import build_app
from gateway.tokenization import Tokenization
from llmserve.v1 import common_pb2, generation_pb2
from tests.support.templates import template_text
from tests.unit.gateway.test_openai_routes import MODEL, FakeScheduler
from tests.unit.gateway.test_reasoning_routes import OPENED, ids
from tests.unit.gateway.test_validation_path import grpc_generate

Chat = generation_pb2.Chat
ChatMessage = generation_pb2.ChatMessage
ToolCall = generation_pb2.ToolCall

ASK = ChatMessage(role="user", content="What is the weather in Paris?")
WEATHER = generation_pb2.Tool(
    name="get_weather",
    description="The weather in a city.",
    parameters='{"type": "object", "properties": {"city": {"type": "string"}}}',
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make_core(
    tokenizer: Any, tokens: list[int], template: str | None = "think", **tokenization: Any
) -> tuple[GenerationCore, FakeScheduler, list[GenerationInput]]:
    """A core over the fake scheduler, and the inputs it was given to generate (`template`:
    one of tests/support/templates, None for the tokenizer's own)."""
    scheduler = FakeScheduler(tokens, finish=common_pb2.FINISH_REASON_STOP)
    core = GenerationCore(
        MODEL,
        Tokenization(tokenizer, template and template_text(template), **tokenization),
        scheduler,  # type: ignore[arg-type]
        4096,
    )
    inputs: list[GenerationInput] = []
    generate = core.generate

    def recording(inp: GenerationInput, parent: Any = None) -> Any:
        inputs.append(inp)
        return generate(inp, parent)

    core.generate = recording  # type: ignore[method-assign]
    return core, scheduler, inputs


def generate(core: GenerationCore, chat: Chat, **fields: Any) -> list[generation_pb2.Choice]:
    """One choice's messages, one per response (the fake sends one token each)."""
    responses = grpc_generate(core, generation_pb2.GenerateRequest(chat=chat, **fields))
    assert isinstance(responses, list), responses
    return [c for r in responses for c in r.choices]


def refused(core: GenerationCore, chat: Chat, **fields: Any) -> str:
    """The field an INVALID_ARGUMENT names."""
    error = grpc_generate(core, generation_pb2.GenerateRequest(chat=chat, **fields))
    assert isinstance(error, grpc.aio.AioRpcError), error
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    return error.details().split(": ", 1)[0]


def calls(choices: list[generation_pb2.Choice]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for choice in choices for c in choice.tool_calls]


# -- reasoning --------------------------------------------------------------------------------


def test_reasoning_and_answer_come_apart_as_streamed(think_tokenizer: Any) -> None:
    core, scheduler, _ = make_core(think_tokenizer, ids(think_tokenizer, *OPENED))
    responses = grpc_generate(core, generation_pb2.GenerateRequest(chat=Chat(messages=[ASK])))
    assert isinstance(responses, list), responses
    choices = [c for r in responses for c in r.choices]
    # Deltas as they come: the tag and the whitespace around it are in neither field.
    assert [c.reasoning for c in choices if c.reasoning] == ["Add", " them", "."]
    assert [c.text for c in choices if c.text] == ["It", " is", " four", "."]
    # The reasoning is over before the answer starts.
    last_reasoning = max(i for i, c in enumerate(choices) if c.reasoning)
    first_answer = min(i for i, c in enumerate(choices) if c.text)
    assert last_reasoning < first_answer
    assert choices[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    usage = responses[-1].usage
    # Tokens up to and with </think>: "Add", " them", ".", "\n", "</think>".
    assert usage.HasField("reasoning_tokens") and usage.reasoning_tokens == 5
    assert usage.completion_tokens == len(OPENED)
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert prompt.endswith("assistant\n<think>\n")


def test_reasoning_and_answer_join_whole(think_tokenizer: Any) -> None:
    # Each piece several tokens, cut anywhere: the joined fields are the same.
    text = "First add.\nThen check.\n</think>\n\nIt is four."
    tokens = think_tokenizer.encode(text, add_special_tokens=False)
    core, _, _ = make_core(think_tokenizer, tokens)
    choices = generate(core, Chat(messages=[ASK]))
    assert "".join(c.reasoning for c in choices) == "First add.\nThen check."
    assert "".join(c.text for c in choices) == "It is four."


def test_enable_thinking_false_leaves_the_answer_alone(think_tokenizer: Any) -> None:
    core, scheduler, _ = make_core(think_tokenizer, ids(think_tokenizer, "It", " is", " four"))
    chat = Chat(messages=[ASK], chat_template_kwargs='{"enable_thinking": false}')
    choices = generate(core, chat)
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    # The template closed an empty block: the output starts as the answer.
    assert prompt.endswith("assistant\n<think>\n\n</think>\n\n")
    assert "".join(c.text for c in choices) == "It is four"
    assert [c.reasoning for c in choices] == ["", "", ""]


def test_without_a_reasoning_parser_the_text_is_all_answer(think_tokenizer: Any) -> None:
    core, _, _ = make_core(think_tokenizer, ids(think_tokenizer, *OPENED), reasoning_parser="none")
    responses = grpc_generate(core, generation_pb2.GenerateRequest(chat=Chat(messages=[ASK])))
    assert isinstance(responses, list), responses
    text = "".join(c.text for r in responses for c in r.choices)
    assert text == "Add them.\n</think>\n\nIt is four."
    assert not responses[-1].usage.HasField("reasoning_tokens")


def test_a_thinking_budget_is_carried(think_tokenizer: Any) -> None:
    core, _, inputs = make_core(think_tokenizer, ids(think_tokenizer, *OPENED))
    generate(core, Chat(messages=[ASK], thinking_token_budget=64))
    generate(core, Chat(messages=[ASK]))
    assert [i.reasoning.budget for i in inputs] == [64, None]


def test_a_thinking_budget_needs_a_reasoning_parser(think_tokenizer: Any) -> None:
    core, scheduler, _ = make_core(
        think_tokenizer, ids(think_tokenizer, "x"), reasoning_parser="none"
    )
    chat = Chat(messages=[ASK], thinking_token_budget=64)
    assert refused(core, chat) == "chat.thinking_token_budget"
    assert scheduler.submitted == []


# -- tools ------------------------------------------------------------------------------------


def test_a_tool_call_comes_back_as_a_field(think_tokenizer: Any) -> None:
    # A call written while thinking is reasoning, not a call.
    text = f"I could write {CALL} here.\n</think>\n\n{CALL}"
    core, scheduler, _ = make_core(
        think_tokenizer, think_tokenizer.encode(text, add_special_tokens=False)
    )
    choices = generate(core, Chat(messages=[ASK], tools=[WEATHER]))
    assert "".join(c.reasoning for c in choices) == f"I could write {CALL} here."
    assert "".join(c.text for c in choices) == ""
    assert calls(choices) == [("get_weather", '{"city": "Paris"}')]
    # Sent once, whole, with the choice's last response (only then is a last call complete).
    assert [len(c.tool_calls) for c in choices[:-1]] == [0] * (len(choices) - 1)
    assert choices[-1].tool_calls[0].id.startswith("call_")
    assert choices[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    # The template was given the tools, and the tool grammar went to the scheduler.
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    grammar = scheduler.submitted[0].grammar
    assert grammar is not None and grammar.field == "tools"


def test_a_call_is_sent_when_the_next_one_begins(smollm2_tokenizer: Any) -> None:
    second = CALL.replace("Paris", "Oslo")
    tokens = smollm2_tokenizer.encode(f"{CALL}\n{second}", add_special_tokens=False)
    core, _, _ = make_core(smollm2_tokenizer, tokens, template="hermes")
    responses = grpc_generate(
        core, generation_pb2.GenerateRequest(chat=Chat(messages=[ASK], tools=[WEATHER]))
    )
    assert isinstance(responses, list), responses
    choices = [c for r in responses for c in r.choices]
    sent_at = [i for i, c in enumerate(choices) for _ in c.tool_calls]
    assert calls(choices) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Oslo"}'),
    ]
    # The first goes out before the stream ends, the second with the last response.
    assert sent_at[0] < len(choices) - 1 and sent_at[1] == len(choices) - 1
    assert "".join(c.text for c in choices) == ""
    # No reasoning parser for a template without <think>: no reasoning count either.
    assert not responses[-1].usage.HasField("reasoning_tokens")


def test_both_apis_read_the_same_output_the_same_way(think_tokenizer: Any) -> None:
    text = f"Look it up.\n</think>\n\nChecking. {CALL}"
    tokens = think_tokenizer.encode(text, add_special_tokens=False)
    core, _, _ = make_core(think_tokenizer, tokens)
    responses = grpc_generate(
        core, generation_pb2.GenerateRequest(chat=Chat(messages=[ASK], tools=[WEATHER]))
    )
    assert isinstance(responses, list), responses
    choices = [c for r in responses for c in r.choices]
    over_grpc = (
        "".join(c.reasoning for c in choices),
        "".join(c.text for c in choices),
        calls(choices),
        responses[-1].usage.reasoning_tokens,
    )
    body = {
        "messages": [{"role": "user", "content": ASK.content}],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": WEATHER.name,
                    "description": WEATHER.description,
                    "parameters": json.loads(WEATHER.parameters),
                },
            }
        ],
    }
    r = TestClient(build_app(core)).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message, usage = r.json()["choices"][0]["message"], r.json()["usage"]
    over_http = (
        message["reasoning_content"],
        message["content"],
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]],
        usage["completion_tokens_details"]["reasoning_tokens"],
    )
    assert over_grpc == over_http
    assert over_grpc[:3] == ("Look it up.", "Checking.", [("get_weather", '{"city": "Paris"}')])


def second_turn() -> Chat:
    """The conversation after the model called get_weather, with the tool's answer."""
    return Chat(
        messages=[
            ASK,
            ChatMessage(
                role="assistant",
                tool_calls=[
                    ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
                ],
            ),
            ChatMessage(role="tool", content="18 C and sunny", tool_call_id="call_1"),
        ],
        tools=[WEATHER],
    )


@pytest.mark.parametrize(
    ("template", "rendered"),
    [
        # hermes.jinja writes the earlier call (its arguments as an object) and the result.
        (
            "hermes",
            "<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C and sunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ),
        # SmolLM2's own template knows no tools: the generic format writes the call as the
        # envelope the model would have written, and the result as a user turn naming it.
        (
            None,
            "<|im_start|>assistant\n"
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
            "<|im_end|>\n<|im_start|>user\nResult of tool call call_1: 18 C and sunny"
            "<|im_end|>\n<|im_start|>assistant\n",
        ),
    ],
)
def test_a_second_turn_renders_the_call_and_its_result(
    smollm2_tokenizer: Any, template: str | None, rendered: str
) -> None:
    core, scheduler, _ = make_core(smollm2_tokenizer, ids(smollm2_tokenizer, "It"), template)
    choices = generate(core, second_turn())
    assert "".join(c.text for c in choices) == "It"
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert rendered in prompt


def test_tokenize_renders_a_chat_as_generate_does(smollm2_tokenizer: Any) -> None:
    core, scheduler, _ = make_core(smollm2_tokenizer, ids(smollm2_tokenizer, "x"), "hermes")
    generate(core, second_turn())
    request = generation_pb2.TokenizeRequest(chat=second_turn())
    reply = asyncio.run(GenerationServicer(core).Tokenize(request, None))  # type: ignore[arg-type]
    assert list(reply.token_ids) == scheduler.submitted[0].prompt_token_ids


def test_tool_choice_none_leaves_the_tools_out(smollm2_tokenizer: Any) -> None:
    core, scheduler, _ = make_core(smollm2_tokenizer, ids(smollm2_tokenizer, "Hi"), "hermes")
    none = generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE)
    choices = generate(core, Chat(messages=[ASK], tools=[WEATHER], tool_choice=none))
    assert [c.text for c in choices] == ["Hi"]
    assert scheduler.submitted[0].grammar is None
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert "get_weather" not in prompt


# -- bad input --------------------------------------------------------------------------------


def _tool(parameters: str, name: str = "get_weather") -> generation_pb2.Tool:
    return generation_pb2.Tool(name=name, parameters=parameters)


@pytest.mark.parametrize(
    ("chat", "fields", "field"),
    [
        (
            Chat(
                messages=[ASK],
                tools=[WEATHER],
                tool_choice=generation_pb2.ToolChoice(function_name="get_time"),
            ),
            {},
            "chat.tool_choice.function_name",
        ),
        (
            Chat(messages=[ASK], tools=[WEATHER], tool_choice=generation_pb2.ToolChoice(mode=9)),  # type: ignore[arg-type]
            {},
            "chat.tool_choice.mode",
        ),
        (
            Chat(
                messages=[ASK],
                tool_choice=generation_pb2.ToolChoice(
                    mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED
                ),
            ),
            {},
            "chat.tool_choice",
        ),
        (Chat(messages=[ASK], tools=[_tool('"an object"')]), {}, "chat.tools[0].parameters"),
        (Chat(messages=[ASK], tools=[_tool('{"type": ')]), {}, "chat.tools[0].parameters"),
        (
            Chat(messages=[ASK], tools=[_tool("{}", name="get weather")]),
            {},
            "chat.tools[0].name",
        ),
        (Chat(messages=[ASK], tools=[WEATHER, WEATHER]), {}, "chat.tools"),
        (
            Chat(messages=[ASK], chat_template_kwargs='{"enable_thinking": '),
            {},
            "chat.chat_template_kwargs",
        ),
        (Chat(messages=[ASK], chat_template_kwargs="[1]"), {}, "chat.chat_template_kwargs"),
        (
            Chat(messages=[ASK], chat_template_kwargs='{"tools": []}'),
            {},
            "chat.chat_template_kwargs.tools",
        ),
        (
            Chat(messages=[ASK], tools=[WEATHER]),
            {"grammar": common_pb2.Grammar(kind=common_pb2.GRAMMAR_KIND_JSON_OBJECT)},
            "grammar",
        ),
        (Chat(messages=[ChatMessage(role="", content="Hi")]), {}, "chat.messages[0].role"),
    ],
)
def test_bad_chats_are_refused_naming_the_field(
    think_tokenizer: Any, chat: Chat, fields: dict[str, Any], field: str
) -> None:
    core, scheduler, _ = make_core(think_tokenizer, ids(think_tokenizer, "x"))
    assert refused(core, chat, **fields) == field
    assert scheduler.submitted == []
