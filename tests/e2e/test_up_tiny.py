"""`llmserve up` on a tiny Llama, started once and stopped with SIGTERM after one request:
it stops without noise (issue 32: hundreds of nanobind lines buried the drain and exit lines),
and `--max-num-seqs`, a scheduler flag, reaches the worker as the batch limits the scheduler
gives it at InitializeCache (issue 48: one owner for each fact)."""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llmserve.client import Client
from tests.support.models import build_tiny_llama
from tests.support.up import interrupt, start_up

pytestmark = [pytest.mark.e2e, pytest.mark.services]

# A line may appear this often (per service, numbers and timestamps aside) in a run that
# serves one request: start, health and stop lines appear once or twice each.
MAX_REPEATS = 4
NEW_TOKENS = 8


@dataclass
class UpRun:
    output: str
    returncode: int | None
    token_ids: list[int]
    # Each service by name: whether libtriton was mapped into it while it served.
    triton_mapped: dict[str, bool]


def _service_pids(log: Path) -> dict[str, int]:
    """The pid `llmserve up` logged for each service it started."""
    pids = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "starting"' in line and '"pid": ' in line:
            entry = json.loads(line[line.index("{") :])
            pids[entry["service"]] = entry["pid"]
    return pids


@pytest.fixture(scope="module")
def up_run(tmp_path_factory: pytest.TempPathFactory) -> UpRun:
    tmp_path = tmp_path_factory.mktemp("up-tiny")
    model = build_tiny_llama(tmp_path / "tiny")
    proc, log, grpc_port, _ = start_up(
        tmp_path, "--model", str(model), "--max-num-seqs", "8", timeout_s=300
    )
    try:
        # A request that finished: the scheduler has initialized the worker by then.
        with Client(f"127.0.0.1:{grpc_port}", timeout_s=120) as client:
            answer = client.complete(prompt="Hello there", max_tokens=NEW_TOKENS, temperature=0.0)
        triton_mapped = {
            service: "libtriton" in Path(f"/proc/{pid}/maps").read_text()
            for service, pid in _service_pids(log).items()
        }
    finally:
        interrupt(proc, signal.SIGTERM)
    return UpRun(
        log.read_text(errors="replace"), proc.returncode, answer.token_ids[0], triton_mapped
    )


def _shape(line: str) -> str:
    """The line without what changes between repeats: times, ids, counts, addresses."""
    line = re.sub(r'"(timestamp|trace_id|request_id|span_id)": "[^"]*"', "", line)
    return re.sub(r"\d+", "N", line)


def test_up_serves_and_stops_on_sigterm_without_noise(up_run: UpRun) -> None:
    output = up_run.output
    assert len(up_run.token_ids) == NEW_TOKENS
    # No service of a CPU stack has Triton's native library mapped (torch would load it
    # through torch._dynamo if it were importable).
    assert up_run.triton_mapped == {"gateway": False, "scheduler": False, "worker-0": False}
    assert up_run.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "leaked" not in output, [line for line in output.splitlines() if "leaked" in line][:5]
    repeated = {
        line: n for line, n in Counter(map(_shape, output.splitlines())).items()
        if n > MAX_REPEATS and line.strip()
    }  # fmt: skip
    assert repeated == {}, repeated
    # Every service said it drained: the lines the noise used to bury.
    for service in ("worker-0", "scheduler", "gateway"):
        assert re.search(rf'\[{service}\] .*"event": "drained"', output), (service, output[-3000:])


def _worker_events(output: str, event: str) -> list[dict[str, Any]]:
    prefix = "[worker-0] {"
    return [
        entry
        for line in output.splitlines()
        if line.startswith(prefix)
        and (entry := json.loads(line[len(prefix) - 1 :]))["event"] == event
    ]


def test_the_worker_runs_under_the_batch_limits_up_gives_the_scheduler(up_run: UpRun) -> None:
    output = up_run.output
    adopted = _worker_events(output, "batch limits adopted")
    assert adopted, output[-4000:]
    assert {(e["max_num_seqs"], e["max_num_batched_tokens"]) for e in adopted} == {(8, 2048)}
    # The worker profiled at start-up under its own (default) limits, then again under the
    # scheduler's.
    capacity = [e["max_num_seqs"] for e in _worker_events(output, "kv capacity")]
    assert capacity[0] == 256 and capacity[-1] == 8, capacity
