"""Property-based test of the OpenAI-compatible API: schemathesis generates requests from the
gateway's own OpenAPI document and checks that no response is a 5xx and every response
conforms to the documented status codes, content types and schemas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case
from schemathesis.schemas import BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

MODEL = "tiny"


@pytest.fixture(scope="module")
def schema_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[RunningStack]:
    running = start_stack(str(tiny_model_dir), tmp_path_factory.mktemp("schema-stack-logs"),
                          gateway_args=["--served-model-name", MODEL])
    yield running
    running.stop()


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
]
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def test_operations_list_matches_document(api_schema: BaseSchema) -> None:
    documented = {(op.ok().method.upper(), op.ok().path)
                  for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


def _shortened(case: Case) -> Case:
    """Keep generation short: a response's conformance does not depend on its length."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 32:
                case.body[name] = 32
        if "messages" in case.body and case.body.get("max_tokens") is None:
            case.body.setdefault("max_completion_tokens", 8)
    return case


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_api_conforms_and_never_5xx(api_schema: BaseSchema, method: str, path: str) -> None:
    operation = api_schema[path][method]
    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy())
    @settings(max_examples=30, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case: Case) -> None:
        case = _shortened(case)
        response = case.call(timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.body!r} -> {response.text}"
        case.validate_response(response, checks=CHECKS)

    check()
    print(method, path, dict(statuses))
    # Some generated requests got through validation, so success bodies were checked too.
    assert statuses[200] > 0, dict(statuses)
