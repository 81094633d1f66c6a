"""`llmserve up` as a test starts it: a real process on ports chosen at run time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from llmserve.ports import free_port
from llmserve.supervisor import stop_process


def start_up(
    tmp_path: Path, *extra: str, timeout_s: float = 600
) -> tuple[subprocess.Popen[bytes], Path, int, int]:
    """Start `llmserve up EXTRA...` and wait for "llmserve is up"; returns the process, its
    log, and the gateway's gRPC and HTTP ports."""
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "up",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), *extra],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while "llmserve is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
    except BaseException:
        stop_process(proc, grace_s=10)
        raise
    return proc, log, grpc_port, http_port


def interrupt(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT) -> None:
    """Ctrl-C (or `sig`), as a user stops `llmserve up`."""
    stop_process(proc, grace_s=60, sig=sig)
