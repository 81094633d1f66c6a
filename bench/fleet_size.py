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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import tempfile
import time
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
    scheduler: SchedulerProcess,
    workers: SimulatedFleetProcess,
    args: argparse.Namespace,
    n: int,
    seqs: int,
) -> dict:  # type: ignore[type-arg]
    """Keep n x seqs requests in flight; measure over the window after the warm-up."""
    rng = random.Random(args.seed)
    concurrency = n * seqs
    submitted = 0
    submitting = True
    driver: ConnectDriver

    def submit() -> None:
        nonlocal submitted
        prompt = [rng.randrange(1, 100000) for _ in range(args.prompt_len)]
        max_tokens = rng.randint(args.max_tokens // 2, args.max_tokens * 3 // 2)
        driver.submit(
            f"r{submitted}", prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0
        )
        submitted += 1

    def on_done(tracked: Tracked) -> None:
        if tracked.error is not None:
            errors.append(tracked.error)
        if submitting and submitted < args.max_requests:
            submit()

    errors: list[str] = []
    async with ConnectDriver(scheduler.address, on_done, keep_tokens=False) as driver:
        for _ in range(concurrency):
            submit()
        await asyncio.sleep(args.warmup_s)
        workers.stats()  # counting starts now
        t0, sched0 = time.perf_counter(), cpu_s(scheduler.popen.pid)
        steps0 = scheduler.stats().totals.num_steps
        tokens0, helper0, own0 = driver.num_tokens, cpu_s(workers.pid), own_cpu_s()
        await asyncio.sleep(args.duration_s)
        t1, sched1 = time.perf_counter(), cpu_s(scheduler.popen.pid)
        stats = scheduler.stats()
        tokens1, helper1, own1 = driver.num_tokens, cpu_s(workers.pid), own_cpu_s()
        submitted_in_window_end = sum(not r.done for r in driver.requests.values())
        pooled = workers.stats()
        submitting = False
        await driver.wait_all(timeout_s=args.drain_timeout_s)
        requests = list(driver.requests.values())
    window = t1 - t0
    steps = stats.totals.num_steps - steps0
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
    return {
        "workers": n,
        "seqs_per_worker": seqs,
        "window_s": round(window, 2),
        "requests": len(requests),
        "errors": len(errors),
        "steps_per_s": round(steps / window, 1),
        "sched_cpu_ms_per_step": round((sched1 - sched0) / steps * 1000, 3) if steps else None,
        "sched_cores": round((sched1 - sched0) / window, 2),
        # Per token the workers sampled in the window (what the scheduler had to process).
        "sched_cpu_us_per_token": round((sched1 - sched0) / sampled * 1e6, 1) if sampled else None,
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
        "preemptions": stats.totals.num_preemptions,
        # At the window's end: requests the scheduler holds, and where (all replicas).
        "sched_unfinished": stats.num_unfinished_requests,
        "sched_running": sum(r.num_running for r in stats.replicas),
        "sched_waiting": sum(r.num_waiting for r in stats.replicas),
        "client_in_flight": submitted_in_window_end,
    }


def print_profile(path: Path, limit: int = 25) -> None:
    import pstats

    print(f"-- {path.name}: top {limit} by own time (the event loop's thread)")
    pstats.Stats(str(path)).sort_stats("tottime").print_stats(limit)


def run_one(args: argparse.Namespace, n: int, seqs: int, root: Path) -> dict:  # type: ignore[type-arg]
    log_dir = root / f"n{n}-s{seqs}"
    log_dir.mkdir(parents=True)
    launcher = None
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        out = args.profile_dir / f"scheduler-n{n}-s{seqs}.prof"
        launcher = [sys.executable, str(Path(__file__).parent / "profile_service.py"), str(out)]
    scheduler = start_scheduler(
        log_dir / "scheduler.log",
        ["--max-num-seqs", str(max(seqs, 256)), "--max-waiting-requests", str(2 * n * seqs + 64),
         "--log-level", args.scheduler_log_level],
        launcher,
    )  # fmt: skip
    workers = None
    try:
        workers = SimulatedFleetProcess(
            scheduler.address, n, log_dir / "workers.log",
            StepTimeModel(args.fixed_ms, args.per_token_ms),
            ["--num-gpu-blocks", str(args.num_gpu_blocks), "--log-level", "WARNING"],
        )  # fmt: skip
        scheduler.wait_ready(n)
        return asyncio.run(closed_loop(scheduler, workers, args, n, seqs))
    finally:
        scheduler.stop()
        if workers is not None:
            workers.stop()


COLUMNS = [
    ("workers", "N"), ("seqs_per_worker", "seqs"), ("sched_cpu_ms_per_step", "sched ms/step"),
    ("tokens_per_step", "tokens/step"), ("sched_cpu_us_per_token", "sched us/token"),
    ("sched_cores", "sched cores"), ("worker_gap_ms_mean", "gap mean ms"),
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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    print(
        f"{os.cpu_count()} CPU cores: the scheduler, the simulated workers' process and the "
        "client share them; the scheduler's CPU per step is the portable figure",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="llmserve-fleet-size-") as tmp:
        for seqs in args.seqs:
            for n in args.workers:
                row = run_one(args, n, seqs, Path(tmp))
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.profile_dir is not None:
                    print_profile(args.profile_dir / f"scheduler-n{n}-s{seqs}.prof")
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu_count": os.cpu_count(),
                  "rows": rows}  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
