"""What the host spends per output token when a fast GPU serves many streams: a real gateway and
scheduler, one simulated worker (tests/support/simulated_worker.py: the real Worker service, the
forward pass a wait of fixed_ms + per_token_ms * tokens), and streaming clients on the gateway's
OpenAI API.

The defaults model SmolLM2's decode graphs on an H200 (bench/RESULTS.md, "The GPU path on an
H200": 2.54 ms a step at batch 1, 4.71 at 256), where the services' CPU, not the device, capped
256 streams. For each stream count, over every request's whole life (prompt included):
- CPU per output token of the gateway, the scheduler, the simulated worker's process and the
  client (utime + stime from /proc), and the gateway's and scheduler's CPU per step;
- steps, tokens per step, output tokens/s, and the simulated worker's busy share.

The client is lean on purpose (raw asyncio streams, no JSON parsed but the usage chunk), so
that on a small machine it leaves the cores to the services; its CPU is reported all the same.

    .venv/bin/python bench/host_overhead.py --streams 64 256 --out bench/results/host-overhead.json

`--profile-dir D` runs the gateway and the scheduler under cProfile (bench/profile_service.py)
and prints each one's top functions at the end; with `--sample`, under a stack sampler
instead, which does not slow the calls it counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet_size import cpu_s, print_profile  # noqa: E402  (bench/fleet_size.py)
from machine import describe  # noqa: E402
from server_runs import stop, wait_healthy  # noqa: E402

from llmserve.ports import free_ports  # noqa: E402
from tests.support.simulated_fleet import SimulatedFleetProcess, start_scheduler  # noqa: E402
from tests.support.simulated_worker import StepTimeModel  # noqa: E402

BENCH = Path(__file__).resolve().parent
SMOLLM2_VOCAB = 49152
CHAT_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "we",
    "read",
    "old",
    "books",
    "about",
    "rivers",
    "near",
    "small",
    "towns",
]


async def one_stream(port: int, path: str, body: bytes) -> int:
    """One streaming request to `path` on its own connection; returns the completion tokens
    the usage chunk reports."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    tokens = -1
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"gateway answered {status!r}: {await reader.read(500)!r}")
        async for line in reader:
            if line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: ") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    finally:
        writer.close()
    if tokens < 0:
        raise RuntimeError("the stream ended without a usage chunk")
    return tokens


