"""Serving benchmark for any OpenAI-compatible base URL.

A seeded workload (fixed or uniformly random input/output lengths) is sent as streaming
requests, either at a Poisson request rate or with a cap on concurrency, after --warmup
requests that are not measured. Reported: request throughput, output tokens/s, TTFT / TPOT /
ITL / E2E percentiles. A request's output tokens are the `usage.completion_tokens` its stream
reported, from whichever chunk carried it (a chunk without choices, as the OpenAI API sends
for `stream_options.include_usage`, or the last choice's chunk, as llama-server sends), else
its text re-tokenized with --tokenizer; the JSON records which, per request. --include-usage
asks the server for usage.

The run ends when every request has finished, after --max-duration seconds, or on SIGINT /
SIGTERM; the JSON (and plot) is written in every case, with what finished and what did not
(see bench/serve_report.py for how partial runs are counted).

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000/v1 --model smollm2 \\
        --tokenizer /path/to/tokenizer --num-prompts 32 --input-len 128 --output-len 64 \\
        --max-concurrency 16 --max-duration 300 --label llmserve --out bench/results/serve-llmserve

Run it as a script (`python bench/serve.py`): it imports serve_report from its own folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from serve_report import (
    RequestResult,
    RequestStatus,
    RunOutcome,
    StopReason,
    count_output_tokens,
    plot,
    record_usage,
    summarize,
)

# Request fields that vLLM-style servers accept and the OpenAI API does not; strict servers
# (transformers serve) answer 422 to them.
_VLLM_EXTRAS = ("ignore_eos",)


@dataclass(slots=True)
class WorkItem:
    prompt: str
    prompt_tokens: int
    max_tokens: int


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


def requested_extras(args: argparse.Namespace) -> dict[str, list[str]]:
    """The vLLM extras the flags ask for, split into those sent and those left out."""
    asked = [name for name in _VLLM_EXTRAS if getattr(args, name)]
    if args.openai_only:
        return {"sent": [], "left_out": asked}
    return {"sent": asked, "left_out": []}


def request_body(args: argparse.Namespace, item: WorkItem, extras: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": item.max_tokens,
        "stream": True,
        "temperature": args.temperature,
    }
    if args.include_usage:
        body["stream_options"] = {"include_usage": True}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    for name in extras:
        body[name] = True  # every extra in _VLLM_EXTRAS is a boolean switch
    if args.response_format is not None:
        body["response_format"] = json.loads(json.dumps(args.response_format))  # a copy
    return body


def make_cold(bodies: list[dict[str, Any]], tag: str) -> None:
    """Give each body's json_schema a description of its own, so no two requests share a
    compiled grammar (the compile caches key on the schema's text): every one is cold."""
    for i, body in enumerate(bodies):
        schema = body["response_format"]["json_schema"].setdefault("schema", {})
        schema["description"] = f"{tag} request {i}"


def chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def one_request(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    body: dict[str, Any],
    result: RequestResult,
) -> None:
    """Fills `result` as the stream arrives, so a cancelled request keeps what it received."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    result.status = RequestStatus.IN_FLIGHT
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", args.base_url + path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                result.status = RequestStatus.FAILED
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    result.status = RequestStatus.FAILED
                    return
                record_usage(result, chunk)
                text = chunk_text(chunk, args.endpoint)
                if not text:
                    continue
                now = time.perf_counter() - result.start
                if result.text:
                    result.chunk_times.append(now)
                else:
                    result.ttft = now
                result.text += text
        result.e2e = time.perf_counter() - result.start
        result.status = RequestStatus.COMPLETED if result.text else RequestStatus.FAILED
        if not result.text:
            result.error = "no content"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.status = RequestStatus.FAILED


class Stopper:
    """Set by SIGINT / SIGTERM; the run ends at the first of: all done, stop, deadline."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason = StopReason.ALL_DONE

    def stop(self, reason: StopReason) -> None:
        if not self.event.is_set():
            print(f"serve.py: {reason}, writing partial results", file=sys.stderr)
            self.reason = reason
            self.event.set()

    async def race(self, task: asyncio.Task[Any], timeout: float | None) -> StopReason:
        """Wait for `task`, a stop, or `timeout` seconds; the task is left running."""
        stopped = asyncio.create_task(self.event.wait())
        done, _ = await asyncio.wait(
            {task, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        stopped.cancel()
        if task in done:
            task.result()  # a bug in the client surfaces here rather than as figures
            return StopReason.ALL_DONE
        return self.reason if self.event.is_set() else StopReason.MAX_DURATION


async def send_all(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    bodies: list[dict[str, Any]],
    results: list[RequestResult],
) -> None:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(bodies))

    async def limited(body: dict[str, Any], result: RequestResult) -> None:
        async with limit:
            await one_request(client, args, body, result)

    # Cancelling this coroutine cancels every request the group started.
    async with asyncio.TaskGroup() as group:
        for body, result in zip(bodies, results, strict=True):
            group.create_task(limited(body, result))
            if args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))


