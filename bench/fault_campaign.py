"""A long fault campaign (issue #54): the stack of tests/support/campaign.py (two shards, four
workers, two gateways, the tiny model) under faults drawn from `--seed` for `--minutes`, every
stream checked against its undisturbed run. Prints the faults by kind, the requests checked,
the differing outputs, the failures, and per fault kind the pause of the streams in flight
when it fired (p50/p99 of the time from a stream's last response before the fault to its
first after), with the machine named; `--out` writes the same as JSON.

    .venv/bin/python bench/fault_campaign.py --seed 7 --minutes 10 --out bench/results/campaign.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from tests.integration.test_fault_campaign import validate  # noqa: E402
from tests.support.campaign import start_campaign_stack  # noqa: E402
from tests.support.campaign_checks import run_campaign  # noqa: E402
from tests.support.models import build_tiny_llama  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--faults-per-round", type=int, default=6)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--log-dir", type=Path, help="where the services' logs go (default: a new temporary one)"
    )
    args = parser.parse_args()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    print(f"logs: {log_dir}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(Path(tmp) / "model")
        stack = start_campaign_stack(str(model), log_dir)
        started = time.monotonic()
        try:
            report = run_campaign(
                stack,
                args.seed,
                until=started + 60 * args.minutes,
                faults_per_round=args.faults_per_round,
                validate=validate,
            )
        finally:
            elapsed = time.monotonic() - started
            stack.stop()
    summary = {
        "machine": describe(),
        "seed": args.seed,
        "minutes": round(elapsed / 60, 1),
        "rounds": report.rounds,
        "faults": report.faults,
        "requests_checked": report.requests_checked,
        "differing": report.differing,
        "cancelled": report.cancelled,
        "retried_after_gateway_loss": report.retried,
        "gateway_loss_codes": report.lost_codes,
        "resent_after_refusal": report.resent_after_refusal,
        "burst_refused": report.refused,
        "burst_served": report.bursts_served,
        "pause_s": {
            kind: {"streams": len(v), "p50": percentile(v, 0.5), "p99": percentile(v, 0.99)}
            for kind, v in sorted(report.pauses.items())
            if v
        },
        "failures": report.failures,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