async def closed_loop(port: int, streams: int, requests: int, args: argparse.Namespace) -> int:
    """`requests` requests, `streams` at a time; the output tokens of all of them."""
    rng = random.Random(args.seed)
    common = {
        "model": "smollm2", "max_tokens": args.output_len, "ignore_eos": True,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if args.endpoint == "chat":
        # Random words: each of these is one SmolLM2 token with its leading space.
        path = "/v1/chat/completions"
        bodies = [
            json.dumps({**common, "messages": [{"role": "user", "content": " ".join(
                rng.choice(CHAT_WORDS) for _ in range(args.input_len))}]}).encode()
            for _ in range(requests)
        ]  # fmt: skip
    else:
        path = "/v1/completions"
        bodies = [
            json.dumps({**common, "prompt": [
                rng.randrange(100, SMOLLM2_VOCAB) for _ in range(args.input_len)]}).encode()
            for _ in range(requests)
        ]  # fmt: skip
    pending = iter(bodies)
    total = 0

    async def lane() -> None:
        nonlocal total
        for body in pending:
            tokens = await one_stream(port, path, body)  # read `total` only once this is done
            total += tokens

    await asyncio.gather(*(lane() for _ in range(streams)))
    return total


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    profile = args.profile_dir is not None
    profiler = [sys.executable, str(BENCH / "profile_service.py")]
    if args.sample:
        profiler.append("--sample")
    suffix = "txt" if args.sample else "prof"
    sched_launcher = [*profiler, str(args.profile_dir / f"scheduler.{suffix}")] if profile else None
    scheduler = start_scheduler(
        log_dir / "scheduler.log",
        [
            "--max-num-seqs",
            str(max(args.streams)),
            "--log-level",
            "WARNING",
            "--stream-interval",
            str(args.stream_interval),
        ],
        sched_launcher,
    )
    step_time = StepTimeModel(args.fixed_ms, args.per_token_ms)
    workers = SimulatedFleetProcess(
        scheduler.address, 1, log_dir / "worker.log", step_time,
        ["--vocab-size", str(SMOLLM2_VOCAB), "--log-level", "WARNING"],
    )  # fmt: skip
    grpc_port, http_port = free_ports(2)
    command = (
        [*profiler, str(args.profile_dir / f"gateway.{suffix}")]
        if profile
        else [sys.executable, "-m", "llmserve.cli"]
    )
    gateway = subprocess.Popen(
        [*command, "gateway", "--host", "127.0.0.1", "--port", str(grpc_port),
         "--http-port", str(http_port), "--scheduler", scheduler.address,
         "--model", "smollm2", "--log-level", "WARNING"],
        stdout=(log_dir / "gateway.log").open("ab"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    result: dict[str, Any] = {
        "machine": describe(),
        "step_time": {"fixed_ms": args.fixed_ms, "per_token_ms": args.per_token_ms},
        "endpoint": args.endpoint,
        "stream_interval": args.stream_interval,
        "runs": [],
    }
    try:
        scheduler.wait_ready(1)
        wait_healthy(gateway, f"http://127.0.0.1:{http_port}/health", 120)
        asyncio.run(closed_loop(http_port, 4, 8, args))  # warm-up: tokenizer, first steps
        for streams in args.streams:
            pids = {"gateway": gateway.pid, "scheduler": scheduler.popen.pid,
                    "worker": workers.pid}  # fmt: skip
            workers.stats()
            cpu0 = {name: cpu_s(pid) for name, pid in pids.items()}
            own0 = time.process_time()
            steps0 = scheduler.stats().totals.num_steps
            t0 = time.perf_counter()
            tokens = asyncio.run(
                closed_loop(http_port, streams, streams * args.requests_per_stream, args)
            )
            wall = time.perf_counter() - t0
            steps = scheduler.stats().totals.num_steps - steps0
            cpu = {name: cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
            cpu["client"] = time.process_time() - own0
            pooled = workers.stats()
            row = {
                "streams": streams,
                "tokens": tokens,
                "steps": steps,
                "wall_s": round(wall, 2),
                "output_tok_s": round(tokens / wall, 1),
                "tokens_per_step": round(tokens / steps, 1),
                "worker_busy": round(pooled["forward_s"] / wall, 3),
                "worker_steps": pooled["steps"],
                "worker_gap_ms": {k: round(pooled["gap_ms"][k], 2) for k in ("mean", "p50", "p99")},
                "us_per_token": {k: round(v / tokens * 1e6, 1) for k, v in cpu.items()},
                "ms_per_step": {
                    k: round(cpu[k] / steps * 1e3, 3) for k in ("gateway", "scheduler")
                },
                "cores": {k: round(v / wall, 2) for k, v in cpu.items()},
            }
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop(gateway)
        workers.stop()
        scheduler.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="completions: token-id prompts; chat: a user message of --input-len words",
    )
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--fixed-ms", type=float, default=2.5)
    p.add_argument("--per-token-ms", type=float, default=0.0085)
    p.add_argument(
        "--stream-interval", type=int, default=1, help="the scheduler's --stream-interval"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile-dir", type=Path, default=None)
    p.add_argument(
        "--sample",
        action="store_true",
        help="with --profile-dir: sample the stacks instead of cProfile (profile_service.py)",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as tmp:
        if args.profile_dir is not None:
            args.profile_dir.mkdir(parents=True, exist_ok=True)
        result = run(args, Path(tmp))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    if args.profile_dir is not None:
        for name in ("gateway", "scheduler"):
            print(f"--- {name}")
            with contextlib.suppress(FileNotFoundError):
                if args.sample:
                    print((args.profile_dir / f"{name}.txt").read_text())
                else:
                    print_profile(args.profile_dir / f"{name}.prof")


if __name__ == "__main__":
    main()
