"""Tool calls and structured output at the gateway, with a scripted scheduler: requests turn
into the right grammar and prompt, the envelope the grammar forces comes out as
`message.tool_calls` / streamed `delta.tool_calls`, and bad requests are 400s naming the
field (never submitted)."""

from __future__ import annotations

import json
from typing import Any

from llmserve.grammar.spec import GrammarKind
from llmserve.v1 import common_pb2
from tests.unit.gateway.test_openai_routes import MODEL, FakeScheduler, make_client, sse

__all__ = ["make_client"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris \\"left\\""}}]}'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def scripted(tokenizer: Any, text: str) -> FakeScheduler:
    return FakeScheduler(
        tokenizer.encode(text, add_special_tokens=False), finish=common_pb2.FINISH_REASON_STOP
    )


def test_required_call_comes_back_as_tool_calls(make_client: Any, smollm2_tokenizer: Any) -> None:
    client, scheduler = make_client(scripted(smollm2_tokenizer, CALLS), 4096)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": 'Paris "left"'}
    # The grammar forces the envelope; the prompt carries the tool's schema.
    grammar = scheduler.submitted[0].grammar
    assert grammar is not None and grammar.kind == GrammarKind.JSON_SCHEMA
    assert grammar.field == "tools"
    schema = json.loads(grammar.source)
    assert schema["properties"]["tool_calls"]["minItems"] == 1
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert '"name": "get_weather"' in prompt and "Weather in a city" in prompt


def test_streamed_call_sends_id_and_name_once_then_fragments(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    client, _ = make_client(scripted(smollm2_tokenizer, CALLS), 4096)
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER],
            "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    assert r.status_code == 200, r.text
    chunks = sse(r)
    pieces = [
        tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []
    ]
    headers = [p for p in pieces if "id" in p]
    assert len(headers) == 1 and headers[0]["function"]["name"] == "get_weather"
    fragments = [p["function"]["arguments"] for p in pieces]
    assert len([f for f in fragments if f]) > 3  # streamed, not sent whole at the end
    assert json.loads("".join(fragments)) == {"city": 'Paris "left"'}
    assert all(not ch["delta"].get("content") for c in chunks for ch in c["choices"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_text_answer_is_content(make_client: Any, smollm2_tokenizer: Any) -> None:
    text = '{"content": "It is sunny \\u00e9 \\"today\\""}'
    client, scheduler = make_client(scripted(smollm2_tokenizer, text), 4096)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True},
    )
    chunks = sse(r)
    content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert content == 'It is sunny é "today"'
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    schema = json.loads(scheduler.submitted[0].grammar.source)
    assert len(schema["anyOf"]) == 2  # a call or a response


def test_tool_choice_none_is_free_text(make_client: Any, smollm2_tokenizer: Any) -> None:
    client, scheduler = make_client(scripted(smollm2_tokenizer, "Hello"), 4096)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
    )
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert scheduler.submitted[0].grammar is None


def test_history_with_calls_and_results_is_rendered(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    client, scheduler = make_client(scripted(smollm2_tokenizer, '{"content": "18 C"}'), 4096)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "18 degrees"},
    ]
    r = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [WEATHER]}
    )
    assert r.status_code == 200, r.text
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in prompt
    assert "call_9" in prompt and "18 degrees" in prompt


def test_structured_outputs_reach_the_scheduler_as_grammars(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    client, scheduler = make_client(scripted(smollm2_tokenizer, "yes"), 4096)
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Q", "structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.status_code == 200, r.text
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "response_format": {"type": "json_object"}},
    )
    assert r.status_code == 200, r.text
    kinds = [(s.grammar.kind, s.grammar.field) for s in scheduler.submitted]
    assert kinds == [
        (GrammarKind.CHOICE, "structured_outputs.choice"),
        (GrammarKind.JSON_OBJECT, "response_format"),
    ]


