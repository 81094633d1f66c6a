"""The fault campaign, short: two scheduler shards, four workers and two gateways on the tiny
model, a mixed workload (greedy and seeded sampling, n=2, best_of, beam search, logprobs,
shared prefixes, JSON schemas, stop strings, priorities, client cancels, n-gram drafts) run
undisturbed, then again under faults drawn from a seed: workers and shards killed and paused
(short pauses are slow steps, long ones lost processes), workers drained (those armed with
failpoints die mid KV transfer, at either end) and replaced by joiners, the second gateway
killed, bursts that fill the waiting queues.

What must hold: every stream its client did not cancel equals the undisturbed one, token for
token (a cancelled one is a prefix of it); every constrained output is valid; a client of the
killed gateway sees UNAVAILABLE and gets the same output from the other gateway; a burst
request is served whole or refused (429 / 503) before any token, and a refused workload
request is sent again after Retry-After and then checked like the others; afterwards every
replica's blocks, slots and transfers are free, its invariants hold, and no process is left.

LLMSERVE_CAMPAIGN_SEED picks the seed (`bench/fault_campaign.py` runs long campaigns).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.support.campaign import CampaignStack, Fault, start_campaign_stack
from tests.support.campaign_checks import run_campaign
from tests.support.fleet import Received
from tests.support.grammar import smollm2_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.services]

SEED = int(os.environ.get("LLMSERVE_CAMPAIGN_SEED", "1"))
ROUNDS = 2


def validate(spec: dict[str, Any], got: Received) -> str | None:
    """What is wrong with a JSON-schema output, or None."""
    text = smollm2_tokenizer().decode(got.token_ids[0], skip_special_tokens=True)
    try:
        jsonschema.validate(json.loads(text), json.loads(spec["grammar"].source))
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{text!r}: {exc}"
    return None


@pytest.fixture(scope="module")
def stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CampaignStack]:
    running = start_campaign_stack(str(tiny_model_dir), tmp_path_factory.mktemp("campaign"))
    yield running
    running.stop()
    for proc in running.processes():
        assert proc.popen is None or proc.popen.poll() is not None, f"{proc.name} left running"


def test_a_lost_gateway_s_clients_see_unavailable_and_get_the_same_output_elsewhere(
    stack: CampaignStack,
):
    """The second gateway killed early in a round (DESIGN.md 8): each of its clients sees
    UNAVAILABLE, retries on the first gateway and gets the undisturbed output; the schedulers
    aborted the lost gateway's requests (every block is free after the round)."""
    kill = Fault(at_response=40, kind="gateway_kill", target=0)
    report = run_campaign(stack, SEED + 1000, rounds=1, validate=validate, fixed_faults=[kill])
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.faults == {"gateway_kill": 1}
    assert report.retried > 0
    assert set(report.lost_codes) == {"UNAVAILABLE"}, report.lost_codes
    shard_logs = "".join(s.log.read_text(errors="replace") for s in stack.fleet.schedulers)
    assert '"event": "gateway disconnected"' in shard_logs


def test_a_short_seeded_campaign_changes_no_stream_and_leaks_nothing(stack: CampaignStack):
    report = run_campaign(stack, SEED, rounds=ROUNDS, faults_per_round=6, validate=validate)
    assert not report.failures, "\n".join(report.failures[:20])
    assert sum(report.faults.values()) == 6 * ROUNDS, report.faults
    assert report.requests_checked > 0 and report.differing == 0
