"""Reasoning on the chat route, in process against the fake scheduler: SmolLM2's tokenizer with
`<think>` and `</think>` added as tokens (conftest's think_tokenizer) and tests/support/templates/
think.jinja, which opens the block in the prompt unless `enable_thinking` is false. The
official `openai` SDK reads the responses."""

from __future__ import annotations

from typing import Any

import openai
from fastapi.testclient import TestClient

from gateway.generation import GenerationCore
from gateway.openai_api import build_app
from gateway.tokenization import Tokenization
from llmserve.v1 import common_pb2
from tests.support.templates import template_text
from tests.unit.gateway.test_openai_routes import MODEL, FakeScheduler

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def ids(tokenizer: Any, *pieces: str) -> list[int]:
    """One token per piece (each piece is a single token of the tokenizer)."""
    out = []
    for piece in pieces:
        got = tokenizer.encode(piece, add_special_tokens=False)
        assert len(got) == 1, (piece, got)
        out += got
    return out


def serve(
    tokenizer: Any, tokens: list[int], template: str = "think", **tokenization: Any
) -> tuple[openai.OpenAI, FakeScheduler, TestClient]:
    scheduler = FakeScheduler(tokens, finish=common_pb2.FINISH_REASON_STOP)
    core = GenerationCore(
        MODEL,
        Tokenization(tokenizer, template_text(template), **tokenization),
        scheduler,  # type: ignore[arg-type]
        4096,
    )
    http = TestClient(build_app(core), raise_server_exceptions=False)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    return client, scheduler, http


# Output of a model whose prompt opened the block: reasoning, `</think>`, the answer.
OPENED = ["Add", " them", ".", "\n", "</think>", "\n\n", "It", " is", " four", "."]


def test_reasoning_and_content_come_apart(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    message = completion.choices[0].message
    assert message.content == "It is four."
    assert message.reasoning_content == "Add them."  # type: ignore[attr-defined]
    # The prompt itself ends inside the block the template opened.
    assert think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids).endswith(
        "assistant\n<think>\n"
    )
    # Tokens up to and with </think>: "Add", " them", ".", "\n", "</think>".
    assert completion.usage.completion_tokens_details.reasoning_tokens == 5


def test_streamed_deltas_join_to_the_same(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    reasoning, content, usage = "", "", None
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("Add them.", "It is four.")
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 5


def test_a_block_the_model_opens(think_tokenizer: Any) -> None:
    # enable_thinking false: the template closes an empty block; a model may still think.
    tokens = ids(think_tokenizer, "<think>", "Maybe", "</think>", "Yes")
    client, scheduler, _ = serve(think_tokenizer, tokens)
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert prompt.endswith("<think>\n\n</think>\n\n")
    message = completion.choices[0].message
    assert (message.reasoning_content, message.content) == ("Maybe", "Yes")  # type: ignore[attr-defined]


def test_thinking_off_leaves_everything_to_content(think_tokenizer: Any) -> None:
    tokens = ids(think_tokenizer, "It", " is", " four", ".")
    client, _, _ = serve(
        think_tokenizer, tokens, default_template_kwargs={"enable_thinking": False}
    )
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    message = completion.choices[0].message
    assert message.content == "It is four."
    assert message.reasoning_content is None  # type: ignore[attr-defined]
    # No block was opened: no output token was reasoning.
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0


def test_without_a_parser_the_tags_stay_in_content(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED), reasoning_parser="none")
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    assert completion.choices[0].message.content == "Add them.\n</think>\n\nIt is four."
    assert completion.usage.completion_tokens_details is None


def test_tool_calls_are_read_from_the_answer_only(think_tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # A call written while thinking is reasoning, not a call.
    text = f"I could write {call} here.\n</think>\n\n{call}"
    tokens = think_tokenizer.encode(text, add_special_tokens=False)
    client, _, _ = serve(think_tokenizer, tokens)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == f"I could write {call} here."  # type: ignore[attr-defined]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_reserved_template_kwargs_are_refused(think_tokenizer: Any) -> None:
    _, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    for kwargs, field in (
        ({"tools": []}, "chat_template_kwargs.tools"),
        ([1], "chat_template_kwargs"),
    ):
        r = http.post(
            "/v1/chat/completions", json={"messages": ASK, "chat_template_kwargs": kwargs}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
    assert scheduler.submitted == []


# -- what the scheduler is told to enforce (llmserve.grammar.reasoning) ------------------------


def test_the_budget_reaches_the_scheduler_with_the_tags_as_ids(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"thinking_token_budget": 16}
    )
    spec = scheduler.submitted[0].reasoning
    assert spec is not None
    open_id, end_id, newline = ids(think_tokenizer, "<think>", "</think>", "\n")
    assert (spec.open_ids, spec.end_ids, spec.close_ids) == (
        (open_id,),
        (end_id,),
        (newline, end_id),
    )
    # think.jinja ends the generation prompt inside the block.
    assert spec.opened and spec.budget == 16


def test_a_grammar_starts_after_the_block(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}
    )
    submitted = scheduler.submitted[0]
    assert submitted.grammar is not None
    assert submitted.reasoning is not None and submitted.reasoning.budget is None


def test_nothing_to_enforce_sends_no_block(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    client.chat.completions.create(model=MODEL, messages=ASK)
    # Thinking off: the block is closed in the prompt, the grammar applies from the start.
    client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": 4},
    )
    assert [s.reasoning for s in scheduler.submitted] == [None, None]


def test_the_gateway_default_budget(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(
        think_tokenizer, ids(think_tokenizer, *OPENED), default_thinking_budget=8
    )
    client.chat.completions.create(model=MODEL, messages=ASK)
    client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"thinking_token_budget": 0}
    )
    assert [s.reasoning.budget for s in scheduler.submitted] == [8, 0]


def test_bad_budgets_are_refused_before_the_scheduler(think_tokenizer: Any) -> None:
    _, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    _, plain_scheduler, plain_http = serve(
        think_tokenizer, ids(think_tokenizer, "x"), reasoning_parser="none"
    )
    for client, budget, detail in (
        (http, -1, "at least 0"),
        (http, "many", "integer"),
        (plain_http, 16, "reasoning parser"),
    ):
        r = client.post(
            "/v1/chat/completions", json={"messages": ASK, "thinking_token_budget": budget}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "thinking_token_budget"
        assert detail in r.json()["error"]["message"]
    assert scheduler.submitted == plain_scheduler.submitted == []


def test_the_messages_api_maps_budget_tokens(think_tokenizer: Any) -> None:
    _, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    body = {"model": MODEL, "max_tokens": 64, "messages": ASK}
    ok = http.post(
        "/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": 12}}
    )
    assert ok.status_code == 200, ok.text
    assert scheduler.submitted[0].reasoning.budget == 12
    bad = http.post(
        "/v1/messages", json={**body, "thinking": {"type": "enabled", "budget_tokens": -3}}
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in bad.json()["error"]["message"]
    assert len(scheduler.submitted) == 1
