"""Fleet benchmark on two worker replicas: routing policies, and the pause a kill causes.

1. Routing. A prefix-heavy workload (a few long shared system prompts, many short questions)
   runs once per policy (cache_aware, least_loaded, round_robin), each on a fresh stack so no
   policy inherits another's cache. Reported: prefix-cache hit rate (hit blocks / looked-up
   blocks, from the scheduler's GetStats), output tokens/s and p50 TTFT at the client.
2. Kill pause. Streaming greedy requests run on two workers; one worker gets SIGKILL
   mid-generation. For every stream the scheduler moved (its "request migrated" log lines),
   the time from the kill to that stream's next token; p50 and p99.

    .venv/bin/python bench/fleet.py --model smollm2 --dtype float32 --out bench/results/fleet.json

Streams go through the gateway's gRPC API with token-id prompts, so no tokenizer is needed.
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
from tests.support.fleet import FleetStack, start_fleet  # noqa: E402


def prefix_workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(100, 40000) for _ in range(args.system_len)] for _ in range(args.systems)
    ]
    return [
        rng.choice(systems) + [rng.randrange(100, 40000) for _ in range(args.question_len)]
        for _ in range(args.requests)
    ]


async def stream_all(
    gateway: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    on_token=None,  # type: ignore[no-untyped-def]
) -> dict[str, dict]:  # type: ignore[type-arg]
    """Per request id: arrival, token times, token count."""
    results: dict[str, dict] = {}  # type: ignore[type-arg]
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(gateway, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(i: int, prompt: list[int]) -> None:
            request_id = f"bench-{i}"
            async with gate:
                record = results[request_id] = {"start": time.perf_counter(), "times": []}
                request = build_request(
                    prompt,
                    request_id=request_id,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                )
                async for response in stub.Generate(request, timeout=600):
                    now = time.perf_counter()
                    for choice in response.choices:
                        record["times"].extend([now] * len(choice.token_ids))
                    if on_token is not None:
                        on_token()

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return results


def start(args: argparse.Namespace, routing: str, log_dir: Path) -> FleetStack:
    return start_fleet(
        args.model,
        log_dir,
        2,
        scheduler_args=["--routing", routing, "--max-num-seqs", str(args.concurrency)],
        worker_args=["--dtype", args.dtype, "--kv-cache-memory", "0.5", "--num-threads", "1"],
    )


def routing_run(args: argparse.Namespace, routing: str, root: Path) -> dict:  # type: ignore[type-arg]
    stack = start(args, routing, root / routing)
    try:
        prompts = prefix_workload(args)
        began = time.perf_counter()
        results = asyncio.run(
            stream_all(stack.gateway.address, prompts, args.max_tokens, args.concurrency)  # type: ignore[union-attr]
        )
        elapsed = time.perf_counter() - began
        stats = stack.stats()
    finally:
        stack.stop()
    tokens = sum(len(r["times"]) for r in results.values())
    ttfts = [r["times"][0] - r["start"] for r in results.values() if r["times"]]
    queries = sum(r.prefix_cache_queries for r in stats.replicas)
    hits = sum(r.prefix_cache_hits for r in stats.replicas)
    return {
        "routing": routing,
        "requests": len(results),
        "output_tokens": tokens,
        "seconds": round(elapsed, 2),
        "output_tok_s": round(tokens / elapsed, 1),
        "p50_ttft_s": round(statistics.median(ttfts), 3),
        "prefix_hit_rate": round(hits / queries, 3) if queries else 0.0,
        "per_replica_steps": [r.num_steps for r in stats.replicas],
    }


def kill_run(args: argparse.Namespace, root: Path) -> dict:  # type: ignore[type-arg]
    stack = start(args, "cache_aware", root / "kill")
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(args.kill_streams)]
    killed: list[float] = []
    seen = 0

    def on_token() -> None:
        nonlocal seen
        seen += 1
        if not killed and seen >= args.kill_streams * args.kill_after_tokens:
            killed.append(time.perf_counter())
            stack.workers[0].kill()

    try:
        results = asyncio.run(
            stream_all(
                stack.gateway.address,
                prompts,
                args.kill_max_tokens,
                args.kill_streams,  # type: ignore[union-attr]
                on_token,
            )
        )
        log = stack.scheduler.log.read_text()  # type: ignore[union-attr]
    finally:
        stack.stop()
    moved = set()
    for line in log.splitlines():
        if '"request migrated"' in line:
            moved.add(json.loads(line)["request"].split("/", 1)[1])
    pauses = sorted(
        next(t for t in results[rid]["times"] if t > killed[0]) - killed[0]
        for rid in moved
        if any(t > killed[0] for t in results[rid]["times"])
    )
    complete = sum(len(r["times"]) == args.kill_max_tokens for r in results.values())
    return {
        "streams": len(results),
        "complete": complete,
        "moved": len(moved),
        "pause_p50_s": round(statistics.median(pauses), 3) if pauses else None,
        "pause_p99_s": round(pauses[min(len(pauses) - 1, int(0.99 * len(pauses)))], 3)
        if pauses
        else None,
        "pause_max_s": round(pauses[-1], 3) if pauses else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-streams", type=int, default=16)
    p.add_argument("--kill-max-tokens", type=int, default=64)
    p.add_argument(
        "--kill-after-tokens",
        type=int,
        default=16,
        help="kill once this many tokens per stream (on average) have arrived",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report: dict = {"args": vars(args) | {"out": str(args.out)}}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="llmserve-fleet-bench-") as tmp:
        root = Path(tmp)
        if not args.skip_routing:
            report["routing"] = [
                routing_run(args, policy, root)
                for policy in ("cache_aware", "least_loaded", "round_robin")
            ]
            for row in report["routing"]:
                print(json.dumps(row))
        report["kill"] = kill_run(args, root)
        print(json.dumps(report["kill"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
