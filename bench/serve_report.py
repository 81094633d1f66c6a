"""What one bench/serve.py run produced, and its summary (JSON) and plot (PNG).

A run can end before every request finished (--max-duration, SIGINT, SIGTERM). Then the
figures stay honest rather than absent: throughput is over the elapsed time and counts every
token streamed in it, finished request or not; TTFT percentiles cover the requests that got a
first token, and the summary says how many did not.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class RequestStatus(StrEnum):
    NOT_SENT = "not_sent"  # the run ended before the request was sent
    IN_FLIGHT = "in_flight"  # sent, and the run ended before its stream did
    FAILED = "failed"
    COMPLETED = "completed"


class StopReason(StrEnum):
    ALL_DONE = "all_done"
    MAX_DURATION = "max_duration"
    SIGINT = "SIGINT"
    SIGTERM = "SIGTERM"


@dataclass(slots=True)
class RequestResult:
    status: RequestStatus = RequestStatus.NOT_SENT
    start: float = 0.0  # perf_counter() when sent
    ttft: float = 0.0  # seconds from start to the first content chunk; 0 if none came
    e2e: float = 0.0  # seconds from start to the end of the stream (completed only)
    # Arrival times of the content chunks after the first, relative to the start.
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    # `usage.completion_tokens` from the stream when the server sent one, else None.
    usage_tokens: int | None = None
    # Where the server put its usage: "usage_without_choices" (its own final chunk, as the
    # OpenAI API and our gateway do) or "usage_with_choices" (beside the last choice, as
    # llama-server does on /v1/completions); "" when none came.
    usage_chunk: str = ""
    output_tokens: int = 0
    # How output_tokens was counted: "usage" (the server's own count) or "retokenized".
    counted_by: str = ""
    error: str = ""

    @property
    def got_first_token(self) -> bool:
        return bool(self.text)


@dataclass(slots=True)
class RunOutcome:
    results: list[RequestResult]
    duration: float  # seconds from the first request sent to the end of the run
    stopped_by: StopReason
    warmup_ok: int
    warmup_sent: int
    # CPU seconds this client used during the measured window: it shares the cores with the
    # server under test when both run on one machine.
    client_cpu_s: float = 0.0


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        # Linear interpolation between closest ranks.
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return (ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)) * scale

    return {
        "mean": sum(ordered) / len(ordered) * scale,
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
    }


def record_usage(result: RequestResult, chunk: dict[str, Any]) -> None:
    """Keep `usage.completion_tokens` from a stream chunk, whichever shape carries it: a chunk
    with no choices (OpenAI's `stream_options.include_usage`), or the last chunk with a choice
    beside it (llama-server). Content chunks with `"usage": null` change nothing."""
    usage = chunk.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        return
    result.usage_tokens = usage["completion_tokens"]
    result.usage_chunk = "usage_with_choices" if chunk.get("choices") else "usage_without_choices"


def count_output_tokens(results: list[RequestResult], tokenizer: Any) -> None:
    """Each request's output tokens: the server's own count where its stream reported usage
    (exact, whatever its detokenizer merged into one chunk), else the streamed text
    re-tokenized with `tokenizer` (a request cut off by the run's end has no usage)."""
    for r in results:
        if r.usage_tokens is not None:
            r.output_tokens, r.counted_by = r.usage_tokens, "usage"
        elif r.text:
            r.output_tokens = len(tokenizer(r.text, add_special_tokens=False)["input_ids"])
            r.counted_by = "retokenized"


def summarize(
    args: argparse.Namespace,
    prompt_tokens: list[int],
    outcome: RunOutcome,
    extras: dict[str, list[str]],
) -> dict[str, Any]:
    """The run's figures; `count_output_tokens` must have run on outcome.results."""
    results, duration = outcome.results, outcome.duration
    by_status = {s: [r for r in results if r.status is s] for s in RequestStatus}
    completed = by_status[RequestStatus.COMPLETED]
    unfinished = by_status[RequestStatus.IN_FLIGHT]
    first = [r for r in results if r.got_first_token]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in completed if r.output_tokens > 1]
    itl = [
        b - a for r in first for a, b in zip([r.ttft, *r.chunk_times], r.chunk_times, strict=False)
    ]
    tokens_completed = sum(r.output_tokens for r in completed)
    tokens_unfinished = sum(r.output_tokens for r in unfinished)
    input_tokens = sum(
        n
        for n, r in zip(prompt_tokens, results, strict=True)
        if r.status is not RequestStatus.NOT_SENT
    )
    per_s = 1.0 / duration if duration else 0.0
    summary = {
        "label": args.label,
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "workload": {
            "num_prompts": len(results),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "random_ratio": args.random_ratio,
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "include_usage": getattr(args, "include_usage", False),
            "extras_sent": extras["sent"],
            "extras_left_out": extras["left_out"],
            "temperature": args.temperature,
            "warmup_requests": args.warmup,
        },
        "warmup_ok": f"{outcome.warmup_ok}/{outcome.warmup_sent}",
        "stopped_by": str(outcome.stopped_by),
        "max_duration_s": args.max_duration or None,
        "duration_s": duration,
        "client_cpu_s": outcome.client_cpu_s,
        "completed": len(completed),
        "failed": len(by_status[RequestStatus.FAILED]),
        "unfinished": len(unfinished),
        "not_sent": len(by_status[RequestStatus.NOT_SENT]),
        "with_first_token": len(first),
        "without_first_token": len(results) - len(first),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens_counted_by": {
            way: sum(r.counted_by == way for r in results) for way in ("usage", "retokenized")
        },
        "usage_chunks": {
            shape: sum(r.usage_chunk == shape for r in results)
            for shape in ("usage_without_choices", "usage_with_choices")
        },
        "total_input_tokens": input_tokens,
        "total_output_tokens": tokens_completed + tokens_unfinished,
        "output_tokens_completed": tokens_completed,
        "output_tokens_unfinished": tokens_unfinished,
        "request_throughput": len(completed) * per_s,
        "output_tokens_per_s": (tokens_completed + tokens_unfinished) * per_s,
        "ttft_ms": percentiles([r.ttft for r in first]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e for r in completed]),
    }
    summary["notes"] = notes(summary)
    return summary


