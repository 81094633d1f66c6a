"""gpt-oss's harmony format on the chat route, in process against the fake scheduler: SmolLM2's
tokenizer with harmony's tags added as special tokens (conftest's harmony_tokenizer) and
tests/support/templates/harmony.jinja, whose generation prompt ends with `<|start|>assistant`.
The tags reach the parser although special tokens are skipped, and never the client. The
official `openai` SDK reads the responses; the gRPC Chat answers the same."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from gateway.tokenization import Tokenization
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.reasoning import ReasoningGrammar
from llmserve.grammar.spec import GrammarKind
from llmserve.v1 import generation_pb2
from tests.support.templates import template_text
from tests.unit.gateway.test_grpc_chat import make_core, refused
from tests.unit.gateway.test_openai_routes import MODEL
from tests.unit.gateway.test_reasoning_routes import ASK, WEATHER, ids, serve
from tests.unit.gateway.test_validation_path import grpc_generate

# One token a piece: the analysis message, then the final one (SmolLM2 writes "assistant" in
# two tokens).
THINKING = ["<|channel|>", "analysis", "<|message|>", "Add", " them", ".", "<|end|>"]
ANSWER = ["<|start|>", "ass", "istant", "<|channel|>", "final", "<|message|>"]
ANSWER += ["It", " is", " four", ".", "<|return|>"]


def test_the_template_picks_harmony(harmony_tokenizer: Any) -> None:
    tokenization = Tokenization(harmony_tokenizer, template_text("harmony"))
    assert tokenization.reasoning_format is not None
    assert tokenization.reasoning_format.name == "harmony"


def test_reasoning_and_content_come_apart(harmony_tokenizer: Any) -> None:
    client, scheduler, _ = serve(
        harmony_tokenizer, ids(harmony_tokenizer, *THINKING, *ANSWER), "harmony"
    )
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    message = completion.choices[0].message
    assert message.content == "It is four."
    assert message.reasoning_content == "Add them."  # type: ignore[attr-defined]
    assert harmony_tokenizer.decode(scheduler.submitted[0].prompt_token_ids) == (
        "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
    )
    # The analysis message, header to <|end|>.
    assert completion.usage.completion_tokens_details.reasoning_tokens == len(THINKING)


def test_streamed_deltas_join_to_the_same(harmony_tokenizer: Any) -> None:
    client, _, _ = serve(harmony_tokenizer, ids(harmony_tokenizer, *THINKING, *ANSWER), "harmony")
    reasoning, content, usage = [], [], None
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert ("".join(reasoning), "".join(content)) == ("Add them.", "It is four.")
    # Token by token: the words came as they were written, nothing of a header.
    assert [c for c in content if c] == ["It", " is", " four", "."]
    assert usage is not None
    assert usage.completion_tokens_details.reasoning_tokens == len(THINKING)


def test_an_output_without_analysis(harmony_tokenizer: Any) -> None:
    tokens = ids(harmony_tokenizer, *ANSWER[3:])  # from <|channel|>final<|message|>
    client, _, _ = serve(harmony_tokenizer, tokens, "harmony")
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    message = completion.choices[0].message
    assert message.content == "It is four."
    assert message.reasoning_content is None  # type: ignore[attr-defined]
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0


def test_special_tokens_asked_for_still_leave_the_headers_out(harmony_tokenizer: Any) -> None:
    client, _, _ = serve(harmony_tokenizer, ids(harmony_tokenizer, *THINKING, *ANSWER), "harmony")
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"skip_special_tokens": False}
    )
    message = completion.choices[0].message
    reasoning = message.reasoning_content  # type: ignore[attr-defined]
    assert (reasoning, message.content) == ("Add them.", "It is four.")


def test_other_special_tokens_stay_skipped(harmony_tokenizer: Any) -> None:
    # SmolLM2's own special tokens are not harmony's: skipped as before.
    tokens = ids(harmony_tokenizer, *ANSWER[3:6], "It", "<|im_end|>", " is", "<|return|>")
    client, _, _ = serve(harmony_tokenizer, tokens, "harmony")
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    assert completion.choices[0].message.content == "It is"


def test_without_the_parser_the_tags_are_skipped(harmony_tokenizer: Any) -> None:
    client, _, _ = serve(
        harmony_tokenizer,
        ids(harmony_tokenizer, *THINKING, *ANSWER),
        "harmony",
        reasoning_parser="none",
    )
    completion = client.chat.completions.create(model=MODEL, messages=ASK)
    # Special tokens skipped, as for any model: the channel names are left as words.
    assert completion.choices[0].message.content == "analysisAdd them.assistantfinalIt is four."


def test_the_budget_reaches_the_scheduler_with_the_headers_as_ids(
    harmony_tokenizer: Any,
) -> None:
    client, scheduler, _ = serve(
        harmony_tokenizer, ids(harmony_tokenizer, *THINKING, *ANSWER), "harmony"
    )
    client.chat.completions.create(
        model=MODEL, messages=ASK, extra_body={"thinking_token_budget": 16}
    )
    spec = scheduler.submitted[0].reasoning
    assert spec is not None
    opening = tuple(ids(harmony_tokenizer, "<|channel|>", "analysis", "<|message|>"))
    end = tuple(ids(harmony_tokenizer, "<|end|>", "<|start|>", "ass", "istant"))
    assert (spec.open_ids, spec.end_ids, spec.close_ids) == (opening, end, end)
    # The prompt ends with <|start|>assistant: the model opens the analysis message itself.
    assert not spec.opened and spec.budget == 16


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_a_json_schema_is_sent_as_the_final_message(harmony_tokenizer: Any) -> None:
    final = ["<|start|>", "ass", "istant", "<|channel|>", "final", "<|message|>"]
    final += ["{", '"', "answer", '":', " ", "4", "}", "<|return|>"]
    tokens = ids(harmony_tokenizer, *THINKING, *final)
    client, scheduler, _ = serve(harmony_tokenizer, tokens, "harmony")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    )
    message = completion.choices[0].message
    assert message.reasoning_content == "Add them."  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(message.content or ""), SCHEMA)
    assert json.loads(message.content or "") == {"answer": 4}
    submitted = scheduler.submitted[0]
    assert submitted.grammar is not None and submitted.reasoning is not None
    assert (submitted.grammar.kind, submitted.grammar.field) == (
        GrammarKind.LARK,
        "response_format",
    )
    # What the scheduler would enforce takes this output whole, and ends with it.
    backend = LLGuidanceBackend(harmony_tokenizer)
    inner = backend.compile(submitted.grammar)
    matcher = ReasoningGrammar(submitted.reasoning, inner, len(harmony_tokenizer)).matcher()
    for token in tokens:
        assert matcher.accept(token), (harmony_tokenizer.decode([token]), matcher.error())
    assert matcher.is_terminated()
    # Whereas the JSON right after the analysis message, without the final header, is refused.
    bare = ReasoningGrammar(submitted.reasoning, inner, len(harmony_tokenizer)).matcher()
    for token in ids(harmony_tokenizer, *THINKING, "<|start|>", "ass", "istant"):
        assert bare.accept(token)
    assert not bare.accept(ids(harmony_tokenizer, "{")[0])


def test_a_bad_grammar_is_refused_by_its_own_field(harmony_tokenizer: Any) -> None:
    _, scheduler, http = serve(harmony_tokenizer, ids(harmony_tokenizer, "x"), "harmony")
    r = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "structured_outputs": {"regex": "("}},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.regex"
    assert scheduler.submitted == []


def test_tools_are_refused(harmony_tokenizer: Any) -> None:
    _, scheduler, http = serve(harmony_tokenizer, ids(harmony_tokenizer, "x"), "harmony")
    r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools"
    assert "harmony" in error["message"]
    # tool_choice none: the tools are not used, so nothing is refused.
    ok = http.post(
        "/v1/chat/completions",
        json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
    )
    assert ok.status_code == 200, ok.text
    assert len(scheduler.submitted) == 1


def test_the_grpc_chat_answers_the_same(harmony_tokenizer: Any) -> None:
    core, _, _ = make_core(harmony_tokenizer, ids(harmony_tokenizer, *THINKING, *ANSWER), "harmony")
    ask = generation_pb2.ChatMessage(role="user", content="What is 2 + 2?")
    chat = generation_pb2.Chat(messages=[ask])
    responses = grpc_generate(core, generation_pb2.GenerateRequest(chat=chat))
    assert isinstance(responses, list), responses
    choices = [c for r in responses for c in r.choices]
    assert "".join(c.reasoning for c in choices) == "Add them."
    assert [c.text for c in choices if c.text] == ["It", " is", " four", "."]
    assert responses[-1].usage.reasoning_tokens == len(THINKING)
    tool = generation_pb2.Tool(name="get_weather", parameters='{"type": "object"}')
    assert refused(core, generation_pb2.Chat(messages=[ask], tools=[tool])) == "chat.tools"
