"""2 mixed workers vs 1 prefill + 1 decode worker on equal cores (issue #29).

Steady decodes (`--streams` short prompts, `--stream-tokens` each) run while bursts of long
prompts (`--burst` prompts of `--long-len` tokens, `--long-tokens` each) arrive every
`--burst-every-s`. Reported per configuration: the steady streams' inter-token latency (p50,
p99, max), the long prompts' time to first token (p50, p99), and output tokens per second over
the run. Each worker has `--threads` threads in both configurations; the prefill worker hands
each long request to the decode worker with its KV blocks after its first token, and short
prompts prefill on the decode worker (--prefill-local-below, default 128).

    .venv/bin/python bench/disagg.py --out bench/results/disagg.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmserve.client import build_request  # noqa: E402
from llmserve.grpc_utils import channel_options  # noqa: E402
from llmserve.v1 import generation_pb2_grpc  # noqa: E402
from tests.support.fleet import start_fleet  # noqa: E402

CONFIGS = {
    "2 mixed": [[], []],
    "1 prefill + 1 decode": [["--role", "prefill"], ["--role", "decode"]],
}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def workload(gateway: str, args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    rng = random.Random(args.seed)
    steady = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(args.streams)]
    bursts = [
        [[rng.randrange(100, 40000) for _ in range(args.long_len)] for _ in range(args.burst)]
        for _ in range(args.bursts)
    ]
    times: dict[str, list[float]] = {}
    starts: dict[str, float] = {}
    async with grpc.aio.insecure_channel(gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(key: str, prompt: list[int], max_tokens: int, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            starts[key] = time.perf_counter()
            got = times[key] = []
            request = build_request(prompt, request_id=key, max_tokens=max_tokens,
                                    temperature=0.0, ignore_eos=True)  # fmt: skip
            async for response in stub.Generate(request, timeout=900):
                now = time.perf_counter()
                for choice in response.choices:
                    got.extend([now] * len(choice.token_ids))

        began = time.perf_counter()
        tasks = [one(f"steady-{i}", p, args.stream_tokens, 0.0) for i, p in enumerate(steady)]
        for b, burst in enumerate(bursts):
            delay = args.first_burst_s + b * args.burst_every_s
            tasks += [one(f"long-{b}-{i}", p, args.long_tokens, delay) for i, p in enumerate(burst)]
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - began
    gaps = [
        b - a
        for key, ts in times.items()
        if key.startswith("steady")
        for a, b in zip(ts, ts[1:], strict=False)
    ]
    ttfts = [times[k][0] - starts[k] for k in times if k.startswith("long") and times[k]]
    tokens = sum(len(ts) for ts in times.values())
    return {
        "itl_p50_s": round(statistics.median(gaps), 4),
        "itl_p99_s": round(pct(gaps, 0.99), 4),
        "itl_max_s": round(max(gaps), 3),
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(pct(ttfts, 0.99), 3),
        "output_tok_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1, help="per worker")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=192)
    p.add_argument("--burst", type=int, default=2)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=16)
    p.add_argument("--first-burst-s", type=float, default=1.0)
    p.add_argument("--burst-every-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}  # type: ignore[type-arg]
    worker_args = ["--dtype", "float32", "--kv-cache-memory", "1.0",
                   "--num-threads", str(args.threads)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="llmserve-disagg-bench-") as tmp:
        for name, per_worker in CONFIGS.items():
            stack = start_fleet(
                args.model, Path(tmp) / name.replace(" ", "-"), 2,
                scheduler_args=["--max-num-seqs", "32"], worker_args=worker_args,
                per_worker_args=per_worker,
            )  # fmt: skip
            try:
                row = {"config": name, **asyncio.run(workload(stack.gateway.address, args))}  # type: ignore[union-attr]
            finally:
                stack.stop()
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
