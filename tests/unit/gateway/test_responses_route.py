"""`POST /v1/responses` in process against the fake scheduler, read by the official `openai`
SDK (`client.responses.create`): plain, streamed, a function tool and its output in a second
turn, and refusals that reach no scheduler."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from llmserve.grammar.spec import GrammarKind
from llmserve.v1 import common_pb2
from tests.unit.gateway.test_openai_routes import MODEL
from tests.unit.gateway.test_reasoning_routes import OPENED, ids, serve

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_plain(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    response = client.responses.create(
        model=MODEL, input="What is 2 + 2?", instructions="Be brief.", max_output_tokens=30
    )
    assert response.status == "completed"
    assert response.output_text == "It is four."
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Add them."  # type: ignore[union-attr,index]
    assert response.usage is not None
    assert response.usage.output_tokens == len(OPENED)
    assert response.usage.output_tokens_details.reasoning_tokens == 5
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert scheduler.submitted[0].params.max_tokens == 30


def test_streamed(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    events = list(client.responses.create(model=MODEL, input="What is 2 + 2?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("Add them.", "It is four.")
    # Item by item: the reasoning closes before the message opens.
    items = [(e.type, e.item.type) for e in events if e.type.startswith("response.output_item")]
    assert items == [
        ("response.output_item.added", "reasoning"),
        ("response.output_item.done", "reasoning"),
        ("response.output_item.added", "message"),
        ("response.output_item.done", "message"),
    ]
    assert events[-1].response.output_text == "It is four."  # type: ignore[union-attr]


def test_a_function_call_and_its_output_in_a_second_turn(think_tokenizer: Any) -> None:
    tokens = think_tokenizer.encode(f"Look it up.\n</think>\n\n{CALL}", add_special_tokens=False)
    client, scheduler, _ = serve(think_tokenizer, tokens)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.previous_response_id == first.id
    prompt = think_tokenizer.decode(scheduler.submitted[1].prompt_token_ids)
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in prompt
    assert f"<|im_start|>assistant\n{CALL}\n<|im_end|>" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_streamed_function_call(think_tokenizer: Any) -> None:
    tokens = think_tokenizer.encode(f"x</think>{CALL}", add_special_tokens=False)
    client, _, _ = serve(think_tokenizer, tokens)
    events = list(
        client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], stream=True)
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == '{"city": "Paris"}'
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("get_weather", '{"city": "Paris"}')]


def test_text_format_is_the_structured_output_constraint(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, "{}"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.responses.create(
        model=MODEL,
        input="JSON please",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    grammar = scheduler.submitted[0].grammar
    assert grammar is not None and grammar.kind == GrammarKind.JSON_SCHEMA


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.name"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    think_tokenizer: Any, body: dict[str, Any], param: str
) -> None:
    _, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert scheduler.submitted == []


def test_store_false_is_not_kept_and_the_store_is_bounded(think_tokenizer: Any) -> None:
    client, _, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    unstored = client.responses.create(model=MODEL, input="hi", store=False)
    r = http.post("/v1/responses", json={"input": "again", "previous_response_id": unstored.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    http.app.state.response_store.max_entries = 2  # type: ignore[attr-defined]
    made = [client.responses.create(model=MODEL, input=f"hi {i}").id for i in range(3)]
    for response_id, kept in zip(made, (False, True, True), strict=True):
        # Not stored itself: it would evict another.
        r = http.post(
            "/v1/responses",
            json={"input": "on", "previous_response_id": response_id, "store": False},
        )
        assert (r.status_code == 200) == kept, (response_id, r.text)


def test_the_item_max_output_tokens_cut_off_is_incomplete(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    scheduler.finish = common_pb2.FINISH_REASON_LENGTH
    whole = client.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=10)
    assert whole.status == "incomplete"
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    # The reasoning was closed by the answer that followed it; the answer was cut.
    assert [(item.type, item.status) for item in whole.output] == [
        ("reasoning", None),
        ("message", "incomplete"),
    ]
    events = list(
        client.responses.create(
            model=MODEL, input="What is 2 + 2?", max_output_tokens=10, stream=True
        )
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.status for item in done if item.type == "message"] == ["incomplete"]
    assert events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == [None, "incomplete"]  # type: ignore[union-attr]


def test_a_call_max_output_tokens_cut_off_is_incomplete(think_tokenizer: Any) -> None:
    cut = CALL[: CALL.index("Paris")]
    tokens = think_tokenizer.encode(f"x</think>{cut}", add_special_tokens=False)
    client, scheduler, _ = serve(think_tokenizer, tokens)
    scheduler.finish = common_pb2.FINISH_REASON_LENGTH
    response = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER])
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.status for c in calls] == ["incomplete"]
    assert '{"city": "Paris"}'.startswith(calls[0].arguments)


def test_an_error_after_the_status_line_is_a_numbered_event(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    scheduler.error_after_first = (grpc.StatusCode.INTERNAL.value[0], "the worker died", "")
    events = list(client.responses.create(model=MODEL, input="What is 2 + 2?", stream=True))
    assert events[-1].type == "error"
    assert events[-1].message == "the worker died"  # type: ignore[union-attr]
    assert [e.sequence_number for e in events] == list(range(len(events)))
