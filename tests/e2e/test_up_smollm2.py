"""`llmserve up` on the embedded SmolLM2, as a newcomer runs it (slow: loads the real model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from llmserve.client import Client
from llmserve.supervisor import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_up_answers_the_capital_of_france(tmp_path: Path):
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "up", "--grpc-port", str(grpc_port),
         "--http-port", str(http_port)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 600
        while "llmserve is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        with Client(f"127.0.0.1:{grpc_port}", timeout_s=300) as client:
            answer = client.complete(
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0.0, max_tokens=48,
            )
        assert "Paris" in answer.text, answer.text
        assert answer.finish_reasons[0] in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    # Ctrl-C stopped every child: nothing listens on the gateway port any more.
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, pytest.raises(
        grpc.FutureTimeoutError
    ):
        grpc.channel_ready_future(channel).result(timeout=2)
