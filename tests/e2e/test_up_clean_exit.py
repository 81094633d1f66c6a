"""`llmserve up` starts, serves and stops without noise: no traceback, no leak report, no line
repeated over and over (issue 32: hundreds of nanobind lines buried the drain and exit lines)."""

from __future__ import annotations

import json
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from llmserve.client import Client
from tests.support.models import build_tiny_llama
from tests.support.up import interrupt, start_up

pytestmark = [pytest.mark.e2e, pytest.mark.services]

# A line may appear this often (per service, numbers and timestamps aside) in a run that
# serves one request: start, health and stop lines appear once or twice each.
MAX_REPEATS = 4


def _shape(line: str) -> str:
    """The line without what changes between repeats: times, ids, counts, addresses."""
    line = re.sub(r'"(timestamp|trace_id|request_id|span_id)": "[^"]*"', "", line)
    return re.sub(r"\d+", "N", line)


def _service_pids(log: Path) -> dict[str, int]:
    """The pid `llmserve up` logged for each service it started."""
    pids = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"event": "starting"' in line and '"pid": ' in line:
            entry = json.loads(line[line.index("{") :])
            pids[entry["service"]] = entry["pid"]
    return pids


def test_up_serves_and_stops_on_sigterm_without_noise(tmp_path: Path):
    model = build_tiny_llama(tmp_path / "tiny")
    proc, log, grpc_port, _ = start_up(tmp_path, "--model", str(model), timeout_s=300)
    try:
        with Client(f"127.0.0.1:{grpc_port}", timeout_s=120) as client:
            answer = client.complete(prompt="Hello there", max_tokens=8, temperature=0.0)
        assert len(answer.token_ids[0]) == 8
        # No service of a CPU stack has Triton's native library mapped (torch would load it
        # through torch._dynamo if it were importable).
        pids = _service_pids(log)
        assert sorted(pids) == ["gateway", "scheduler", "worker-0"]
        for service, pid in pids.items():
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtriton" not in maps, service
    finally:
        interrupt(proc, signal.SIGTERM)
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output[-4000:]
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
