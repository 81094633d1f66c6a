"""TTFT of prompts that arrive while one stream decodes, with multi-step decoding on or off:
what a step's passes cost a prompt that has to wait for them.

A real gateway and scheduler and one simulated worker (tests/support/simulated_worker.py:
the real Worker service, each forward pass a wait of `--pass-ms` + 0.0085 ms a token, the
multi-step passes included). One background stream decodes throughout; `--probes` requests
of 128 prompt tokens and one output token arrive one at a time, 50-150 ms apart, and each
one's time to its first streamed token is taken at the client, as is the background stream's
output rate while they arrive (tokens counted from its logprobs).

    .venv/bin/python bench/multi_step_ttft.py --decode-steps 8 1 --rounds 3

Each round runs every `--decode-steps` value once, in order, then the next round in reverse
order; the report gives each value's median TTFT per round and the median over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import describe  # noqa: E402
from server_runs import stop, wait_healthy  # noqa: E402

from llmserve.ports import free_ports  # noqa: E402
from tests.support.simulated_fleet import SimulatedFleetProcess, start_scheduler  # noqa: E402
from tests.support.simulated_worker import StepTimeModel  # noqa: E402

VOCAB = 49152  # SmolLM2's: the gateway detokenizes the simulated samples with its tokenizer
PER_TOKEN_MS = 0.0085


async def stream(
    port: int, body: dict[str, Any], first_only: bool, tokens: list[float] | None = None
) -> float:
    """One streaming completion; the seconds to its first token (read to the end unless
    `first_only`). With `tokens` (the body asks for logprobs), a perf_counter time is
    appended for each token as its chunk arrives."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    writer.write(head + data)
    first = None
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"gateway answered {status!r}")
        async for line in reader:
            if tokens is not None and line.startswith(b"data: {"):
                now = time.perf_counter()
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend([now] * len(choice["logprobs"]["tokens"]))
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - start
                if first_only:
                    break
            if line.startswith(b"data: [DONE]"):
                break
    finally:
        writer.close()
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


async def probe(port: int, probes: int, seed: int) -> tuple[list[float], float]:
    """The probes' TTFTs, and the background stream's tokens/s while they arrived."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, VOCAB) for _ in range(n)]

    token_times: list[float] = []
    background = asyncio.ensure_future(
        stream(
            port,
            {"model": "smollm2", "prompt": prompt(16), "max_tokens": 4000, "ignore_eos": True,
             "stream": True, "logprobs": 0},
            first_only=False,
            tokens=token_times,
        )
    )  # fmt: skip
    await asyncio.sleep(1.0)  # decoding in steady state
    ttfts = []
    start = time.perf_counter()
    for _ in range(probes):
        await asyncio.sleep(rng.uniform(0.05, 0.15))
        body = {"model": "smollm2", "prompt": prompt(128), "max_tokens": 1, "stream": True}
        ttfts.append(await stream(port, body, first_only=True))
    end = time.perf_counter()
    if background.done():
        raise RuntimeError("the background stream ended before the probes")
    background.cancel()
    during = sum(start <= t <= end for t in token_times)
    return ttfts, during / (end - start)


def run_once(
    decode_steps: int, args: argparse.Namespace, log_dir: Path
) -> tuple[list[float], float]:
    scheduler = start_scheduler(
        log_dir / "scheduler.log",
        ["--decode-steps", str(decode_steps), "--log-level", "WARNING"],
    )
    workers = SimulatedFleetProcess(
        scheduler.address, 1, log_dir / "worker.log", StepTimeModel(args.pass_ms, PER_TOKEN_MS),
        ["--vocab-size", str(VOCAB), "--log-level", "WARNING"],
    )  # fmt: skip
    grpc_port, http_port = free_ports(2)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "gateway", "--host", "127.0.0.1",
         "--port", str(grpc_port), "--http-port", str(http_port),
         "--scheduler", scheduler.address, "--model", "smollm2", "--log-level", "WARNING"],
        stdout=(log_dir / "gateway.log").open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        scheduler.wait_ready(1)
        wait_healthy(gateway, f"http://127.0.0.1:{http_port}/health", 120)
        return asyncio.run(probe(http_port, args.probes, args.seed))
    finally:
        stop(gateway)
        workers.stop()
        scheduler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode-steps", type=int, nargs="+", default=[8, 1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probes", type=int, default=40)
    p.add_argument("--pass-ms", type=float, default=3.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    medians: dict[int, list[float]] = {n: [] for n in args.decode_steps}
    rates: dict[int, list[float]] = {n: [] for n in args.decode_steps}
    rows = []
    for r in range(args.rounds):
        order = args.decode_steps if r % 2 == 0 else list(reversed(args.decode_steps))
        for n in order:
            with tempfile.TemporaryDirectory(prefix="multi-step-ttft-") as tmp:
                ttfts, rate = run_once(n, args, Path(tmp))
            ms = sorted(t * 1e3 for t in ttfts)
            row = {"round": r + 1, "decode_steps": n, "median_ms": round(statistics.median(ms), 1),
                   "p90_ms": round(ms[int(0.9 * len(ms))], 1), "min_ms": round(ms[0], 1),
                   "max_ms": round(ms[-1], 1), "background_tok_s": round(rate, 1)}  # fmt: skip
            medians[n].append(row["median_ms"])
            rates[n].append(row["background_tok_s"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {
        n: {
            "median_ms": statistics.median(v),
            "range_ms": [min(v), max(v)],
            "background_tok_s": statistics.median(rates[n]),
            "background_range": [min(rates[n]), max(rates[n])],
        }
        for n, v in medians.items()
    }
    print(json.dumps({"machine": describe(), "pass_ms": args.pass_ms, "ttft": summary}))
    if args.out is not None:
        args.out.write_text(json.dumps({"machine": describe(), "rows": rows, "ttft": summary}))


if __name__ == "__main__":
    main()
