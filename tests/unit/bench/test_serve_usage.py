"""bench/serve.py counts output tokens from the server's usage, whichever chunk carries it.

The streams below have the two shapes real servers send on streaming /v1/completions: our
gateway (and the OpenAI API) put usage in a final chunk with `"choices": []` and `"usage":
null` on the content chunks; llama-server puts it beside the last choice (its
`finish_reason` chunk). With no usage at all, the text is re-tokenized. Each stream is served
over HTTP by httpx's in-process transport and read by serve.py's own request loop.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import serve  # noqa: E402
from serve_report import (  # noqa: E402
    RequestResult,
    RequestStatus,
    RunOutcome,
    StopReason,
    count_output_tokens,
    summarize,
)

TEXTS = ["Once", " upon", " a", " time"]
USAGE = {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}


def _choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}


def gateway_stream() -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = [
        {"object": "text_completion", "choices": [_choice(t, None)], "usage": None} for t in TEXTS
    ]
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    return [*chunks, {"object": "text_completion", "choices": [], "usage": USAGE}]


def llama_server_stream() -> list[dict[str, Any]]:
    chunks = [{"object": "text_completion", "choices": [_choice(t, None)]} for t in TEXTS]
    return [
        *chunks,
        {"object": "text_completion", "choices": [_choice("", "length")], "usage": USAGE},
    ]


def no_usage_stream() -> list[dict[str, Any]]:
    return [{"object": "text_completion", "choices": [_choice(t, None)]} for t in TEXTS]


class WordTokenizer:
    """Counts whitespace-separated words: the fallback's count is visible in the test."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[str]]:
        return {"input_ids": text.split()}


def run_one(chunks: list[dict[str, Any]], extra_flags: list[str]) -> tuple[RequestResult, dict]:
    """Stream `chunks` to serve.py's request loop; the result and the body the server got."""
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    args = serve.parse_args(
        ["--base-url", "http://bench.test/v1", "--model", "m", "--tokenizer", "unused",
         "--endpoint", "completions", "--out", "unused", *extra_flags]
    )  # fmt: skip
    item = serve.WorkItem("prompt", 1, 16)
    body = serve.request_body(args, item, [])
    result = RequestResult()

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await serve.one_request(client, args, body, result)

    asyncio.run(go())
    count_output_tokens([result], WordTokenizer())
    return result, seen


@pytest.mark.parametrize(
    ("stream", "shape"),
    [
        (gateway_stream, "usage_without_choices"),
        (llama_server_stream, "usage_with_choices"),
    ],
)
def test_usage_counted_from_either_chunk_shape(stream: Any, shape: str) -> None:
    result, sent = run_one(stream(), ["--include-usage"])
    assert sent["stream_options"] == {"include_usage": True}
    assert result.status is RequestStatus.COMPLETED
    assert result.text == "Once upon a time"
    # The server's count (9), not the 4 words of the text.
    assert result.output_tokens == 9
    assert result.counted_by == "usage"
    assert result.usage_chunk == shape
    # The usage-only chunk carries no text: it is neither a token arrival nor the first token.
    assert len(result.chunk_times) == len(TEXTS) - 1


def test_no_usage_falls_back_to_retokenizing() -> None:
    result, sent = run_one(no_usage_stream(), [])
    assert "stream_options" not in sent
    assert result.output_tokens == 4
    assert result.counted_by == "retokenized"
    assert result.usage_tokens is None
    assert result.usage_chunk == ""


def test_summary_says_how_requests_were_counted() -> None:
    with_usage, _ = run_one(llama_server_stream(), ["--include-usage"])
    without, _ = run_one(no_usage_stream(), [])
    args = serve.parse_args(
        ["--base-url", "http://bench.test/v1", "--model", "m", "--tokenizer", "unused",
         "--out", "unused", "--include-usage"]
    )  # fmt: skip
    outcome = RunOutcome([with_usage, without], 2.0, StopReason.ALL_DONE, 1, 1)
    summary = summarize(args, [1, 1], outcome, {"sent": [], "left_out": []})
    assert summary["output_tokens_counted_by"] == {"usage": 1, "retokenized": 1}
    assert summary["usage_chunks"] == {"usage_without_choices": 0, "usage_with_choices": 1}
    assert summary["total_output_tokens"] == 9 + 4
    assert summary["workload"]["include_usage"] is True
