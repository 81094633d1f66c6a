"""The gateway's admission (in-flight limit, drain), body limit and request limits, in process."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from gateway.admission import Admission, AdmissionMiddleware, BodyLimitMiddleware
from llmserve.errors import FieldError, OverloadedError, UnavailableError
from llmserve.limits import RequestLimits, check_prompt_count, check_sampling, check_stop
from llmserve.sampling_params import SamplingParams


def test_admission_refuses_beyond_the_limit_and_frees_on_release() -> None:
    admission = Admission(2, retry_after_s=3.0)
    admission.admit()
    admission.admit()
    with pytest.raises(OverloadedError) as caught:
        admission.admit()
    assert caught.value.retry_after_s == 3.0
    assert "--max-pending-requests" in caught.value.message
    admission.release()
    admission.admit()
    assert admission.in_flight == 2


def test_draining_refuses_new_requests_and_waits_for_the_rest() -> None:
    async def scenario() -> tuple[bool, bool]:
        admission = Admission(4)
        admission.admit()
        admission.start_draining()
        with pytest.raises(UnavailableError):
            admission.admit()
        early = await admission.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, admission.release)
        late = await admission.wait_idle(5)
        return early, late

    assert asyncio.run(scenario()) == (False, True)


async def _echo(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def _post(app, content: bytes) -> httpx.Response:  # type: ignore[no-untyped-def]
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", content=content)

    return asyncio.run(go())


def test_body_limit_names_the_body() -> None:
    app = BodyLimitMiddleware(_echo, max_bytes=10)
    assert _post(app, b"0123456789").text == "10"
    r = _post(app, b"0123456789A")
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "body"
    assert "11 bytes" in r.json()["error"]["message"]


def test_admission_middleware_answers_429_with_retry_after() -> None:
    admission = Admission(1, retry_after_s=2.5)
    admission.admit()
    r = _post(AdmissionMiddleware(_echo, admission), b"{}")
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"
    admission.release()
    assert _post(AdmissionMiddleware(_echo, admission), b"{}").status_code == 200
    assert admission.in_flight == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(n=5, temperature=1.0), "sampling_params.n"),
        (SamplingParams(n=1, best_of=6, temperature=1.0), "best_of"),
        (SamplingParams(max_tokens=101), "max_tokens"),
        (SamplingParams(logprobs=4), "top_logprobs"),
        (SamplingParams(prompt_logprobs=4), "prompt_logprobs"),
        (SamplingParams(stop_token_ids=(1, 2, 3)), "stop_token_ids"),
    ],
)
def test_sampling_limits_name_the_field(params: SamplingParams, field: str) -> None:
    limits = RequestLimits(
        max_n=4, max_best_of=5, max_output_tokens=100, max_logprobs=3, max_stop_token_ids=2
    )
    names = {"n": "sampling_params.n", "logprobs": "top_logprobs"}
    with pytest.raises(FieldError) as caught:
        check_sampling(limits, params, lambda f: names.get(f, f))
    assert caught.value.field == field


def test_stop_and_prompt_count_limits() -> None:
    limits = RequestLimits(max_stop_strings=2, max_stop_string_chars=3, max_prompts_per_request=2)
    check_stop(limits, ["abc", "d"])
    for stop, field in ((["a", "b", "c"], "stop"), (["abcd"], "stop[0]"), (["a", ""], "stop[1]")):
        with pytest.raises(FieldError) as caught:
            check_stop(limits, stop)
        assert caught.value.field == field
    with pytest.raises(FieldError):
        check_prompt_count(limits, 3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**32}, "top_k"),
        ({"max_tokens": 2**32}, "max_tokens"),
        ({"stop_token_ids": (2**32,)}, "stop_token_ids"),
    ],
)
def test_integers_too_large_for_the_protos_are_refused(kwargs: dict, field: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(FieldError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.field == field


def test_generate_cli_prints_one_line_for_a_bad_flag() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmserve.cli",
            "generate",
            "--temperature",
            "-3",
            "--address",
            "127.0.0.1:1",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: temperature: must be in [0, 100], got -3.0"]
