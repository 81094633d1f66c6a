"""Serving benchmark for any OpenAI-compatible base URL.

A seeded workload (fixed or uniformly random input/output lengths) is sent as streaming
requests, either at a Poisson request rate or with a cap on concurrency. Reported: request
throughput, output tokens/s, TTFT / TPOT / ITL / E2E percentiles. Output tokens are counted by
re-tokenizing each response's text with --tokenizer, so every server is counted the same way.

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000/v1 --model smollm2 \\
        --tokenizer /path/to/tokenizer --num-prompts 32 --input-len 128 --output-len 64 \\
        --max-concurrency 16 --label llmserve --out bench/results/serve-llmserve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass(slots=True)
class WorkItem:
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    # Arrival times of the content chunks after the first, relative to the start.
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    output_tokens: int = 0
    error: str = ""


def build_workload(
    tokenizer: Any, num: int, input_len: int, output_len: int, random_ratio: float, seed: int
) -> list[WorkItem]:
    """Prompts of random vocabulary tokens decoded to text; lengths uniform in
    [len * (1 - random_ratio), len] when random_ratio > 0."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    items = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * (1 - random_ratio))), input_len)
        n_out = rng.randint(max(1, int(output_len * (1 - random_ratio))), output_len)
        text = tokenizer.decode([rng.choice(vocab) for _ in range(n_in)])
        items.append(
            WorkItem(text, len(tokenizer(text, add_special_tokens=False)["input_ids"]), n_out)
        )
    return items


def request_body(args: argparse.Namespace, item: WorkItem) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": item.max_tokens,
        "stream": True,
        "temperature": args.temperature,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra; servers that do not know it ignore it
    return body


def chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, item: WorkItem
) -> RequestResult:
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    result = RequestResult(ok=False, start=time.perf_counter())
    parts: list[str] = []
    try:
        async with client.stream(
            "POST", args.base_url + path, json=request_body(args, item)
        ) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    return result
                text = chunk_text(chunk, args.endpoint)
                if not text:
                    continue
                now = time.perf_counter() - result.start
                if not parts:
                    result.ttft = now
                else:
                    result.chunk_times.append(now)
                parts.append(text)
        result.e2e = time.perf_counter() - result.start
        result.text = "".join(parts)
        result.ok = bool(parts)
        if not parts:
            result.error = "no content"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_workload(
    args: argparse.Namespace, items: list[WorkItem]
) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(items))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=len(items), max_keepalive_connections=len(items))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:

        async def limited(item: WorkItem) -> RequestResult:
            async with limit:
                return await one_request(client, args, item)

        start = time.perf_counter()
        tasks = []
        for item in items:
            tasks.append(asyncio.create_task(limited(item)))
            if args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


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


def summarize(
    args: argparse.Namespace,
    items: list[WorkItem],
    results: list[RequestResult],
    duration: float,
    tokenizer: Any,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    for r in ok:
        r.output_tokens = len(tokenizer(r.text, add_special_tokens=False)["input_ids"])
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip([r.ttft, *r.chunk_times], r.chunk_times, strict=False)]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "label": args.label,
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "workload": {
            "num_prompts": len(items),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "random_ratio": args.random_ratio,
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
        },
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(
            i.prompt_tokens for i, r in zip(items, results, strict=True) if r.ok
        ),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": output_tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e for r in ok]),
    }


def plot(summary: dict[str, Any], results: list[RequestResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].hist([r.ttft * 1000 for r in ok], bins=20)
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[1].hist([r.e2e * 1000 for r in ok], bins=20)
    axes[1].set(title="E2E latency", xlabel="ms")
    t0 = min((r.start for r in ok), default=0.0)
    for r in ok:
        axes[2].plot([r.start - t0, r.start - t0 + r.e2e], [r.output_tokens] * 2, lw=1)
    axes[2].set(title="Request timeline", xlabel="s since start", ylabel="output tokens")
    fig.suptitle(
        f"{summary['label']}: {summary['output_tokens_per_s']:.1f} output tok/s, "
        f"p50 TTFT {summary['ttft_ms'].get('p50', 0):.0f} ms, "
        f"{summary['completed']}/{summary['completed'] + summary['failed']} ok"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--tokenizer", required=True, help="tokenizer dir for prompts and counting")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--random-ratio",
        type=float,
        default=0.0,
        help="0: fixed lengths; r: uniform in [len*(1-r), len]",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second; 0 sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=0, help="0: unlimited")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--label", default="server")
    p.add_argument("--out", type=Path, required=True, help="path prefix for .json and .png")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    items = build_workload(
        tokenizer, args.num_prompts, args.input_len, args.output_len, args.random_ratio, args.seed
    )
    results, duration = asyncio.run(run_workload(args, items))
    summary = summarize(args, items, results, duration, tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path = args.out.with_suffix(".json")
    json_path.write_text(
        json.dumps({"summary": summary, "requests": [asdict(r) for r in results]}, indent=1)
    )
    plot(summary, results, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
