"""The OpenAI routes in process (Starlette's TestClient over the ASGI app), against a fake of
the scheduler client: the gateway's unit boundary. The tokenizer is SmolLM2's real one.

The fake answers like the scheduler: token deltas per choice, then a finished output with its
own usage and timings, or a RequestError turned into the matching ApiError."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.generation import GenerationCore
from gateway.openai_api import build_app
from gateway.tokenization import Tokenization
from llmserve.errors import from_status_value
from llmserve.grammar.reasoning import ReasoningSpec
from llmserve.grammar.spec import GrammarSpec
from llmserve.sampling_params import SamplingParams
from llmserve.security import KeySet
from llmserve.v1 import common_pb2, scheduler_pb2

MODEL = "tiny"
MAX_MODEL_LEN = 64


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None = None
    reasoning: ReasoningSpec | None = None


@dataclass
class FakeScheduler:
    """Stands in for gateway.scheduler_client.SchedulerClient."""

    # Token ids each choice generates, one delta per token; the last one ends the choice.
    tokens: list[int]
    finish: common_pb2.FinishReason = common_pb2.FINISH_REASON_LENGTH
    # What the scheduler counted, sent with the finished output (None: what it sent).
    completion_tokens: int | None = None
    # Raised instead of answering: (gRPC code number, message, field), or any exception.
    error: tuple[int, str, str] | BaseException | None = None
    # Raised after the first delta instead of going on.
    error_after_first: tuple[int, str, str] | None = None
    connected: bool = True
    submitted: list[Submitted] = field(default_factory=list)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        traceparent: str = "",
        priority: int = 0,
        stop: Sequence[str] = (),
        decode_special_tokens: bool = False,
        timeout_s: float | None = None,
        grammar: GrammarSpec | None = None,
        reasoning: ReasoningSpec | None = None,
    ) -> AsyncGenerator[scheduler_pb2.RequestOutput, None]:
        self.submitted.append(Submitted(request_id, prompt_token_ids, params, grammar, reasoning))
        if isinstance(self.error, BaseException):
            raise self.error
        if self.error is not None:
            raise from_status_value(*self.error)
        sent = 0
        for step, token in enumerate(self.tokens):
            last = step == len(self.tokens) - 1
            out = scheduler_pb2.RequestOutput(request_id=request_id, finished=last)
            for index in range(params.n):
                delta = out.choices.add(index=index, token_ids=[token])
                sent += 1
                if last:
                    delta.finish_reason = self.finish
            if last:
                out.usage.prompt_tokens = len(prompt_token_ids)
                out.usage.completion_tokens = (
                    sent if self.completion_tokens is None else self.completion_tokens
                )
                out.metrics.first_token_ns, out.metrics.e2e_ns = 5_000, 9_000
            yield out
            if self.error_after_first is not None:
                raise from_status_value(*self.error_after_first)


@pytest.fixture
def make_client(smollm2_tokenizer: Any) -> Callable[..., tuple[TestClient, FakeScheduler]]:
    def make(
        scheduler: FakeScheduler,
        max_model_len: int | None = MAX_MODEL_LEN,
        api_keys: tuple[str, ...] = (),
    ) -> tuple[TestClient, FakeScheduler]:
        core = GenerationCore(
            MODEL,
            Tokenization(smollm2_tokenizer),
            scheduler,  # type: ignore[arg-type]
            max_model_len,
        )
        return TestClient(
            build_app(core, api_keys=KeySet(api_keys)), raise_server_exceptions=False
        ), scheduler

    return make


def words(tokenizer: Any, *texts: str) -> list[int]:
    return [tokenizer.encode(t, add_special_tokens=False)[0] for t in texts]


def sse(response: Any) -> list[Any]:
    events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_text_usage_and_finish_come_from_the_scheduler(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    tokens = words(smollm2_tokenizer, "Hello", " world", " again")
    client, scheduler = make_client(FakeScheduler(tokens, completion_tokens=11))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Hello world again",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    # The scheduler's count is carried, not recounted from the three tokens seen here.
    prompt_len = len(scheduler.submitted[0].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 11,
        "total_tokens": prompt_len + 11,
    }


def test_completion_of_two_prompts_numbers_choices_per_prompt(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    client, scheduler = make_client(FakeScheduler(words(smollm2_tokenizer, " yes")))
    r = client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "temperature": 0.5}
    )
    assert r.status_code == 200, r.text
    assert [(c["index"], c["text"]) for c in r.json()["choices"]] == [
        (0, " yes"),
        (1, " yes"),
        (2, " yes"),
        (3, " yes"),
    ]
    assert r.json()["usage"]["completion_tokens"] == 4
    ids = [s.request_id for s in scheduler.submitted]
    assert ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0] == r.json()["id"]


def test_chat_stream_chunks_and_usage(make_client: Any, smollm2_tokenizer: Any) -> None:
    tokens = words(smollm2_tokenizer, "Hi", " there")
    client, _ = make_client(FakeScheduler(tokens, finish=common_pb2.FINISH_REASON_STOP))
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 5,
        },
    ) as r:
        assert r.status_code == 200
        chunks = sse(r)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": "Hi"}, {"content": " there"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, "stop"]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_stop_string_cuts_the_text(make_client: Any, smollm2_tokenizer: Any) -> None:
    tokens = words(smollm2_tokenizer, "one", " two", " three")
    client, _ = make_client(FakeScheduler(tokens))
    r = client.post("/v1/completions", json={"prompt": "count", "stop": [" tw"]})
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
        "one",
        "stop",
        " tw",
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature", None),
        ({"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of", None),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", None),
        ({"prompt": "x", "suffix": "y"}, 400, "suffix", None),
        ({"prompt": 3}, 400, "prompt", None),
    ],
)
def test_client_mistakes_name_the_field(
    make_client: Any, body: dict[str, Any], status: int, param: str, code: str | None
) -> None:
    client, scheduler = make_client(FakeScheduler([1]))
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"].startswith(f"{param}: ")
    assert scheduler.submitted == []


def test_chat_message_errors_name_the_message(make_client: Any) -> None:
    client, _ = make_client(FakeScheduler([1]))
    r = client.post("/v1/chat/completions", json={"messages": [{"content": "no role"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[0].role"


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (8, 429, "rate_limit_error"),
        (6, 409, "invalid_request_error"),
        (14, 503, "service_unavailable"),
        (13, 500, "internal_error"),
        (3, 400, "invalid_request_error"),
    ],
)
def test_a_scheduler_error_keeps_its_code(
    make_client: Any, code: int, status: int, kind: str
) -> None:
    client, _ = make_client(
        FakeScheduler([1], error=(code, "prompt: said the scheduler", "prompt"))
    )
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == status
    assert r.json()["error"]["type"] == kind
    assert r.json()["error"]["message"] == "prompt: said the scheduler"


def test_an_internal_failure_is_500_and_never_model_not_found(make_client: Any) -> None:
    client, _ = make_client(FakeScheduler([1], error=KeyError("lost")))
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"
    assert r.json()["error"]["code"] is None


def test_an_error_mid_stream_is_an_event_then_done(
    make_client: Any, smollm2_tokenizer: Any
) -> None:
    tokens = words(smollm2_tokenizer, "a", "b", "c")
    client, _ = make_client(FakeScheduler(tokens, error_after_first=(14, "worker lost", "")))
    with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        events = sse(r)
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-1]["error"]["type"] == "service_unavailable"
    assert events[-1]["error"]["message"] == "worker lost"


def test_without_a_context_length_requests_are_unavailable(make_client: Any) -> None:
    client, _ = make_client(FakeScheduler([1]), max_model_len=None)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    models = client.get("/v1/models").json()["data"]
    assert models[0]["max_model_len"] is None


def test_models_and_probes(make_client: Any) -> None:
    client, scheduler = make_client(FakeScheduler([1]))
    assert client.get("/v1/models").json()["data"][0] == {
        "id": MODEL,
        "object": "model",
        "created": client.app.state.core.created,
        "owned_by": "llmserve",
        "max_model_len": MAX_MODEL_LEN,
    }
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 200
    scheduler.connected = False
    assert client.get("/ready").json() == {"status": "scheduler unavailable"}


def test_api_key(make_client: Any) -> None:
    client, _ = make_client(FakeScheduler([1]), api_keys=("k", "other"))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer kk"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer other"}).status_code == 200
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_an_unavailable_scheduler_is_503_with_retry_after(make_client: Any, stream: bool) -> None:
    client, _ = make_client(FakeScheduler([1], error=(14, "the scheduler is shutting down", None)))
    r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_full_scheduler_queue_is_429_with_retry_after(make_client: Any, stream: bool) -> None:
    """RESOURCE_EXHAUSTED from the scheduler (--max-waiting-requests) is the status line, with
    Retry-After, streamed or not: a stream's first update is awaited before its 200."""
    client, _ = make_client(
        FakeScheduler([1], error=(8, "the scheduler has 8 requests waiting", None))
    )
    r = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
