"""Drafts under grammars on the embedded SmolLM2 (issue #28): two live stacks, one with n-gram
drafts and one without, answer the same JSON-schema requests with the same tokens, greedy and
seeded at temperature 1.0; every output matches its schema; drafts were made and kept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

WORKER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "0.05", "--num-threads", "1"]
DRAFTS = ["--num-speculative-tokens", "4", "--ngram-min", "1", "--ngram-max", "3"]
# Repetitive structures, so that prompt lookup finds something to draft inside the grammar.
ROWS = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 3,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string", "maxLength": 12},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["rows"],
    "additionalProperties": False,
}
COLOURS = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {"enum": ["red", "green", "blue"]},
}
ASKS = [
    ("List three users as JSON rows with id and name.", ROWS),
    ("Give four colours as a JSON array.", COLOURS),
]
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    started: dict[str, RunningStack] = {}
    try:
        for name, scheduler_args in (("drafts", DRAFTS), ("plain", [])):
            started[name] = start_stack(
                "smollm2",
                tmp_path_factory.mktemp(f"spec-grammar-{name}"),
                worker_args=WORKER_ARGS,
                scheduler_args=scheduler_args,
            )
        yield started
    finally:
        for running in started.values():
            running.stop()


def chat(stack: RunningStack, content: str, schema: dict[str, Any], sampling: dict[str, Any]):  # type: ignore[no-untyped-def]
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 160,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        **sampling,
    }
    with httpx.Client(base_url=stack.http_url, timeout=300) as http:
        reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_drafted_structured_outputs_equal_the_undrafted_and_match_their_schemas(stacks):  # type: ignore[no-untyped-def]
    drafted = kept = 0
    for content, schema in ASKS:
        for sampling in SAMPLINGS:
            with_drafts = chat(stacks["drafts"], content, schema, sampling)
            without = chat(stacks["plain"], content, schema, sampling)
            text = with_drafts["choices"][0]["message"]["content"]
            assert text == without["choices"][0]["message"]["content"], (content, sampling)
            jsonschema.validate(json.loads(text), schema)
            spec = with_drafts["usage"].get("speculative_decoding", {})
            drafted += spec.get("draft_tokens", 0)
            kept += spec.get("accepted_tokens", 0)
            assert "speculative_decoding" not in without["usage"]
    assert drafted > 0 and kept > 0