def notes(s: dict[str, Any]) -> list[str]:
    """Plain-language caveats a reader of the figures must not miss."""
    out = []
    if s["stopped_by"] != StopReason.ALL_DONE:
        out.append(
            f"run stopped by {s['stopped_by']} after {s['duration_s']:.1f} s: "
            f"{s['completed']} completed, {s['failed']} failed, {s['unfinished']} unfinished "
            f"(their {s['output_tokens_unfinished']} streamed tokens count in output tokens/s), "
            f"{s['not_sent']} not sent"
        )
    if s["without_first_token"]:
        out.append(
            f"TTFT percentiles cover the {s['with_first_token']} requests that got a first "
            f"token; {s['without_first_token']} did not (their TTFT is longer than measured)"
        )
    if s["workload"]["extras_left_out"]:
        left = ", ".join(s["workload"]["extras_left_out"])
        out.append(f"left out of every request (--openai-only): {left}")
        if "ignore_eos" in s["workload"]["extras_left_out"]:
            out.append("EOS was honoured: responses may be shorter than max_tokens")
    return out


def plot(summary: dict[str, Any], results: list[RequestResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in results if r.got_first_token]
    completed = [r for r in results if r.status is RequestStatus.COMPLETED]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r.ttft * 1000 for r in first], bins=20)
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[1].hist([r.e2e * 1000 for r in completed], bins=20)
    axes[1].set(title="E2E latency (completed)", xlabel="ms")
    unfinished = [r for r in results if r.status is RequestStatus.IN_FLIGHT]
    t0 = min((r.start for r in completed + unfinished), default=0.0)
    for r in completed:
        axes[2].plot([r.start - t0, r.start - t0 + r.e2e], [r.output_tokens] * 2, "-", lw=1)
    for r in unfinished:
        axes[2].plot([r.start - t0, summary["duration_s"]], [r.output_tokens] * 2, ":", lw=1)
    axes[2].set(title="Request timeline (dotted: unfinished)", xlabel="s", ylabel="output tokens")
    stopped = "" if summary["stopped_by"] == StopReason.ALL_DONE else f", {summary['stopped_by']}"
    fig.suptitle(
        f"{summary['label']}: {summary['output_tokens_per_s']:.1f} output tok/s, "
        f"p50 TTFT {summary['ttft_ms'].get('p50', 0):.0f} ms, "
        f"{summary['completed']}/{len(results)} completed in {summary['duration_s']:.0f} s"
        f"{stopped}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
