"""Where a served step's time goes, read from the services' own Prometheus metrics.

`llmserve up` starts each worker and scheduler with `--metrics-port`; `metrics_ports(pid)`
finds those ports on the command lines of the server's processes, `snapshot(ports)` reads
every sample, and
`step_breakdown(before, after, ...)` turns two snapshots (and the processes' CPU seconds at
the same moments, `server_runs.server_cpu_s`) into per-step figures for the interval: steps
and steps/s, the scheduler's iteration, the worker's forward pass, sampling, host preparation,
idle gap and the model thread's wait for the next step per step, how
many steps replayed a decode CUDA graph and why the others ran eagerly, and each service's
host CPU per step.
"""

from __future__ import annotations

from typing import Any

import httpx
import psutil  # installed with accelerate
from prometheus_client.parser import text_string_to_metric_families
from server_runs import process_family

# One sample per (name, labels): a labelled metric has a sample per label set.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int, timeout_s: float = 5.0) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s)
    response.raise_for_status()
    return parse(response.text)


def metrics_ports(server_pid: int) -> dict[str, int]:
    """`--metrics-port` of each `llmserve.cli` service under `server_pid`, by its role."""
    ports: dict[str, int] = {}
    for p in process_family(server_pid):
        try:
            command = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "llmserve.cli" in command and "--metrics-port" in command:
            role = command[command.index("llmserve.cli") + 1]
            ports[role] = int(command[command.index("--metrics-port") + 1])
    return ports


def snapshot(ports: dict[str, int]) -> dict[str, Samples]:
    return {role: scrape(port) for role, port in ports.items()}


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """The change of `name` summed over its label sets that hold `labels` (every replica's
    when a metric is labelled by replica)."""
    want = set(labels.items())
    return sum(
        value - before.get(key, 0.0)
        for key, value in after.items()
        if key[0] == name and want <= key[1]
    )


def _by_label(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """The changes of `name` by the value of its `label`, zero changes left out."""
    values = {dict(key[1]).get(label) for key in after if key[0] == name}
    deltas = {v: _delta(before, after, name, **{label: v}) for v in values if v is not None}
    return {v: d for v, d in deltas.items() if d}


def _mean_ms(before: Samples, after: Samples, name: str, **labels: str) -> float | None:
    count = _delta(before, after, f"{name}_count", **labels)
    return _delta(before, after, f"{name}_sum", **labels) / count * 1e3 if count else None


def step_breakdown(
    before: dict[str, Samples],
    after: dict[str, Samples],
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    wall_s: float,
) -> dict[str, Any]:
    """Per-step figures over the interval between two snapshots (by role) of one worker
    and one scheduler."""
    w0, w1 = before.get("worker", {}), after.get("worker", {})
    s0, s1 = before.get("scheduler", {}), after.get("scheduler", {})
    steps = _delta(w0, w1, "llmserve_worker_steps_total")
    gap = "llmserve_worker_forward_gap_seconds"
    per_step = steps or float("nan")
    return {
        "steps": steps,
        "steps_per_s": steps / wall_s if wall_s > 0 else None,
        "tokens_per_step": _delta(w0, w1, "llmserve_worker_tokens_total") / per_step,
        "scheduler_iteration_ms": _mean_ms(s0, s1, "llmserve_iteration_seconds"),
        "worker_forward_ms": _mean_ms(w0, w1, "llmserve_worker_forward_seconds"),
        "worker_prepare_ms": _mean_ms(w0, w1, "llmserve_worker_prepare_seconds"),
        "worker_sample_ms": _mean_ms(w0, w1, "llmserve_worker_sample_seconds"),
        "gap_awaited_ms": _mean_ms(w0, w1, gap, next_step="awaited"),
        "gap_queued_ms": _mean_ms(w0, w1, gap, next_step="queued"),
        "gaps_awaited": _delta(w0, w1, f"{gap}_count", next_step="awaited"),
        "gaps_queued": _delta(w0, w1, f"{gap}_count", next_step="queued"),
        # Summed over the steps, not averaged over the waits: the model thread's idle time
        # per step (a step that found the next one queued waited 0).
        "worker_waited_ms": (
            _delta(w0, w1, "llmserve_worker_step_wait_seconds_sum") / steps * 1e3 if steps else None
        ),
        "graph_steps": _delta(w0, w1, "llmserve_worker_graph_steps_total"),
        "eager_steps": _by_label(w0, w1, "llmserve_worker_eager_steps_total", "reason"),
        "cpu_ms_per_step": {
            role: (cpu_after[role] - cpu_before.get(role, 0.0)) / per_step * 1e3
            for role in cpu_after
        },
    }


def breakdown_table(levels: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows, one per concurrency level, of `step_breakdown` results."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    roles = sorted({role for b in levels.values() for role in b["cpu_ms_per_step"]})
    lines = [
        "| streams | steps/s | tokens/step | iteration ms | prepare ms | forward ms | sample ms "
        "| gap awaited ms (n) | worker waited ms | graph steps | eager steps (why) | "
        + " | ".join(f"{r} CPU ms/step" for r in roles)
        + " | GPU busy % |",
        "|" + "---|" * (12 + len(roles)),
    ]
    for streams, b in levels.items():
        eager = ", ".join(f"{n:.0f} {why}" for why, n in sorted(b["eager_steps"].items()))
        cpu = " | ".join(ms(b["cpu_ms_per_step"].get(r)) for r in roles)
        lines.append(
            f"| {streams} | {b['steps_per_s'] or 0:.1f} | {b['tokens_per_step']:.1f} "
            f"| {ms(b['scheduler_iteration_ms'])} | {ms(b.get('worker_prepare_ms'))} "
            f"| {ms(b['worker_forward_ms'])} "
            f"| {ms(b['worker_sample_ms'])} | {ms(b['gap_awaited_ms'])} "
            f"({b['gaps_awaited']:.0f}) | {ms(b.get('worker_waited_ms'))} "
            f"| {b['graph_steps']:.0f} | {eager or '0'} | {cpu} "
            f"| {ms(b.get('gpu_busy_pct'))} |"
        )
    return lines
