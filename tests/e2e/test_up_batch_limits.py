"""`llmserve up --max-num-seqs 8`: the flag reaches the scheduler only, and the worker adopts
the scheduler's batch limits at InitializeCache (issue 48: one owner for each fact)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from llmserve.client import Client
from tests.support.models import build_tiny_llama
from tests.support.up import interrupt, start_up

pytestmark = [pytest.mark.e2e, pytest.mark.services]


def _worker_events(output: str, event: str) -> list[dict[str, Any]]:
    prefix = "[worker-0] {"
    return [
        entry
        for line in output.splitlines()
        if line.startswith(prefix)
        and (entry := json.loads(line[len(prefix) - 1 :]))["event"] == event
    ]


def test_the_worker_runs_under_the_batch_limits_up_gives_the_scheduler(tmp_path: Path):
    model = build_tiny_llama(tmp_path / "tiny")
    proc, log, grpc_port, _ = start_up(
        tmp_path, "--model", str(model), "--max-num-seqs", "8", timeout_s=300
    )
    try:
        # A request that finished: the scheduler has initialized the worker by then.
        with Client(f"127.0.0.1:{grpc_port}", timeout_s=120) as client:
            answer = client.complete(prompt="Hello there", max_tokens=4, temperature=0.0)
        assert len(answer.token_ids[0]) == 4
    finally:
        interrupt(proc, signal.SIGTERM)
    output = log.read_text(errors="replace")
    adopted = _worker_events(output, "batch limits adopted")
    assert adopted, output[-4000:]
    assert {(e["max_num_seqs"], e["max_num_batched_tokens"]) for e in adopted} == {(8, 2048)}
    # The worker profiled at start-up under its own (default) limits, then again under the
    # scheduler's.
    capacity = [e["max_num_seqs"] for e in _worker_events(output, "kv capacity")]
    assert capacity[0] == 256 and capacity[-1] == 8, capacity
