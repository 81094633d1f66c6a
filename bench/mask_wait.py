"""What the worker waits for under structured output: the token masks of a step follow it on the
Execute stream, computed by the scheduler while the worker runs the forward pass; the worker
waits for them only just before sampling (`llmserve_worker_mask_wait_seconds`).

One stack (worker, scheduler, gateway) on the embedded SmolLM2; N concurrent constrained
streams (JSON schema and the tool-call envelope, greedy and seeded) through the gateway's gRPC
API, with asynchronous scheduling on and off, forced tokens on and off. From the services' /metrics, per constrained
step: the scheduler's mask computation (what the worker waited for when masks travelled with
their step) against the worker's wait now, and the forward pass beside them.

    .venv/bin/python bench/mask_wait.py [--streams 16] [--max-tokens 120]

Not for timed assertions; on a shared machine take the best of several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.tool_formats.generic import GenericFormat  # noqa: E402
from gateway.tools import parse_tools  # noqa: E402
from llmserve.grammar.spec import GrammarSpec  # noqa: E402
from llmserve.limits import RequestLimits  # noqa: E402
from tests.support.fleet import run_workload  # noqa: E402
from tests.support.grammar import BOUNDED_SCHEMA, WEATHER_TOOL  # noqa: E402
from tests.support.stack import RunningStack, start_stack  # noqa: E402

# A cache that holds the 16 streams (start_stack's 0.05 GiB cannot hold one 8k sequence).
WORKER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "0.2"]
# Asynchronous scheduling on and off, with forced tokens (the default) and without. With
# forced tokens, `--async-scheduling` alone holds a constrained step back while its grammar
# forced tokens within the last 8 tokens (the default policy); `--forced-hold-tokens 0`
# continues every step, and a window longer than any output never continues them.
CONFIGS = [
    ["--async-scheduling", "--forced-hold-tokens", "0"],
    ["--async-scheduling", "--forced-hold-tokens", "1000000"],
    ["--async-scheduling"],
    ["--no-async-scheduling"],
    ["--async-scheduling", "--no-forced-tokens"],
    ["--no-async-scheduling", "--no-forced-tokens"],
]
GRAMMARS = [
    (GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format"), "Describe a box as JSON:"),
    (
        GenericFormat().grammar(parse_tools([WEATHER_TOOL], "required", False, RequestLimits())),
        "Call a tool to get the weather in France:",
    ),
]


def workload(streams: int, max_tokens: int) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    requests = []
    for i in range(streams):
        spec, prompt = GRAMMARS[i % 2]
        params: dict = {"max_tokens": max_tokens, "temperature": 0.0}  # type: ignore[type-arg]
        if i % 4 >= 2:
            params.update(temperature=1.0, seed=i)
        request_id = f"m-{i}-{time.monotonic_ns()}"
        requests.append((request_id, {"prompt": prompt, "grammar": spec, **params}))
    return requests


def scrape(port: int) -> dict[str, float]:
    """The service's /metrics: each sample by its name with labels, and each name's sum over
    its labels."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        totals[name] = totals.get(name, 0.0) + float(value)
        if name_labels != name:
            totals[name_labels] = float(value)
    return totals


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def measure(stack: RunningStack, streams: int, max_tokens: int) -> dict[str, float]:
    ports = stack.metrics_ports
    w0, s0 = scrape(ports["worker"]), scrape(ports["scheduler"])
    start = time.perf_counter()
    asyncio.run(run_workload(stack.gateway, workload(streams, max_tokens)))
    seconds = time.perf_counter() - start
    w1, s1 = scrape(ports["worker"]), scrape(ports["scheduler"])
    waits = delta(w1, w0, "llmserve_worker_mask_wait_seconds_count")
    masked_steps = delta(s1, s0, "llmserve_grammar_mask_seconds_count")
    steps = delta(w1, w0, "llmserve_worker_forward_seconds_count")
    return {
        "seconds": seconds,
        "steps": steps,
        "constrained_steps": waits,
        "wait_ms": 1e3 * delta(w1, w0, "llmserve_worker_mask_wait_seconds_sum") / max(waits, 1),
        "waits_under_100us": _under(w0, w1, "0.0001") / max(waits, 1),
        "mask_ms": 1e3 * delta(s1, s0, "llmserve_grammar_mask_seconds_sum") / max(masked_steps, 1),
        "rows_per_step": delta(s1, s0, "llmserve_grammar_masked_rows_total") / max(masked_steps, 1),
        "forward_ms": 1e3 * delta(w1, w0, "llmserve_worker_forward_seconds_sum") / max(steps, 1),
    }


def _under(before: dict[str, float], after: dict[str, float], le: str) -> float:
    """Mask waits at or below `le` seconds (one histogram bucket, read from /metrics)."""
    name = f'llmserve_worker_mask_wait_seconds_bucket{{le="{le}"}}'
    return after.get(name, 0.0) - before.get(name, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    for flags in CONFIGS:
        flag = " ".join(flags)
        with tempfile.TemporaryDirectory() as tmp:
            stack = start_stack("smollm2", Path(tmp), worker_args=WORKER_ARGS, scheduler_args=flags)
            try:
                measure(stack, 2, 8)  # warm: the tokenizer's grammar backend, the first compile
                for _ in range(args.repeat):
                    m = measure(stack, args.streams, args.max_tokens)
                    print(
                        f"{flag} x{args.streams}: {m['constrained_steps']:.0f} constrained of "
                        f"{m['steps']:.0f} steps, {m['rows_per_step']:.1f} masked rows per step; "
                        f"per constrained step: masks computed in {m['mask_ms']:.2f} ms, worker "
                        f"waited {m['wait_ms']:.3f} ms ({100 * m['waits_under_100us']:.0f}% "
                        f"under 0.1 ms); forward {m['forward_ms']:.1f} ms per step; "
                        f"{m['seconds']:.1f} s"
                    )
            finally:
                stack.stop()


if __name__ == "__main__":
    main()
