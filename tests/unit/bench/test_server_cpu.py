"""bench/server_runs.py's CPU time by server process role, on real processes, and
bench/server_probes.py's per-token lines worked out here from the inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from server_probes import cpu_lines  # noqa: E402
from server_runs import server_cpu_s  # noqa: E402

# A child that burns 0.3 s of CPU, then waits for its stdin to close.
_BURN = "import sys, time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\nsys.stdin.read()"  # noqa: E501

# A parent that runs the burner under a command line naming its role as `llmserve up`'s
# services' do, and says when the burner has used its CPU.
_SPAWN = """
import subprocess, sys, time
import psutil
child = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], "-m", "llmserve.cli", "worker"], stdin=subprocess.PIPE
)
while sum(psutil.Process(child.pid).cpu_times()[:2]) < 0.3:
    time.sleep(0.05)
print("burnt", flush=True)
sys.stdin.read()
child.communicate(b"")
"""


def test_cpu_is_counted_per_role_across_the_process_tree() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _SPAWN, _BURN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline() == b"burnt\n"  # the child has used its 0.3 s
        roles = server_cpu_s(parent.pid)
    finally:
        parent.communicate(b"", timeout=60)
    assert len(roles) == 2  # the parent, by its process name, and the worker
    assert roles["worker"] >= 0.3
    assert server_cpu_s(parent.pid) == {}  # gone


def test_lines_divide_each_role_by_the_run_s_output_tokens() -> None:
    result = {
        "runs": {
            "1-q4_0": {
                "llmserve": {
                    "total_output_tokens": 1000,
                    "client_cpu_s": 0.5,
                    "server_cpu_s": {"scheduler": 1.2, "worker": 14.0, "gateway": 0.8, "x": 0},
                },
                "llama.cpp": {
                    "total_output_tokens": 500,
                    "client_cpu_s": 0.25,
                    "server_cpu_s": {"llama-server": 6.0},
                },
            },
            "16-q4_0": {"llmserve": {"error": "exited"}},
        }
    }
    assert cpu_lines(result, ("llmserve", "llama.cpp")) == [
        "- 1 streams (q4_0): llmserve 16.00 (worker 14.00, scheduler 1.20, gateway 0.80; "
        "client 0.50); llama.cpp 12.00 (llama-server 12.00; client 0.50)"
    ]
