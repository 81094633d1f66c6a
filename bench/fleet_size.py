"""How large a fleet one scheduler drives: a real scheduler process, N simulated GPU workers in one
helper process (tests/support/simulated_fleet.py: real Worker services and leases, the forward
pass a wait of fixed_ms + per_token_ms * tokens), and a closed-loop client on the scheduler's
Connect stream (what a gateway sends) keeping `seqs-per-worker` x N requests in flight.

For each fleet size and sequences per worker, over a measured window after a warm-up:
- scheduler CPU per step: utime + stime of the scheduler process (/proc/<pid>/stat) over the
  steps of every replica (GetStats totals), and the cores it used; per token the workers
  sampled, and the tokens per step (a replica's steps fill only as fast as requests reach it);
- worker gap: from the end of a simulated forward pass to the start of the next one on the
  same worker, measured inside the simulated worker (what the scheduler adds to each step);
- busy: the simulated forward time over N x window (1.0 = GPUs never wait);
- output tokens/s at the client against the simulated ideal: each worker running steps of
  `seqs` sequences back to back, each step one token per sequence plus its share of the
  prompts (fixed_ms + per_token_ms * seqs * (1 + prompt_len / max_tokens));
- TTFT p50 / p99 of the requests sent in the window, at the client, and p99 as the scheduler
  measures it from the request's arrival at its router: the difference is time in the Connect
  stream's queues (either way), which a saturated scheduler loop serves late.

On a small machine the helper process and the client share cores with the scheduler: their CPU
is reported too. The scheduler's CPU per step is the figure that carries over to a real fleet.

    .venv/bin/python bench/fleet_size.py --workers 1 4 16 --seqs 32 --out bench/results/fleet-size.json

With `--shards K`, K scheduler processes each drive N/K of the workers (worker i registers with
shard i mod K) and take an equal share of the requests on a client stream of their own: the
scheduler figures are summed over the shards, and `sched_cores_max` is the busiest one's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.connect_driver import ConnectDriver, Tracked  # noqa: E402
from tests.support.simulated_fleet import (  # noqa: E402
    SchedulerProcess,
    SimulatedFleetProcess,
    start_scheduler,
)
from tests.support.simulated_worker import StepTimeModel  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def closed_loop(
    schedulers: list[SchedulerProcess],
    workers: SimulatedFleetProcess,
    args: argparse.Namespace,
    n: int,
    seqs: int,
) -> dict:  # type: ignore[type-arg]
    """Keep n x seqs requests in flight, an equal share on each shard (as its workers are);
    measure over the window after the warm-up."""
    rng = random.Random(args.seed)
    submitted = 0
    submitting = True
    drivers: list[ConnectDriver] = []

    def submit(shard: int) -> None:
        nonlocal submitted
        prompt = [rng.randrange(1, 100000) for _ in range(args.prompt_len)]
        max_tokens = rng.randint(args.max_tokens // 2, args.max_tokens * 3 // 2)
        drivers[shard].submit(
            f"r{submitted}", prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
        )
        submitted += 1

    def on_done_of(shard: int) -> Callable[[Tracked], None]:
        def on_done(tracked: Tracked) -> None:
            if tracked.error is not None:
                errors.append(tracked.error)
            if submitting and submitted < args.max_requests:
                submit(shard)

        return on_done

    def sched_cpu() -> list[float]:
        return [cpu_s(s.popen.pid) for s in schedulers]

    def tokens() -> int:
        return sum(d.num_tokens for d in drivers)

    errors: list[str] = []
    async with contextlib.AsyncExitStack() as stack:
        for shard, scheduler in enumerate(schedulers):
            drivers.append(
                await stack.enter_async_context(
                    ConnectDriver(scheduler.address, on_done_of(shard), keep_tokens=False)
                )
            )
        for i in range(n * seqs):
            submit(i % len(schedulers))
        await asyncio.sleep(args.warmup_s)
        workers.stats()  # counting starts now
        t0, sched0 = time.perf_counter(), sched_cpu()
        steps0 = sum(s.stats().totals.num_steps for s in schedulers)
        tokens0, helper0, own0 = tokens(), cpu_s(workers.pid), own_cpu_s()
        await asyncio.sleep(args.duration_s)
        t1, sched1 = time.perf_counter(), sched_cpu()
        all_stats = [s.stats() for s in schedulers]
        tokens1, helper1, own1 = tokens(), cpu_s(workers.pid), own_cpu_s()
        submitted_in_window_end = sum(not r.done for d in drivers for r in d.requests.values())
        pooled = workers.stats()
        submitting = False
        # Cleanup, not measurement: a fleet far past the scheduler's capacity may not finish
        # its requests in the drain timeout; the row says how many were cut.
        cut = 0
        for driver in drivers:
            try:
                await driver.wait_all(timeout_s=args.drain_timeout_s)
            except TimeoutError:
                cut += sum(not r.done for r in driver.requests.values())
        requests = [r for d in drivers for r in d.requests.values()]
    window = t1 - t0
    steps = sum(s.totals.num_steps for s in all_stats) - steps0
    sched_s = [b - a for a, b in zip(sched0, sched1, strict=True)]
    sched_total = sum(sched_s)
    ttfts = [(r.first_token - r.sent) * 1000 for r in requests
             if t0 <= r.sent <= t1 and r.first_token is not None]  # fmt: skip
    sched_ttfts = [r.scheduler_first_token_ns / 1e6 for r in requests
                   if t0 <= r.sent <= t1 and r.scheduler_first_token_ns is not None]  # fmt: skip
    step_time = StepTimeModel(args.fixed_ms, args.per_token_ms)
    ideal_step_s = step_time.step_s(round(seqs * (1 + args.prompt_len / args.max_tokens)))
    ideal = n * seqs / ideal_step_s
    tok_s = (tokens1 - tokens0) / window
    gap = pooled["gap_ms"]
    sampled = pooled["tokens_sampled"]
    replicas = [r for s in all_stats for r in s.replicas]
    return {
        "workers": n,
        "seqs_per_worker": seqs,
        "shards": len(schedulers),
        "window_s": round(window, 2),
        "requests": len(requests),
        "errors": len(errors),
        "steps_per_s": round(steps / window, 1),
        "sched_cpu_ms_per_step": round(sched_total / steps * 1000, 3) if steps else None,
        # Over every shard, and the busiest shard's alone.
        "sched_cores": round(sched_total / window, 2),
        "sched_cores_max": round(max(sched_s) / window, 2),
        # Per token the workers sampled in the window (what the schedulers had to process).
        "sched_cpu_us_per_token": round(sched_total / sampled * 1e6, 1) if sampled else None,
        "tokens_per_step": round(sampled / steps, 1) if steps else None,
        "worker_gap_ms_mean": round(gap["mean"], 3),
        "worker_gap_ms_p50": round(gap["p50"], 3),
        "worker_gap_ms_p99": round(gap["p99"], 3),
        "busy": round(pooled["forward_s"] / (n * window), 3),
        "sleep_overshoot_ms": round(pooled["overshoot_s"] / max(pooled["steps"], 1) * 1000, 3),
        "output_tok_s": round(tok_s, 1),
        "ideal_tok_s": round(ideal, 1),
        "of_ideal": round(tok_s / ideal, 3),
        "ttft_ms_p50": round(percentile(ttfts, 0.5), 1),
        "ttft_ms_p99": round(percentile(ttfts, 0.99), 1),
        # Measured by the scheduler from the request's arrival there: the difference from the
        # client's is the Connect stream's queues (either way) and the client's own time.
        "sched_ttft_ms_p50": round(percentile(sched_ttfts, 0.5), 1),
        "sched_ttft_ms_p99": round(percentile(sched_ttfts, 0.99), 1),
        "helper_cores": round((helper1 - helper0) / window, 2),
        "client_cores": round((own1 - own0) / window, 2),
        "preemptions": sum(s.totals.num_preemptions for s in all_stats),
        # At the window's end: requests the schedulers hold, and where (all replicas).
        "sched_unfinished": sum(s.num_unfinished_requests for s in all_stats),
        "sched_running": sum(r.num_running for r in replicas),
        "sched_waiting": sum(r.num_waiting for r in replicas),
        "client_in_flight": submitted_in_window_end,
        "cut_after_drain_timeout": cut,
    }


def print_profile(path: Path, limit: int = 25) -> None:
    import pstats

    print(f"-- {path.name}: top {limit} by own time (the event loop's thread)")
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(limit)


def run_one(args: argparse.Namespace, n: int, seqs: int, shards: int, root: Path) -> dict:  # type: ignore[type-arg]
    log_dir = root / f"n{n}-s{seqs}-k{shards}"
    log_dir.mkdir(parents=True)
    schedulers: list[SchedulerProcess] = []
    workers = None
    try:
        for shard in range(shards):
            launcher = None
            if args.profile_dir is not None:
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                out = args.profile_dir / f"scheduler-n{n}-s{seqs}-k{shards}-{shard}.prof"
                launcher = [sys.executable, str(Path(__file__).parent / "profile_service.py"),
                            str(out)]  # fmt: skip
            schedulers.append(start_scheduler(
                log_dir / f"scheduler-{shard}.log",
                ["--max-num-seqs", str(max(seqs, 256)),
                 "--max-waiting-requests", str(2 * n * seqs + 64),
                 "--log-level", args.scheduler_log_level],
                launcher,
            ))  # fmt: skip
        workers = SimulatedFleetProcess(
            ",".join(s.address for s in schedulers), n, log_dir / "workers.log",
            StepTimeModel(args.fixed_ms, args.per_token_ms),
            ["--num-gpu-blocks", str(args.num_gpu_blocks), "--log-level", "WARNING"],
        )  # fmt: skip
        for shard, scheduler in enumerate(schedulers):
            scheduler.wait_ready(len(range(shard, n, shards)))
        return asyncio.run(closed_loop(schedulers, workers, args, n, seqs))
    finally:
        for scheduler in schedulers:
            scheduler.stop()
        if workers is not None:
            workers.stop()


COLUMNS = [
    ("workers", "N"), ("seqs_per_worker", "seqs"), ("shards", "shards"),
    ("sched_cpu_ms_per_step", "sched ms/step"),
    ("tokens_per_step", "tokens/step"), ("sched_cpu_us_per_token", "sched us/token"),
    ("sched_cores", "sched cores"), ("sched_cores_max", "busiest shard cores"),
    ("worker_gap_ms_mean", "gap mean ms"),
    ("worker_gap_ms_p99", "gap p99 ms"), ("busy", "busy"), ("output_tok_s", "tok/s"),
    ("ideal_tok_s", "ideal tok/s"), ("of_ideal", "of ideal"), ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"), ("sched_ttft_ms_p99", "sched TTFT p99 ms"),
    ("helper_cores", "workers' cores"), ("client_cores", "client cores"),
]  # fmt: skip


def table(rows: list[dict]) -> str:  # type: ignore[type-arg]
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--seqs", type=int, nargs="+", default=[32], help="sequences per worker")
    p.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=[1],
        help="scheduler shards, each a process with an equal share of the workers and of the "
        "requests (one client stream each)",
    )
    p.add_argument("--fixed-ms", type=float, default=StepTimeModel().fixed_ms)
    p.add_argument("--per-token-ms", type=float, default=StepTimeModel().per_token_ms)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="mean; each request draws from [max/2, 3 max/2] so they end apart",
    )
    p.add_argument("--num-gpu-blocks", type=int, default=8192, help="per simulated worker")
    p.add_argument("--warmup-s", type=float, default=4.0)
    p.add_argument("--duration-s", type=float, default=10.0, help="the measured window")
    p.add_argument("--drain-timeout-s", type=float, default=120.0)
    p.add_argument("--max-requests", type=int, default=200_000, help="per configuration")
    p.add_argument("--scheduler-log-level", default="INFO")
    p.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="run the scheduler under cProfile, one .prof file per configuration",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-dir", type=Path, default=None, help="keep the services' logs here (default: none)"
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    print(
        f"{os.cpu_count()} CPU cores: the scheduler, the simulated workers' process and the "
        "client share them; the scheduler's CPU per step is the portable figure",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmserve-fleet-size-") as tmp:
        logs = args.log_dir or Path(tmp)
        for seqs in args.seqs:
            for n in args.workers:
                for shards in args.shards:
                    row = run_one(args, n, seqs, shards, logs)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if args.profile_dir is not None:
                        print_profile(args.profile_dir / f"scheduler-n{n}-s{seqs}-k{shards}-0.prof")
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu_count": os.cpu_count(),
                  "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
