"""The OpenAI-compatible HTTP API through the official `openai` SDK, against a live stack
(worker, scheduler, gateway as real processes) serving a tiny random Llama."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from scheduler_service.engine.config import SchedulerConfig
from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

MODEL = "tiny"
API_KEY = "sk-test-key"
MAX_PENDING = 4
# Over vLLM's default of 20: the gateway's flag is the one bound, end to end.
MAX_LOGPROBS = 30
CONTEXT = 4096
PROMPT = "The capital of France is"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def long_context_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4096-token context (rotary positions need no trained weights), so
    a request can outlive the few chunks a test reads before hanging up."""
    directory = tmp_path_factory.mktemp("tiny-llama-4k")
    for item in tiny_model_dir.iterdir():
        shutil.copy(item, directory / item.name)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def stack(
    long_context_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    running = start_stack(
        str(long_context_model),
        tmp_path_factory.mktemp("openai-stack-logs"),
        gateway_args=[
            "--served-model-name",
            MODEL,
            "--api-key",
            API_KEY,
            "--max-pending-requests",
            str(MAX_PENDING),
            "--max-logprobs",
            str(MAX_LOGPROBS),
        ],
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> openai.OpenAI:
    # No retries: a 503 or 429 must reach the test as it was sent.
    return openai.OpenAI(
        base_url=stack.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def http(stack: RunningStack) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=stack.http_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(long_context_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(long_context_model)


def greedy(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0.0, **extra}


def no_eos(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


# -- models ------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


# -- completions -------------------------------------------------------------------------------


def test_completion_usage_matches_tokenizer(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.completions.create(prompt=PROMPT, **greedy(**no_eos(7)))
    assert result.object == "text_completion"
    assert result.model == MODEL
    [choice] = result.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7


def test_completion_stream_equals_full(client: openai.OpenAI) -> None:
    full = client.completions.create(prompt=PROMPT, **greedy(**no_eos(8)))
    chunks = list(
        client.completions.create(
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(**no_eos(8)),
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    # At most a chunk per step: the prefill's token, then runs of up to --decode-steps tokens
    # (one request alone decodes several tokens a step by default, multi-step decoding); steps
    # that queue up before the stream reads them go out as one chunk.
    steps = SchedulerConfig().decode_steps
    assert len(text_chunks) <= 1 + -(-7 // steps)
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 8
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_token_id_prompts(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    by_ids = client.completions.create(prompt=ids, **greedy(**no_eos(5)))
    by_text = client.completions.create(prompt=PROMPT, **greedy(**no_eos(5)))
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text

    batch = client.completions.create(prompt=[ids, ids[:3]], **greedy(**no_eos(4)))
    assert [c.index for c in batch.choices] == [0, 1]
    assert (
        batch.choices[0].text
        == client.completions.create(prompt=ids, **greedy(**no_eos(4))).choices[0].text
    )
    assert batch.usage.prompt_tokens == len(ids) + 3
    assert batch.usage.completion_tokens == 8


def test_completion_list_of_strings(client: openai.OpenAI, tokenizer: Any) -> None:
    prompts = [PROMPT, "Once upon a time"]
    result = client.completions.create(prompt=prompts, **greedy(**no_eos(3)))
    assert [c.index for c in result.choices] == [0, 1]
    singles = [
        client.completions.create(prompt=p, **greedy(**no_eos(3))).choices[0].text for p in prompts
    ]
    assert [c.text for c in result.choices] == singles
    assert result.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert result.usage.completion_tokens == 6


def test_completion_n2_sampled(client: openai.OpenAI) -> None:
    result = client.completions.create(
        prompt=PROMPT, model=MODEL, n=2, temperature=1.0, seed=7, **no_eos(6)
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 12
    assert all(c.finish_reason == "length" for c in result.choices)

    streamed = list(
        client.completions.create(
            prompt=PROMPT, model=MODEL, n=2, temperature=1.0, seed=7, stream=True, **no_eos(6)
        )
    )
    per_index: dict[int, int] = {0: 0, 1: 0}
    for chunk in streamed:
        for c in chunk.choices:
            per_index[c.index] += 1
    assert per_index == {0: 6, 1: 6}


def test_completion_n2_greedy_is_rejected(http: httpx.Client) -> None:
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 2, "temperature": 0}
    )
    assert_error(response, 400, "n")


def test_completion_logprobs_shape_and_greedy_max(client: openai.OpenAI) -> None:
    result = client.completions.create(prompt=PROMPT, logprobs=3, **greedy(**no_eos(6)))
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    for token_logprob, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_logprob <= 0.0
        # Distinct tokens can decode to the same text, so a dict may hold fewer than 3.
        assert 1 <= len(top) <= 3
        assert token_logprob == pytest.approx(max(top.values()), abs=1e-5)


def test_completion_echo_with_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **greedy(**no_eos(2)))
    choice = result.choices[0]
    assert choice.text.startswith(PROMPT)
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert len(choice.logprobs.tokens) == n_prompt + 2
    assert choice.logprobs.token_logprobs[0] is None


def test_stop_string_is_cut_or_kept(client: openai.OpenAI) -> None:
    text = client.completions.create(prompt=PROMPT, **greedy(**no_eos(24))).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    head = text[: text.index(stop)]

    cut = client.completions.create(prompt=PROMPT, stop=[stop], **greedy(**no_eos(24)))
    assert cut.choices[0].text == head
    assert stop not in cut.choices[0].text
    assert cut.choices[0].finish_reason == "stop"

    kept = client.completions.create(
        prompt=PROMPT,
        stop=stop,
        model=MODEL,
        temperature=0.0,
        max_tokens=24,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == head + stop

    streamed = client.completions.create(
        prompt=PROMPT, stop=[stop], stream=True, **greedy(**no_eos(24))
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == head


def test_n3_stop_string_stops_one_choice_the_others_complete(
    client: openai.OpenAI, stack: RunningStack
) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "n": 3,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 24,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True},
    }
    reference = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    # A stop string from the middle of one choice's text that no other choice contains.
    picked = next(
        (i, text[start : start + 3])
        for i, text in reference.items()
        for start in range(len(text) // 3, len(text) - 3)
        if text[start : start + 3].strip()
        and text.index(text[start : start + 3]) == start
        and all(text[start : start + 3] not in other for j, other in reference.items() if j != i)
    )
    index, stop = picked
    cut = client.completions.create(stop=[stop], **kwargs)
    choices = {c.index: c for c in cut.choices}
    assert choices[index].text == reference[index][: reference[index].index(stop)]
    assert choices[index].finish_reason == "stop"
    tokens = {i: c.logprobs.tokens for i, c in choices.items() if c.logprobs is not None}
    # The stopped choice ends with the token that completed the stop string.
    assert stop in "".join(tokens[index]) and stop not in "".join(tokens[index][:-1])
    for i, text in reference.items():
        if i != index:
            assert choices[i].text == text and choices[i].finish_reason == "length"
            assert len(tokens[i]) == 24
    assert cut.usage is not None
    assert cut.usage.completion_tokens == sum(len(t) for t in tokens.values())
    _wait_all_blocks_free(stack)


def test_seed_reproducible_alone_and_in_a_batch(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                prompt=PROMPT, model=MODEL, temperature=1.0, seed=seed, **no_eos(12)
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    # The same request among other concurrent requests of other seeds and lengths.
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(sample, 99), pool.submit(sample, 1234), pool.submit(sample, 5)]
        texts = [f.result() for f in futures]
    assert texts[1] == first
    assert texts[0] != first  # a 49k-token vocabulary at temperature 1: a clash is negligible


# -- chat --------------------------------------------------------------------------------------


def test_chat_usage_matches_chat_template(client: openai.OpenAI, tokenizer: Any) -> None:
    result = client.chat.completions.create(messages=MESSAGES, **greedy(**no_eos(5)))
    assert result.object == "chat.completion"
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    template_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(template_ids) > 10
    assert result.usage.prompt_tokens == len(template_ids)
    assert result.usage.completion_tokens == 5


def test_chat_max_completion_tokens(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        messages=MESSAGES, model=MODEL, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 3


def test_chat_stream_equals_full(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(messages=MESSAGES, **greedy(**no_eos(6)))
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(**no_eos(6)),
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_n2_sampled(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        messages=MESSAGES, model=MODEL, n=2, temperature=0.8, **no_eos(4)
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 8


def test_chat_logprobs_shape_and_greedy_max(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=4, **greedy(**no_eos(5))
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.bytes == list(entry.token.encode())
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(max(tops), abs=1e-5)

    plain = client.chat.completions.create(messages=MESSAGES, logprobs=True, **greedy(**no_eos(2)))
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]


def test_chat_top_logprobs_over_20_come_back_for_every_token(client: openai.OpenAI) -> None:
    """--max-logprobs 30 lets 25 alternatives through: the scheduler and the workers'
    sampler do not cap them below the gateway's flag."""
    result = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=25, **greedy(**no_eos(3))
    )
    content = result.choices[0].logprobs.content
    assert [len(entry.top_logprobs) for entry in content] == [25, 25, 25]
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)


def test_chat_seed_reproducible(client: openai.OpenAI) -> None:
    def sample() -> str:
        return (
            client.chat.completions.create(
                messages=MESSAGES, model=MODEL, temperature=1.0, seed=42, **no_eos(8)
            )
            .choices[0]
            .message.content
        )

    assert sample() == sample()


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 100_000}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, "stop[0]"),
        ("/v1/completions", {"prompt": PROMPT, "best_of": 1, "n": 2, "temperature": 1}, "best_of"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], "mixed"]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": 7, "content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_completion_tokens": 100_000},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "priority": 2**31}, "priority"),
        ("/v1/chat/completions", {"messages": MESSAGES, "priority": -(2**31) - 1}, "priority"),
    ],
)
def test_invalid_parameter_is_400_naming_it(
    http: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    error = assert_error(http.post(path, json={"model": MODEL, **body}), 400, param)
    assert error["type"] == "invalid_request_error"


def test_sdk_raises_bad_request_with_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"


def test_malformed_json_is_400(http: httpx.Client) -> None:
    response = http.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400)


def test_prompt_too_long(http: httpx.Client) -> None:
    long_prompt = list(range(100, 100 + CONTEXT + 10))
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt})
    assert_error(response, 400, "prompt")
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "word " * CONTEXT}]},
    )
    assert_error(chat, 400, "messages")


