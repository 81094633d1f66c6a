"""Property-based test of the OpenAI-compatible API: schemathesis generates requests from the
gateway's own OpenAPI document and checks that no response is a 5xx and every response
conforms to the documented status codes, content types and schemas; bodies that break the
schema (schemathesis' negative mode) and raw malformed bodies get a 4xx, never a 5xx."""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.schemas import BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.stack import RunningStack

pytestmark = [pytest.mark.e2e, pytest.mark.services]


@pytest.fixture(scope="module")
def schema_stack(tiny_stack: RunningStack) -> RunningStack:
    return tiny_stack


@pytest.fixture(scope="module")
def api_schema(schema_stack: RunningStack) -> BaseSchema:
    return schemathesis.openapi.from_url(schema_stack.http_url + "/openapi.json")


# schemathesis' lazy pytest loader (`schemathesis.pytest.from_fixture`) sets the private
# `Function._nodeid`, which pytest 9 no longer has; the operations are listed here instead and
# a test below keeps the list equal to the document.
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def test_operations_list_matches_document(api_schema: BaseSchema) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


def _shortened(case: Case) -> Case:
    """Keep generation short: a response's conformance does not depend on its length."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 32:
                case.body[name] = 32
        if case.path == "/v1/chat/completions":
            if case.body.get("max_tokens") is None:
                case.body.setdefault("max_completion_tokens", 8)
            # An empty conversation is always refused (test_openai_api checks that 400), and
            # generated bodies often have one: a user turn stands in, so that enough of them
            # get through validation for their success bodies to be checked.
            if case.body.get("messages") == []:
                case.body["messages"] = [{"role": "user", "content": "Say hi."}]
        if case.path == "/v1/responses":
            case.body.setdefault("max_output_tokens", 8)
        if case.path.startswith("/v1/messages"):
            _plausible_conversation(case.body)
    return case


def _plausible_conversation(body: dict[str, Any]) -> None:
    """The Messages API documents its messages and system blocks as free-form objects (the
    handler checks them, naming the field); random ones are nearly always refused, so one
    plain user turn stands in for them, leaving the other generated fields as they are."""
    body["messages"] = [{"role": "user", "content": "Say hi."}]
    if not isinstance(body.get("system"), str | None):
        body["system"] = "Be brief."
    for name in ("tools", "tool_choice", "thinking"):
        body.pop(name, None)
    if "max_tokens" in body:
        value = body["max_tokens"]
        body["max_tokens"] = min(max(value, 1), 32) if isinstance(value, int) else 8


# Reproducible runs: a fixed example order, no example database, no time limit per example.
_SETTINGS: dict[str, Any] = dict(
    deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def _call_never_5xx(case: Case, statuses: Counter[int]) -> tuple[Case, Any]:
    """Send `case` (long strings shortened), count its status, and check it is not a 5xx."""
    case = _shortened(case)
    response = case.call(timeout=60)
    statuses[response.status_code] += 1
    assert response.status_code < 500, f"{case.body!r} -> {response.text}"
    return case, response


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_api_conforms_and_never_5xx(api_schema: BaseSchema, method: str, path: str) -> None:
    operation = api_schema[path][method]
    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy())
    @settings(max_examples=30, **_SETTINGS)
    def check(case: Case) -> None:
        case, response = _call_never_5xx(case, statuses)
        case.validate_response(response, checks=CHECKS)

    check()
    print(method, path, dict(statuses))
    # Some generated requests got through validation, so success bodies were checked too.
    assert statuses[200] > 0, dict(statuses)


# -- malformed bodies --------------------------------------------------------------------------

GENERATION_OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]


@pytest.mark.parametrize(("method", "path"), GENERATION_OPERATIONS)
def test_bodies_that_break_the_schema_are_4xx(
    api_schema: BaseSchema, method: str, path: str
) -> None:
    """schemathesis' negative mode: bodies that violate the documented schema (wrong types,
    missing required fields, out-of-range values) are refused with a 4xx error body."""
    operation = api_schema[path][method]
    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    @settings(max_examples=40, **_SETTINGS)
    def check(case: Case) -> None:
        case, response = _call_never_5xx(case, statuses)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"], response.text

    check()
    print(method, path, dict(statuses))
    assert statuses[400] > 0, dict(statuses)


RAW_BODIES = [
    b"",
    b"{",
    b"not json",
    b"[]",
    b"null",
    b'"a string"',
    b'{"prompt": "hi", "max_tokens": NaN}',
    b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": "hi", "temperature": "hot"}',
    b'{"prompt": "\\ud800", "max_tokens": 2}',
    b'{"prompt": "hi", "seed": 18446744073709551616, "max_tokens": 2}',
    b'{"prompt": "hi", "top_k": 8589934592, "max_tokens": 2}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": 2, "stream": "maybe"}',
    b"\xff\xfe\x00garbage",
]


@pytest.mark.parametrize("body", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_raw_bodies_are_400(schema_stack: RunningStack, path: str, body: bytes) -> None:
    response = httpx.post(
        schema_stack.http_url + path,
        content=body,
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400, (body[:80], response.status_code, response.text[:500])
    assert response.json()["error"]["message"], response.text
