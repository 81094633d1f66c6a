"""`/tokenize` and `/detokenize` in process (no scheduler is asked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.unit.gateway.test_openai_routes import FakeScheduler, make_client

__all__ = ["make_client"]  # the fixture, shared


def test_tokenize_and_back(make_client: Callable[..., Any], smollm2_tokenizer: Any) -> None:
    client, scheduler = make_client(FakeScheduler([1]))
    expected = smollm2_tokenizer.encode("Hello world", add_special_tokens=True)
    r = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == 64
    assert "".join(body["token_strs"]).replace("Ġ", " ") == "Hello world"
    r = client.post("/detokenize", json={"tokens": expected})
    assert r.json() == {"prompt": "Hello world"}
    assert scheduler.submitted == []


def test_tokenize_a_chat(make_client: Callable[..., Any], smollm2_tokenizer: Any) -> None:
    client, _ = make_client(FakeScheduler([1]))
    messages = [{"role": "user", "content": "hi"}]
    text = smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    r = client.post("/tokenize", json={"messages": messages})
    assert r.json()["tokens"] == smollm2_tokenizer.encode(text, add_special_tokens=False)


def test_refusals(make_client: Callable[..., Any]) -> None:
    client, _ = make_client(FakeScheduler([1]))
    for path, body, param in (
        ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
        ("/tokenize", {"prompt": "x", "unknown": 1}, "unknown"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
