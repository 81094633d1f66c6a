"""Drain pause per moved stream: recompute vs stop-and-copy vs pre-copy (issue #29).

One stack per (context, mode, rate cap): a scheduler, a gateway and one worker (the source) on
`--model`; a spare worker joins (registered, warmed up) after the source has cached the prompt of
`context` tokens, so the stream of that prompt runs on the source; once it has some tokens the
source is drained (`--drain-migration MODE`; recompute runs
with `--drain-grace-s 0`, so every running stream moves at once in every mode). A stream's
pause is its longest gap between tokens from the drain on; its usual gap (median before the
drain) is reported beside it. The source's KV sends can be capped (`--kv-send-rate-gbs`) to
stand for slower networks; the link's measured rate is the spare's imported bytes over its
import seconds (worker metrics).

    .venv/bin/python bench/drain_pause.py --contexts 256 1024 2048 --caps 0 0.1 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.fleet import stream_all  # noqa: E402
from llmserve.client import build_request  # noqa: E402
from llmserve.v1 import generation_pb2_grpc  # noqa: E402
from tests.support.fleet import FleetStack, Proc, spare_worker, start_fleet  # noqa: E402


def metric(proc: Proc, name: str) -> float:
    port = proc.args[proc.args.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def generate(stack: FleetStack, prompt: list[int], max_tokens: int) -> None:
    with grpc.insecure_channel(stack.gateway.address) as channel:  # type: ignore[union-attr]
        request = build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300):
            pass


def warm_up(stack: FleetStack) -> None:
    """A few short requests through the gateway, which places them on the idle spare."""
    rng = random.Random(1)
    for _ in range(3):
        generate(stack, [rng.randrange(100, 40000) for _ in range(64)], 4)


def one_run(args: argparse.Namespace, context: int, mode: str, cap: float, root: Path) -> dict:  # type: ignore[type-arg]
    scheduler_args = ["--max-num-seqs", "16", "--drain-migration", mode]
    if mode == "recompute":
        scheduler_args += ["--drain-grace-s", "0"]
    worker_args = ["--dtype", args.dtype, "--kv-cache-memory", "1.0", "--num-threads", "1"]
    stack: FleetStack = start_fleet(
        args.model, root / f"{context}-{mode}-{cap}", 1, scheduler_args=scheduler_args,
        worker_args=worker_args + ["--kv-send-rate-gbs", str(cap)],
    )  # fmt: skip
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(context)]]
    drained: list[float] = []
    seen = 0
    try:
        spare = spare_worker(stack, "spare")
        source = stack.workers[0].address
        # The prompt's blocks cached on the source, so that routing puts the stream there
        # once the spare is in the fleet (and warmed up: a worker's first steps are slow).
        generate(stack, prompts[0], 1)
        stack.lease(spare.address)
        stack.wait_for(lambda s: len(stack.ready_replicas(s)) == 2, "the spare ready")
        warm_up(stack)
        mover = threading.Thread(target=lambda: (drained.append(time.perf_counter()),
                                                 stack.drain(source)))  # fmt: skip

        def on_token() -> None:
            nonlocal seen
            seen += 1
            if seen == args.drain_after_tokens:
                mover.start()

        results = asyncio.run(
            stream_all(stack.gateway.address, prompts, args.max_tokens, 1, on_token)  # type: ignore[union-attr]
        )
        mover.join()
        on_source = stack.stats()
        imported = metric(spare, "llmserve_worker_kv_import_bytes_total")
        import_s = metric(spare, "llmserve_worker_kv_import_seconds_sum")
    finally:
        stack.stop()
    assert source not in {r.address for r in on_source.replicas}, "the source was drained"
    times = results["bench-0"]["times"]
    before = [b - a for a, b in zip(times, times[1:], strict=False) if b < drained[0]]
    after = [b - a for a, b in zip(times, times[1:], strict=False) if b >= drained[0]]
    return {
        "context": context,
        "mode": mode,
        "cap_gbs": cap or None,
        "link_gbs": round(imported / import_s / 1e9, 3) if import_s else None,
        "mb_moved": round(imported / 1e6, 1),
        "usual_gap_s": round(statistics.median(before), 4) if before else None,
        "pause_s": round(max(after), 3) if after else None,
        "tokens": len(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument(
        "--caps",
        type=float,
        nargs="+",
        default=[0.0, 0.1, 1.0],
        help="KV send-rate caps, GB/s (0: none), for the transfer modes",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drain-after-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="llmserve-drain-bench-") as tmp:
        runs = [("recompute", 0.0)] + [
            (mode, cap) for mode in ("stop-and-copy", "pre-copy") for cap in args.caps
        ]
        for context in args.contexts:
            for mode, cap in runs:
                row = one_run(args, context, mode, cap, Path(tmp))
                report["runs"].append(row)
                print(json.dumps(row), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
