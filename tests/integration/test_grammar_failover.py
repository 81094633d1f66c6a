"""Constrained streams survive a killed worker and a restarted scheduler with exactly the
output they would have had: the scheduler owns each sequence's matcher and rebuilds it from
the tokens (DESIGN.md 12). Two workers on the embedded SmolLM2, 16 concurrent streams (JSON
schema, the tool-call envelope, regex, choice; greedy and seeded); every output is valid for
its grammar and byte-identical to the undisturbed run. The same under preemption: a second
fleet whose KV caches hold a fraction of what 16 JSON and tool-call streams need preempts
them (counted by GetStats) in the undisturbed run and in the run with the kill."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
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
from tests.support.models import EXACT_MODE_ARGS

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
    *EXACT_MODE_ARGS,  # outputs compared with undisturbed runs
]
# Lease long enough for a loaded machine; the health checks still see a killed worker at once.
SCHEDULER_ARGS = ["--worker-lease-s", "60"]
TOOLS = [WEATHER_TOOL]
TOOL_GRAMMAR = FORMATS["generic"].grammar(parse_tools(TOOLS, "required", False, RequestLimits()))
GRAMMARS: list[tuple[GrammarSpec, str]] = [
    (GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format"), "Describe a box as JSON:"),
    (TOOL_GRAMMAR, "Call a tool to get the weather in France:"),
    (GrammarSpec.regex(r"[0-9]{3}-[A-Z]{3}-[0-9]{2}", "structured_outputs.regex"), "A code:"),
    (
        GrammarSpec.choice(["yes, certainly", "no, never", "perhaps"], "structured_outputs.choice"),
        "Is the sky green?",
    ),
]


def workload(
    grammars: list[tuple[GrammarSpec, str]],
    max_tokens: int,
    name: str,
    seeded: Callable[[int], bool],
    seed_base: int,
) -> list[tuple[str, dict[str, Any]]]:
    """16 streams over `grammars` in turn; stream i samples at temperature 1.0 with seed
    seed_base + i where `seeded(i)`, else greedily."""
    requests = []
    for i in range(16):
        spec, prompt = grammars[i % len(grammars)]
        params: dict[str, Any] = {"max_tokens": max_tokens}
        if seeded(i):
            params.update(temperature=1.0, seed=seed_base + i)
        else:
            params["temperature"] = 0.0
        requests.append((f"{name}-{i}", {"prompt": prompt, "grammar": spec, **params}))
    return requests


WORKLOAD = workload(GRAMMARS, 120, "g", lambda i: i % 2 == 1, 100)


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


def check_valid(
    received: dict[str, Received], workload: list[tuple[str, dict[str, Any]]] = WORKLOAD
) -> None:
    tok = smollm2_tokenizer()
    for request_id, spec in workload:
        got = received[request_id]
        assert got.finish_reasons == {0: common_pb2.FINISH_REASON_STOP}, request_id
        text = tok.decode(got.token_ids[0], skip_special_tokens=True)
        grammar: GrammarSpec = spec["grammar"]
        if grammar is TOOL_GRAMMAR:
            (call,) = json.loads(text)["tool_calls"]
            assert call["name"] == "get_weather"
            jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
        elif grammar.field == "response_format":
            jsonschema.validate(json.loads(text), json.loads(grammar.source))
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


def run_with_fault(  # type: ignore[no-untyped-def]
    fleet: FleetStack, fault, at_chunk: int, workload: list[tuple[str, dict[str, Any]]] = WORKLOAD
) -> dict[str, Received]:
    fired: list[int] = []

    def on_chunk(total: int) -> None:
        if total >= at_chunk and not fired:
            fired.append(total)
            fault()

    received = asyncio.run(run_workload(fleet.gateway.address, workload, on_chunk))  # type: ignore[union-attr]
    assert fired, "the workload ended before the fault"
    return received


def mid_json_chunk(baseline: dict[str, Received]) -> int:
    """A token count by which every stream has started and the JSON ones are unfinished:
    about a sixth of the undisturbed run's tokens."""
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


# -- under preemption: a small KV cache ----------------------------------------------------------

# 8 blocks of 16 tokens per worker: exactly one sequence of max_model_len (128), the least a
# worker accepts, while each stream below needs 3 to 6 blocks (36 to 96 tokens) and all 16
# start at once on the two workers.
SMALL_CACHE_WORKER_ARGS = [
    "--max-model-len",
    "128",
    "--kv-cache-memory",
    "0.1",
    "--swap-space",
    "0.02",
    "--num-threads",
    "1",
    *EXACT_MODE_ARGS,
]
SMALL_CACHE_SCHEDULER_ARGS = [*SCHEDULER_ARGS, "--num-gpu-blocks-override", "8"]
# Longer than BOUNDED_SCHEMA's objects, and bounded: 60 to 90 tokens, below max_tokens (110,
# which the longest prompt, 10 tokens, leaves room for under max_model_len).
LONG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 30, "maxLength": 40},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 10, "maximum": 99},
            "minItems": 10,
            "maxItems": 10,
        },
    },
    "required": ["title", "scores"],
    "additionalProperties": False,
}
PREEMPTION_GRAMMARS = [
    (GrammarSpec.json_schema(LONG_SCHEMA, "response_format"), "Describe a film as JSON:"),
    GRAMMARS[1],
]


# JSON schema and tool calls (the long outputs), greedy and seeded.
PREEMPTION_WORKLOAD = workload(PREEMPTION_GRAMMARS, 110, "p", lambda i: i % 4 >= 2, 300)


@pytest.fixture(scope="module")
def small_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = start_fleet(
        MODEL,
        tmp_path_factory.mktemp("grammar-small-fleet"),
        2,
        scheduler_args=SMALL_CACHE_SCHEDULER_ARGS,
        worker_args=SMALL_CACHE_WORKER_ARGS,
    )
    yield stack
    stack.stop()


def num_preemptions(fleet: FleetStack) -> int:
    return fleet.stats().totals.num_preemptions


def test_preemption_and_worker_kill_mid_json(small_fleet: FleetStack) -> None:
    fleet = small_fleet
    replicas = fleet.ready_replicas(fleet.stats())
    assert [r.gpu_blocks_total for r in replicas] == [8, 8]
    before = num_preemptions(fleet)
    undisturbed = asyncio.run(run_workload(fleet.gateway.address, PREEMPTION_WORKLOAD))  # type: ignore[union-attr]
    check_valid(undisturbed, PREEMPTION_WORKLOAD)
    after_undisturbed = num_preemptions(fleet)
    assert after_undisturbed > before, "the undisturbed run preempted nothing"
    fleet.assert_no_leak()

    at_chunk = max(16, sum(len(r.token_ids[0]) for r in undisturbed.values()) // 6)
    received = run_with_fault(fleet, fleet.workers[0].kill, at_chunk, PREEMPTION_WORKLOAD)
    check_valid(received, PREEMPTION_WORKLOAD)
    assert_same_outputs(undisturbed, received)
    assert num_preemptions(fleet) > after_undisturbed, "the run with the kill preempted nothing"
    log = fleet.scheduler.log.read_text(errors="replace")  # type: ignore[union-attr]
    assert '"event": "request migrated"' in log, "the kill moved no request"
    fleet.assert_no_leak()