def test_limits_name_field_and_flag(make_client: Any, smollm2_tokenizer: Any) -> None:
    client, scheduler = make_client(scripted(smollm2_tokenizer, "x"), 4096)
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": many})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tools" and "--max-tools" in r.json()["error"]["message"]
    big = {"type": "object", "description": "x" * 70_000}
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ASK,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "big", "schema": big},
            },
        },
    )
    assert r.status_code == 400
    assert "--max-grammar-bytes" in r.json()["error"]["message"]
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ASK,
            "tools": [WEATHER],
            "response_format": {"type": "json_object"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert scheduler.submitted == []


def test_a_grammar_check_over_its_time_limit_is_429(monkeypatch: Any) -> None:
    import asyncio
    import time

    import pytest

    from gateway import structured_outputs
    from llmserve.errors import ResourceExhaustedError
    from llmserve.grammar.spec import GrammarSpec
    from llmserve.limits import RequestLimits

    monkeypatch.setattr(structured_outputs, "check_grammar", lambda spec: time.sleep(0.3))
    spec = GrammarSpec.regex("[0-9]+", "structured_outputs.regex")
    with pytest.raises(ResourceExhaustedError) as exc:
        asyncio.run(
            structured_outputs.check_admissible(spec, RequestLimits(max_grammar_check_ms=20))
        )
    assert exc.value.http_status == 429
    assert exc.value.field == "structured_outputs.regex"
    assert "--max-grammar-check-ms" in exc.value.message


def template_client(tokenizer: Any, template: str, text: str) -> tuple[Any, FakeScheduler]:
    """A gateway whose chat template is one of tests/support/templates (its tool format is
    read off it), answering with `text`."""
    from fastapi.testclient import TestClient

    from gateway.generation import GenerationCore
    from gateway.openai_api import build_app
    from gateway.tokenization import Tokenization
    from tests.support.templates import template_text

    scheduler = scripted(tokenizer, text)
    core = GenerationCore(MODEL, Tokenization(tokenizer, template_text(template)), scheduler, 4096)  # type: ignore[arg-type]
    return TestClient(build_app(core), raise_server_exceptions=False), scheduler


def test_hermes_stream_sends_text_then_the_call(smollm2_tokenizer: Any) -> None:
    text = (
        "Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris \\"left\\""}}\n</tool_call>'
    )
    client, scheduler = template_client(smollm2_tokenizer, "hermes", text)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True},
    )
    assert r.status_code == 200, r.text
    chunks = sse(r)
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    pieces = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [p["function"]["name"] for p in pieces if "id" in p] == ["get_weather"]
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {
        "city": 'Paris "left"'
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # The template rendered the tools itself; the grammar is the Hermes one.
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    grammar = scheduler.submitted[0].grammar
    assert grammar.kind == GrammarKind.LARK and "<tool_call>" in grammar.source


def test_a_broken_block_is_text_not_an_error(smollm2_tokenizer: Any) -> None:
    text = "<tool_call>\nno call here\n</tool_call>"
    client, _ = template_client(smollm2_tokenizer, "hermes", text)
    r = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": text}
    assert choice["finish_reason"] == "stop"


def test_llama3_json_calls_come_back_whole(smollm2_tokenizer: Any) -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice"}}; '
        '{"name": "get_weather", "parameters": {"city": "Lyon"}}'
    )
    client, scheduler = template_client(smollm2_tokenizer, "llama3", text)
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    args = [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert args == [{"city": "Nice"}, {"city": "Lyon"}]
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert "Functions you can call:\n" + json.dumps(WEATHER) in prompt


def test_hermes_history_is_rendered_by_the_template(smollm2_tokenizer: Any) -> None:
    client, scheduler = template_client(smollm2_tokenizer, "hermes", "It is 18 C.")
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "18 degrees"},
    ]
    r = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": [WEATHER]}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is 18 C."
    prompt = smollm2_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in prompt
