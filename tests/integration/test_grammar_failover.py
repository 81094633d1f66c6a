"""Constrained streams survive a killed worker and a restarted scheduler with exactly the
output they would have had: the scheduler owns each sequence's matcher and rebuilds it from
the tokens (DESIGN.md 12). Two workers on the embedded SmolLM2, 16 concurrent streams (JSON
schema, the tool-call envelope, regex, choice; greedy and seeded); every output is valid for
its grammar and byte-identical to the undisturbed run."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from gateway.tool_formats import FORMATS
from gateway.tools import parse_tools
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import RequestLimits
from llmserve.v1 import common_pb2
from tests.support.fleet import FleetStack, Received, assert_same_outputs, run_workload, start_fleet
from tests.support.grammar import BOUNDED_SCHEMA, WEATHER_TOOL, smollm2_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

MODEL = "smollm2"
WORKER_ARGS = [
    "--max-model-len",
    "1024",
    "--kv-cache-memory",
    "0.1",
    "--swap-space",
    "0.02",
    "--num-threads",
    "1",
]
# Lease long enough for a loaded machine; the health checks still see a killed worker at once.
SCHEDULER_ARGS = ["--worker-lease-s", "60"]
TOOLS = [WEATHER_TOOL]
TOOL_GRAMMAR = FORMATS["generic"].grammar(
    parse_tools(TOOLS, "required", False, RequestLimits())
)
GRAMMARS: list[tuple[GrammarSpec, str]] = [
    (GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format"), "Describe a box as JSON:"),
    (TOOL_GRAMMAR, "Call a tool to get the weather in France:"),
    (GrammarSpec.regex(r"[0-9]{3}-[A-Z]{3}-[0-9]{2}", "structured_outputs.regex"), "A code:"),
    (
        GrammarSpec.choice(["yes, certainly", "no, never", "perhaps"], "structured_outputs.choice"),
        "Is the sky green?",
    ),
]


def workload() -> list[tuple[str, dict[str, Any]]]:
    requests = []
    for i in range(16):
        spec, prompt = GRAMMARS[i % len(GRAMMARS)]
        params: dict[str, Any] = {"max_tokens": 120}
        if i % 2:
            params.update(temperature=1.0, seed=100 + i)
        else:
            params["temperature"] = 0.0
        requests.append((f"g-{i}", {"prompt": prompt, "grammar": spec, **params}))
    return requests


WORKLOAD = workload()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start_fleet(
        MODEL,
        tmp_path_factory.mktemp("grammar-fleet"),
        2,
        scheduler_args=SCHEDULER_ARGS,
        worker_args=WORKER_ARGS,
    )
    yield stack
    stack.stop()


def check_valid(received: dict[str, Received]) -> None:
    tok = smollm2_tokenizer()
    for request_id, spec in WORKLOAD:
        got = received[request_id]
        assert got.finish_reasons == {0: common_pb2.FINISH_REASON_STOP}, request_id
        text = tok.decode(got.token_ids[0], skip_special_tokens=True)
        grammar: GrammarSpec = spec["grammar"]
        if grammar is TOOL_GRAMMAR:
            (call,) = json.loads(text)["tool_calls"]
            assert call["name"] == "get_weather"
            jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
        elif grammar.field == "response_format":
            jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
        elif grammar.field == "structured_outputs.regex":
            assert re.fullmatch(grammar.source, text), text
        else:
            assert text in json.loads(grammar.source), text


@pytest.fixture(scope="module")
def baseline(fleet: FleetStack) -> dict[str, Received]:
    received = asyncio.run(run_workload(fleet.gateway.address, WORKLOAD))  # type: ignore[union-attr]
    check_valid(received)
    fleet.assert_no_leak()
    return received


def run_with_fault(fleet: FleetStack, fault, at_chunk: int) -> dict[str, Received]:  # type: ignore[no-untyped-def]
    fired: list[int] = []

    def on_chunk(total: int) -> None:
        if total >= at_chunk and not fired:
            fired.append(total)
            fault()

    received = asyncio.run(run_workload(fleet.gateway.address, WORKLOAD, on_chunk))  # type: ignore[union-attr]
    assert fired, "the workload ended before the fault"
    return received


def mid_json_chunk(baseline: dict[str, Received]) -> int:
    """A response count by which every stream has started and the JSON ones are unfinished:
    about a third of the undisturbed run's responses."""
    return max(len(WORKLOAD), sum(len(r.token_ids[0]) for r in baseline.values()) // 6)


def test_worker_kill_mid_json(fleet: FleetStack, baseline: dict[str, Received]) -> None:
    received = run_with_fault(fleet, fleet.workers[0].kill, mid_json_chunk(baseline))
    check_valid(received)
    assert_same_outputs(baseline, received)
    log = fleet.scheduler.log.read_text(errors="replace")  # type: ignore[union-attr]
    assert '"event": "request migrated"' in log, "the kill moved no request"
    fleet.assert_no_leak()
    fleet.workers[0].start()
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "the restarted worker ready")


def test_scheduler_restart_mid_json(fleet: FleetStack, baseline: dict[str, Received]) -> None:
    scheduler = fleet.scheduler
    assert scheduler is not None

    def restart() -> None:
        scheduler.kill()
        scheduler.start(wait=False)

    received = run_with_fault(fleet, restart, mid_json_chunk(baseline))
    check_valid(received)
    assert_same_outputs(baseline, received)
    fleet.wait_for(lambda s: len(fleet.ready_replicas(s)) == 2, "workers back")
    fleet.assert_no_leak()

