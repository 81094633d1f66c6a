"""A server under a benchmark: started on a free loopback port once the machine is quiet,
waited for (/health, then until its start-up background work is done: `wait_settled`), measured with bench/serve.py clients (bounded by --max-duration), its
processes' CPU time accounted for, and stopped. bench/serve_compare.py, vs_llama_cpp.py,
spec_decode.py and grammar_serve.py run their servers through `measure_clients`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil  # installed with accelerate

from llmserve.supervisor import stop_process

BENCH = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


@dataclass(frozen=True, slots=True)
class Server:
    name: str  # file names: serve-<name>.json
    label: str  # the table's first column
    command: list[str]
    port: int
    model: str  # the `model` field requests carry

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


def shown(command: list[str]) -> str:
    """The command line as one types it from the repository root."""
    return shlex.join(command).replace(f"{Path.cwd()}/", "")


def wait_for_quiet(max_load: float, patience_s: float) -> float:
    """Wait until the 1-minute load average is under max_load (others share the cores)."""
    deadline = time.monotonic() + patience_s
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() < deadline:
        time.sleep(10)
    if load >= max_load:
        print(f"load {load:.2f} still >= {max_load} after {patience_s:.0f} s; going on")
    return load


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} during start-up")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


# A healthy server is settled when its processes take under SETTLED_CORES of CPU over a
# SETTLE_WINDOW_S window: what it starts in the background once up (llmserve's scheduler
# loads the tokenizer and builds the grammar backend for the model, 10 s of CPU for Gemma 3's
# vocabulary on the Xeon) is then done and runs in neither server's measured window.
SETTLE_WINDOW_S, SETTLED_CORES = 2.0, 0.05


def wait_settled(server_pid: int, timeout_s: float) -> float:
    """Wait until the server's processes are settled (or timeout_s); returns the seconds."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = sum(server_cpu_s(server_pid).values())
        time.sleep(SETTLE_WINDOW_S)
        if sum(server_cpu_s(server_pid).values()) - before < SETTLED_CORES * SETTLE_WINDOW_S:
            break
    return time.monotonic() - started


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the server (llmserve up stops its services itself), then SIGKILL whatever of
    it is left; its processes are listed first, as `llmserve up` starts them in new sessions."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for p in alive:
        print(f"killing pid {p.pid} after {grace_s:.0f} s")
        p.kill()
    psutil.wait_procs(alive, timeout=10)


def run_client(command: list[str], max_duration: float) -> None:
    """serve.py stops itself at --max-duration; this bounds loading, warm-up and the report,
    and stops it (it then writes what it has) if we are stopped."""
    client = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        client.wait(timeout=max_duration + 300)
    except (subprocess.TimeoutExpired, KeyboardInterrupt, SystemExit):
        stop_process(client, grace_s=120)
        if sys.exc_info()[0] is not subprocess.TimeoutExpired:
            raise


def busy_cpu_s() -> float:
    """CPU seconds this machine has spent busy, all processes (steal is another VM's)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


def our_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the server with its services,
    the client)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def process_family(pid: int) -> list[psutil.Process]:
    """The process and every descendant, or nothing once it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def server_cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of a server's processes, by role: the service an `llmserve.cli`
    process runs (worker, scheduler, gateway), else the process's name (`llama-server`, and
    `llmserve up`'s supervisor as `llmserve`)."""
    roles: dict[str, float] = {}
    for p in process_family(server_pid):
        try:
            command, times, name = p.cmdline(), p.cpu_times(), p.name()
        except psutil.NoSuchProcess:
            continue
        role = command[command.index("llmserve.cli") + 1] if "llmserve.cli" in command else name
        roles[role] = roles.get(role, 0.0) + times.user + times.system
    return roles


def ensure_hf_model(path: Path, spec: str = "smollm2") -> None:
    """A model spec (default: the embedded model) as a plain HF directory (weights and
    tokenizer), exported once."""
    if not (path / "config.json").is_file():
        export = [sys.executable, str(BENCH / "export_hf_model.py"), "--model", spec,
                  "--out", str(path)]  # fmt: skip
        subprocess.run(export, check=True)  # float32; each server casts to --dtype


def measure_server(
    server: Server,
    client: list[str],
    result_path: Path,
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    probe: Callable[[int], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One serve.py `client` (writing `result_path`) on a fresh `server`: `measure_clients`."""
    return measure_clients(server, [(client, result_path)], args, env, probe)[0]


def measure_clients(
    server: Server,
    clients: list[tuple[list[str], Path]],
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    probe: Callable[[int], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Wait for a quiet machine, start `server` (log: <log_dir>/<first result's name>.log,
    `env` added to ours), run each serve.py client command in turn (each writes its result
    path), stop the server. Uses args.max_load, load_patience, log_dir, start_timeout and
    max_duration. Returns each client's summary with the commands and the load during the
    server's life, under "server_cpu_s" the CPU seconds each of the server's processes took
    while the client ran (`server_cpu_s`, by role), and under "probe" what `probe(server
    pid)` returned after the client finished (the server still up). A client that fails fails
    the ones after it."""
    load_before = wait_for_quiet(args.max_load, args.load_patience)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log_path = args.log_dir / f"{clients[0][1].stem}.log"
    print(f"== {server.label} (load {load_before:.2f}); log: {log_path}")
    prefix = "".join(f"{k}={v} " for k, v in (env or {}).items())
    print("   $ " + prefix + shown(server.command))
    started, busy, ours = time.monotonic(), busy_cpu_s(), our_cpu_s()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            server.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    summaries: list[dict[str, Any]] = []
    try:
        wait_healthy(proc, server.health_url, args.start_timeout)
        print(f"   healthy after {time.monotonic() - started:.0f} s", end="")
        print(f", settled {wait_settled(proc.pid, args.start_timeout):.0f} s later")
        for client, result_path in clients:
            print("   $ " + shown(client))
            result_path.unlink(missing_ok=True)
            cpu_before = server_cpu_s(proc.pid)
            run_client(client, args.max_duration)
            cpu_after = server_cpu_s(proc.pid)
            if not result_path.exists():
                raise RuntimeError("serve.py wrote no result")
            summary = json.loads(result_path.read_text())["summary"]
            summary["server_cpu_s"] = {
                role: seconds - cpu_before.get(role, 0.0) for role, seconds in cpu_after.items()
            }
            if probe is not None:
                summary["probe"] = probe(proc.pid)
            summaries.append(summary)
    except (RuntimeError, TimeoutError) as exc:
        print(f"   failed: {exc}")
        summaries += [{"label": server.label, "error": str(exc)}] * (len(clients) - len(summaries))
    finally:
        stop(proc)
    # What other people's jobs took from the 2 cores while this server ran, in cores.
    others = (busy_cpu_s() - busy) - (our_cpu_s() - ours)
    contention = f"{load_before:.2f} / {others / (time.monotonic() - started):.2f}"
    return [
        {
            **summary,
            "contention": contention,
            "commands": [prefix + shown(server.command), shown(client)],
        }
        for summary, (client, _) in zip(summaries, clients, strict=True)
    ]