async def cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def warm_up(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    bodies: list[dict[str, Any]],
    stopper: Stopper,
) -> int:
    """Unmeasured requests, one at a time, so lazy start-up work (a server that builds its
    cache on the first request) is not charged to the first measured ones. Returns how many
    succeeded."""
    ok = 0
    for body in bodies:
        result = RequestResult()
        task = asyncio.create_task(one_request(client, args, body, result))
        reason = await stopper.race(task, args.request_timeout)
        if reason is not StopReason.ALL_DONE:
            await cancel(task)
            if reason is StopReason.MAX_DURATION:
                print("serve.py: warm-up request timed out; measuring anyway", file=sys.stderr)
            break
        if result.status is RequestStatus.COMPLETED:
            ok += 1
        else:
            print(f"serve.py: warm-up request failed: {result.error}", file=sys.stderr)
    return ok


async def run_workload(
    args: argparse.Namespace,
    bodies: list[dict[str, Any]],
    warmup_bodies: list[dict[str, Any]],
) -> RunOutcome:
    results = [RequestResult() for _ in bodies]
    stopper = Stopper()
    loop = asyncio.get_running_loop()
    for sig, reason in ((signal.SIGINT, StopReason.SIGINT), (signal.SIGTERM, StopReason.SIGTERM)):
        loop.add_signal_handler(sig, stopper.stop, reason)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
            warmup_ok = await warm_up(client, args, warmup_bodies, stopper)
            stopped_by, duration, cpu = stopper.reason, 0.0, 0.0
            if not stopper.event.is_set():  # a stop during the warm-up sends nothing
                print(f"serve.py: sending {len(bodies)} measured requests", file=sys.stderr)
                start, cpu_start = time.perf_counter(), time.process_time()
                sender = asyncio.create_task(send_all(client, args, bodies, results))
                stopped_by = await stopper.race(sender, args.max_duration or None)
                duration = time.perf_counter() - start
                cpu = time.process_time() - cpu_start
                await cancel(sender)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return RunOutcome(results, duration, stopped_by, warmup_ok, len(warmup_bodies), cpu)


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
    p.add_argument("--ignore-eos", action="store_true", help="vLLM extra: generate max_tokens")
    p.add_argument(
        "--openai-only",
        action="store_true",
        help="send only OpenAI API fields: vLLM extras asked for (--ignore-eos) are left out, "
        "and the report says so; for servers that reject them",
    )
    p.add_argument(
        "--include-usage",
        action="store_true",
        help="send stream_options.include_usage, so output tokens are the server's own count",
    )
    p.add_argument(
        "--response-format",
        type=lambda path: json.loads(Path(path).read_text()),
        default=None,
        help="a JSON file holding an OpenAI `response_format` object sent with every request",
    )
    p.add_argument(
        "--cold-grammars",
        action="store_true",
        help="with a json_schema --response-format: a distinct schema per request (every "
        "grammar compiled on its request's path)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first")
    p.add_argument(
        "--max-duration",
        type=float,
        default=0.0,
        help="seconds after the first measured request when the run ends and unfinished "
        "requests count as not completed; 0: no limit",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--label", default="server")
    p.add_argument("--out", type=Path, required=True, help="path prefix for .json and .png")
    args = p.parse_args(argv)
    if args.cold_grammars and (args.response_format or {}).get("type") != "json_schema":
        p.error("--cold-grammars: needs a json_schema --response-format")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    items = build_workload(
        tokenizer, args.num_prompts, args.input_len, args.output_len, args.random_ratio, args.seed
    )
    # Different prompts from the measured ones, so the warm-up fills no prefix cache for them.
    warmup_items = build_workload(tokenizer, args.warmup, 16, 4, 0.0, args.seed + 2)
    extras = requested_extras(args)
    bodies = [request_body(args, item, extras["sent"]) for item in items]
    warmup_bodies = [request_body(args, item, extras["sent"]) for item in warmup_items]
    if args.cold_grammars:
        make_cold(bodies, f"{args.label}, seed {args.seed}")
        make_cold(warmup_bodies, f"{args.label}, warm-up, seed {args.seed}")
    outcome = asyncio.run(run_workload(args, bodies, warmup_bodies))
    count_output_tokens(outcome.results, tokenizer)
    summary = summarize(args, [i.prompt_tokens for i in items], outcome, extras)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    requests = [asdict(r) for r in outcome.results]
    args.out.with_suffix(".json").write_text(
        json.dumps({"summary": summary, "requests": requests}, indent=1)
    )
    plot(summary, outcome.results, args.out.with_suffix(".png"))
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