def test_unknown_model_is_404(client: openai.OpenAI, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    error = assert_error(
        http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": MESSAGES}),
        404,
        "model",
    )
    assert error["code"] == "model_not_found"


def test_api_key_missing_or_wrong_is_401(stack: RunningStack) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(stack.http_url + "/v1/models", headers=headers)
        error = assert_error(response, 401)
        assert error["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # Health and readiness stay open for probes.
    assert httpx.get(stack.http_url + "/health").status_code == 200
    ready = httpx.get(stack.http_url + "/ready")
    assert (ready.status_code, ready.json()) == (200, {"status": "ok"})


# -- load and disconnect -------------------------------------------------------------------------


def _blocks(stack: RunningStack) -> tuple[int, int]:
    with grpc.insecure_channel(stack.scheduler) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )
    replica = stats.replicas[0]
    return replica.gpu_blocks_free, replica.gpu_blocks_total


def _wait_all_blocks_free(stack: RunningStack, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    free, total = _blocks(stack)
    while free != total and time.monotonic() < deadline:
        time.sleep(0.1)
        free, total = _blocks(stack)
    assert free == total, f"{total - free} KV blocks still held"


def _long_stream(http: httpx.Client) -> Any:
    return http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": CONTEXT - 64,
            "ignore_eos": True,
            "stream": True,
        },
    )


def test_client_disconnect_aborts_and_frees_blocks(stack: RunningStack, http: httpx.Client) -> None:
    _wait_all_blocks_free(stack)
    # Read a few chunks, then hang up in the middle of the stream. (Leaving the loop closes
    # httpx's line iterator, and with it the connection.)
    with _long_stream(http) as response:
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                assert chunk["choices"][0]["finish_reason"] is None
                events += 1
                if events == 3:
                    free, total = _blocks(stack)
                    assert free < total  # the request holds KV blocks while it runs
                    break
    assert events == 3
    _wait_all_blocks_free(stack)


def test_overload_is_429_with_retry_after(stack: RunningStack, http: httpx.Client) -> None:
    _wait_all_blocks_free(stack)
    streams = [_long_stream(http) for _ in range(MAX_PENDING)]
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        refused = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        )
        error = assert_error(refused, 429)
        assert error["type"] == "rate_limit_error"
        assert "--max-pending-requests" in error["message"]
        assert int(refused.headers["retry-after"]) >= 1
        client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert info.value.status_code == 429
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    _wait_all_blocks_free(stack)
    # Capacity comes back once the streams are gone.
    deadline = time.monotonic() + 30
    while True:
        response = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        )
        if response.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status_code == 200, response.text
