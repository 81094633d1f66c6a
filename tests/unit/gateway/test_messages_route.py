"""`POST /v1/messages` and `/v1/messages/count_tokens` in process against the fake scheduler,
read by the official `anthropic` SDK: plain, streamed, tool use and its result, Anthropic's
error shape, and `x-api-key`."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from gateway.admission import Admission
from gateway.generation import GenerationCore
from gateway.openai_api import build_app
from gateway.tokenization import Tokenization
from llmserve.limits import RequestLimits
from llmserve.security import KeySet
from llmserve.v1 import common_pb2
from tests.support.templates import template_text
from tests.unit.gateway.test_openai_routes import MODEL, FakeScheduler
from tests.unit.gateway.test_reasoning_routes import OPENED, ids

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def serve(
    tokenizer: Any,
    tokens: list[int],
    finish: int = common_pb2.FINISH_REASON_STOP,
    keys: tuple[str, ...] = (),
    **core_options: Any,
) -> tuple[anthropic.Anthropic, FakeScheduler, TestClient]:
    scheduler = FakeScheduler(tokens, finish=finish)  # type: ignore[arg-type]
    core = GenerationCore(
        MODEL,
        Tokenization(tokenizer, template_text("think")),
        scheduler,  # type: ignore[arg-type]
        4096,
        **core_options,
    )
    http = TestClient(build_app(core, api_keys=KeySet(keys)), raise_server_exceptions=False)
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key="key", http_client=http, max_retries=0
    )
    return client, scheduler, http


def test_plain(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        system="Be brief.",
        messages=ASK,  # type: ignore[arg-type]
    )
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Add them."  # type: ignore[union-attr]
    assert message.content[1].text == "It is four."  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (
        len(scheduler.submitted[0].prompt_token_ids),
        len(OPENED),
    )
    prompt = think_tokenizer.decode(scheduler.submitted[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert scheduler.submitted[0].params.max_tokens == 40


def test_streamed(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    with client.messages.stream(model=MODEL, max_tokens=40, messages=ASK) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "thinking")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    thinking = "".join(
        e.delta.thinking  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"  # type: ignore[union-attr]
    )
    assert thinking == "Add them."
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "It is four."  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"


def test_create_with_stream_true(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    events = list(client.messages.create(model=MODEL, max_tokens=40, messages=ASK, stream=True))  # type: ignore[arg-type]
    text = "".join(
        e.delta.text  # type: ignore[union-attr]
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"  # type: ignore[union-attr]
    )
    assert text == "It is four."


def test_tool_use_and_its_result(think_tokenizer: Any) -> None:
    tokens = think_tokenizer.encode(f"Look.\n</think>\n\n{CALL}", add_special_tokens=False)
    client, scheduler, _ = serve(think_tokenizer, tokens)
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],  # type: ignore[arg-type,list-item]
    )
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    client.messages.create(
        model=MODEL,
        max_tokens=60,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            *ASK,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],  # type: ignore[union-attr]
            },
        ],  # type: ignore[arg-type]
    )
    prompt = think_tokenizer.decode(scheduler.submitted[1].prompt_token_ids)
    assert f"<|im_start|>assistant\n{CALL}\n<|im_end|>" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_stop_sequences(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=ASK,
        stop_sequences=[" four"],  # type: ignore[arg-type]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " four"
    assert message.content[-1].text == "It is"  # type: ignore[union-attr]


def test_max_tokens(think_tokenizer: Any) -> None:
    client, _, _ = serve(
        think_tokenizer, ids(think_tokenizer, *OPENED), finish=common_pb2.FINISH_REASON_LENGTH
    )
    message = client.messages.create(model=MODEL, max_tokens=40, messages=ASK)  # type: ignore[arg-type]
    assert message.stop_reason == "max_tokens"


def test_count_tokens(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")  # type: ignore[arg-type]
    client.messages.create(model=MODEL, max_tokens=5, messages=ASK, system="Be brief.")  # type: ignore[arg-type]
    assert counted.input_tokens == len(scheduler.submitted[0].prompt_token_ids)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": ASK}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 5, "frequency_penalty": 1}, "frequency_penalty"),
        ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5},
            "messages[0].content[0].type",
        ),
        ({"messages": ASK, "max_tokens": 5, "stop_sequences": [""]}, "stop_sequences"),
    ],
)
def test_bad_input_is_an_anthropic_400(
    think_tokenizer: Any, body: dict[str, Any], words: str
) -> None:
    _, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert words in r.json()["error"]["message"]
    assert scheduler.submitted == []


def test_the_sdk_raises_its_own_error(think_tokenizer: Any) -> None:
    client, _, _ = serve(think_tokenizer, ids(think_tokenizer, "x"))
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)  # type: ignore[arg-type]
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_x_api_key_is_accepted_like_authorization(think_tokenizer: Any) -> None:
    client, _, http = serve(think_tokenizer, ids(think_tokenizer, "x"), keys=("key",))
    assert client.messages.create(model=MODEL, max_tokens=5, messages=ASK).content  # type: ignore[arg-type]
    body = {"messages": ASK, "max_tokens": 5}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = http.post("/v1/messages", json=body, headers={"authorization": "Bearer key"})
    assert r.status_code == 200


def test_a_call_cut_off_by_max_tokens_is_no_tool_use(think_tokenizer: Any) -> None:
    # The limit ends the answer inside the call's arguments: nothing a client could run.
    cut = CALL[: CALL.index("Paris")]
    tokens = think_tokenizer.encode(f"Look.\n</think>\n\n{cut}", add_special_tokens=False)
    client, _, _ = serve(think_tokenizer, tokens, finish=common_pb2.FINISH_REASON_LENGTH)
    message = client.messages.create(
        model=MODEL,
        max_tokens=len(tokens),
        messages=ASK,
        tools=[WEATHER],  # type: ignore[arg-type,list-item]
    )
    assert message.content[-1].type == "tool_use"
    assert message.stop_reason == "max_tokens"


def test_message_start_counts_the_prompt(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(think_tokenizer, ids(think_tokenizer, *OPENED))
    events = list(client.messages.create(model=MODEL, max_tokens=40, messages=ASK, stream=True))  # type: ignore[arg-type]
    assert events[0].type == "message_start"
    prompt_tokens = len(scheduler.submitted[0].prompt_token_ids)
    assert (events[0].message.usage.input_tokens, events[0].message.usage.output_tokens) == (
        prompt_tokens,
        0,
    )


def _anthropic_shaped(body: object, kind: str) -> str:
    """The message of an Anthropic error body of type `kind` (and nothing of OpenAI's)."""
    assert isinstance(body, dict) and set(body) == {"type", "error"}, body
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    return str(body["error"]["message"])


def test_a_full_gateway_refuses_in_anthropics_shape(think_tokenizer: Any) -> None:
    admission = Admission(1, retry_after_s=2.5)
    admission.admit()  # the one slot is taken
    client, scheduler, http = serve(think_tokenizer, ids(think_tokenizer, "x"), admission=admission)
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK)  # type: ignore[arg-type]
    assert "--max-pending-requests" in _anthropic_shaped(caught.value.body, "rate_limit_error")
    assert caught.value.response.headers["retry-after"] == "3"
    # The OpenAI routes keep OpenAI's shape for the same refusal.
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert scheduler.submitted == []


def test_a_body_over_the_limit_is_refused_in_anthropics_shape(think_tokenizer: Any) -> None:
    client, scheduler, _ = serve(
        think_tokenizer, ids(think_tokenizer, "x"), limits=RequestLimits(max_body_bytes=200)
    )
    long = [{"role": "user", "content": "x" * 300}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=5, messages=long)  # type: ignore[arg-type]
    message = _anthropic_shaped(caught.value.body, "invalid_request_error")
    assert message.startswith("body: ") and "over this server's limit of 200" in message
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model=MODEL, messages=long)  # type: ignore[arg-type]
    _anthropic_shaped(caught.value.body, "invalid_request_error")
    assert scheduler.submitted == []


def test_a_wrong_method_is_refused_in_anthropics_shape(think_tokenizer: Any) -> None:
    _, _, http = serve(think_tokenizer, ids(think_tokenizer, "x"))
    r = http.get("/v1/messages")
    assert r.status_code == 405
    assert "POST" in r.headers["allow"]
    _anthropic_shaped(r.json(), "invalid_request_error")
