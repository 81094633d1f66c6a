"""What bench/vs_llama_cpp.py reads from the servers after a run, and its report lines:
llmserve's worker step times and forward gaps (from its /metrics), both servers' resident
memory, and the CPU time their processes and the client took per output token."""

from __future__ import annotations

from typing import Any

_GAP = "llmserve_worker_forward_gap_seconds"
_TIMES = ("llmserve_worker_forward_seconds", "llmserve_worker_sample_seconds")


def worker_metrics(server_pid: int) -> dict[str, Any]:
    """Where a worker's step time went during the run (the warm-up request included): mean
    forward pass and sampler time per step, and the forward gap (end of one forward pass to
    the start of the next, issue #18's target < 0.5 ms with asynchronous scheduling) for
    steps whose successor was already queued and for steps that waited for it. Read from
    the `llmserve up` worker's /metrics (its --metrics-port, from its command line)."""
    import httpx
    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    for child in psutil.Process(server_pid).children(recursive=True):
        command = child.cmdline()
        if "worker" in command and "--metrics-port" in command:
            port = command[command.index("--metrics-port") + 1]
            break
    else:
        return {"error": "no worker process with --metrics-port"}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value for s in samples if s.name == name and labels.items() <= s.labels.items()
        )

    out: dict[str, Any] = {
        "rss_bytes": child.memory_info().rss,
        "weight_bytes": value("llmserve_worker_weight_bytes") or None,
    }
    for name in _TIMES:
        count = value(f"{name}_count")
        out[name.removeprefix("llmserve_worker_") + "_mean_ms"] = (
            1000 * value(f"{name}_sum") / count if count else None
        )
    for next_step in ("queued", "awaited"):
        count = value(f"{_GAP}_count", next_step=next_step)
        under = value(f"{_GAP}_bucket", next_step=next_step, le="0.0005")
        out[f"gap_{next_step}"] = {
            "steps": int(count),
            "mean_ms": 1000 * value(f"{_GAP}_sum", next_step=next_step) / count if count else None,
            "share_under_0.5ms": under / count if count else None,
        }
    return out


def server_memory(server_pid: int) -> dict[str, Any]:
    """llama-server's resident memory (the probe of its runs; llmserve's is the worker's, in
    `worker_metrics`)."""
    import psutil

    return {"rss_bytes": psutil.Process(server_pid).memory_info().rss}


def memory_lines(result: dict[str, Any], servers: tuple[str, str]) -> list[str]:
    """One line per run pair: llmserve's (servers[0]) worker RSS and weights, the peer's RSS."""
    lines = []
    for key, runs in result["runs"].items():
        mine, theirs = (runs.get(s, {}).get("probe") or {} for s in servers)
        if "rss_bytes" not in mine or "rss_bytes" not in theirs:
            continue
        streams, dtype = key.split("-", 1)
        weights = mine.get("weight_bytes")
        held = f" (weights {weights / 1e6:.1f} MB)" if weights else ""
        lines.append(
            f"- {streams} streams ({dtype}): llmserve's worker {mine['rss_bytes'] / 1e6:.0f} MB"
            f"{held}, llama-server {theirs['rss_bytes'] / 1e6:.0f} MB"
        )
    return lines


def gap_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for key, runs in result["runs"].items():
        m = runs.get("llmserve", {}).get("probe")
        if not m or "error" in m:
            continue
        streams, dtype = key.split("-", 1)
        parts = [
            f"forward {m['forward_seconds_mean_ms']:.1f} ms, sampler "
            f"{m['sample_seconds_mean_ms']:.2f} ms per step (means)"
        ]
        for next_step in ("queued", "awaited"):
            g = m[f"gap_{next_step}"]
            if g["steps"]:
                parts.append(
                    f"gap, next step {next_step}: {g['steps']} steps, mean {g['mean_ms']:.2f} ms, "
                    f"{100 * g['share_under_0.5ms']:.0f}% under 0.5 ms"
                )
        lines.append(f"- {streams} streams ({dtype}): {'; '.join(parts)}")
    return lines


def cpu_lines(result: dict[str, Any], servers: tuple[str, str]) -> list[str]:
    """One line per run pair: each server's CPU milliseconds per output token while its client
    ran (server_runs.measure_clients' `server_cpu_s`, by process role), and the client's."""
    lines = []
    for key, runs in result["runs"].items():
        parts = []
        for name in servers:
            s = runs.get(name, {})
            tokens = s.get("total_output_tokens")
            if not tokens or "server_cpu_s" not in s:
                continue
            roles = sorted(s["server_cpu_s"].items(), key=lambda kv: -kv[1])
            per_token = ", ".join(f"{role} {1000 * cpu / tokens:.2f}" for role, cpu in roles if cpu)
            total = 1000 * sum(cpu for _, cpu in roles) / tokens
            client = 1000 * s.get("client_cpu_s", 0.0) / tokens
            parts.append(f"{name} {total:.2f} ({per_token}; client {client:.2f})")
        if parts:
            streams, dtype = key.split("-", 1)
            lines.append(f"- {streams} streams ({dtype}): {'; '.join(parts)}")
    return lines
