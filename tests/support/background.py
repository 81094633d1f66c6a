"""Scenarios that only wait (on a peer's timers, say) run in a child process from the start
of the session, beside the other tests, instead of holding the run for their length.

A test marked `@pytest.mark.background("module", timeout_s=...)` takes the fixture
`background_result`: the JSON object that `python -m module` printed as its last line. The
child starts when collection has finished (tests/conftest.py), only for tests selected to
run; a test run alone starts its child itself. A child still running when the session ends
is killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


class BackgroundScenario:
    def __init__(self, module: str) -> None:
        self.module = module
        # Kept for the child's life; read by result(), closed by stop().
        self._output = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
        )

    def result(self, timeout_s: float) -> dict[str, Any]:
        """The scenario's JSON result, waiting for it up to `timeout_s` more."""
        try:
            code = self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            raise AssertionError(f"{self.module} ran past {timeout_s} s: {self._text()}") from None
        text = self._text()
        if code != 0:
            raise AssertionError(f"{self.module} exited {code}: {text}")
        return json.loads(text.strip().splitlines()[-1])

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._output.close()

    def _text(self) -> str:
        self._output.seek(0)
        return self._output.read().decode(errors="replace")[-4000:]
