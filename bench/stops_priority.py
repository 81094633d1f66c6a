"""Scheduler semantics benchmarks: stop strings in the scheduler, and TTFT by priority.

Both run the engine in-process with a real worker (SmolLM2, CPU float32 by default), so what
is measured is the scheduler's decisions on a real model's steps, without the network.

1. Stop strings, n=4. Chat prompts asking for a few sentences, n=4 sampled choices each, stop
   string "." (each choice stops at the end of its first sentence, at a different step).
   - `scheduler`: the stop strings go to the engine (AddRequest.stop): a choice that completes
     one finishes at once and frees its blocks;
   - `gateway`: the old behaviour, emulated: the engine gets no stop strings; the loop plays
     the gateway (the same detokenizer and matcher) and aborts a request once every choice has
     stopped, so a stopped choice keeps decoding until its last sibling stops.
   Both modes sample the same tokens (seeded), so their returned texts must be equal: checked.
   Reported per mode: wall time, steps, step time, sequences per step and in all
   (`sequence_steps`, the worker's work), decode tokens computed, KV blocks held, tokens
   returned, and returned tokens per second.

2. TTFT by priority under overload. Requests arrive (Poisson) faster than `max_num_seqs`
   lets them be served; a third of them priority 0, the rest 1 and 2. Run once with those
   priorities and once with every priority 0 (FCFS), same arrivals and seeds. Reported: TTFT
   p50 / p90 per priority class, and preemptions.

    .venv/bin/python bench/stops_priority.py --out bench/results/stops-priority.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from llmserve.detokenizer import IncrementalDetokenizer
from llmserve.model_spec import load_tokenizer, resolve_model
from llmserve.sampling_params import SamplingParams
from llmserve.stop_strings import StopStringMatcher
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig
from scheduler_service.engine.text_stops import StopStrings
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

TOPICS = [
    "the sea",
    "autumn",
    "a busy kitchen",
    "mountains",
    "trains",
    "a library",
    "rain",
    "the moon",
    "gardens",
    "bicycles",
    "old maps",
    "winter mornings",
]


def chat_prompt(tokenizer: Any, topic: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write three sentences about {topic}."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_engine(worker: Worker, max_num_seqs: int, num_gpu: int, tokenizer: Any) -> LLMEngine:
    worker.initialize_cache(num_gpu, 64)  # a fresh cache: the worker forgets old sequences
    return LLMEngine(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=2048),
        CacheConfig(worker.config.block_size, num_gpu, 64),
        worker,
        lambda: tokenizer,
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- 1. stop strings --------------------------------------------------------------------------


def run_stops(
    worker: Worker, tokenizer: Any, mode: str, num: int, max_tokens: int, num_gpu: int
) -> dict[str, Any]:
    engine = make_engine(worker, 64, num_gpu, tokenizer)
    stop = "."
    prompts = {f"r{i}": chat_prompt(tokenizer, TOPICS[i % len(TOPICS)]) for i in range(num)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        params = SamplingParams(n=4, temperature=0.8, seed=100 + i, max_tokens=max_tokens)
        engine.add_request(
            request_id,
            prompt,
            params,
            eos_token_id=tokenizer.eos_token_id,
            stop_strings=StopStrings((stop,)) if mode == "scheduler" else None,
        )
    # The gateway's per-choice state: detokenizer, matcher, text, tokens, done.
    choices: dict[tuple[str, int], dict[str, Any]] = {}
    for request_id, prompt in prompts.items():
        for index in range(4):
            choices[(request_id, index)] = {
                "detok": IncrementalDetokenizer(tokenizer, prompt),
                "matcher": StopStringMatcher([stop]),
                "text": "",
                "tokens": 0,
                "done": False,
            }
    step_s: list[float] = []
    batch: list[int] = []
    decoded = 0
    blocks_used: list[int] = []
    bm = engine.scheduler.block_manager
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        deltas = engine.step()
        step_s.append(time.perf_counter() - t)
        step = engine.last_step_input
        assert step is not None
        batch.append(len(step.new_seqs) + len(step.cached_seqs))
        decoded += sum(1 for s in step.cached_seqs if s.num_scheduled_tokens == 1)
        blocks_used.append(bm.num_total_gpu_blocks - bm.get_num_free_gpu_blocks())
        for delta in deltas:
            for c in delta.outputs:
                state = choices[(delta.request_id, c.index)]
                if state["done"]:
                    continue  # the gateway ignores a stopped choice's tokens
                state["tokens"] += len(c.token_ids)
                text = state["detok"].add(c.token_ids)
                if c.finish_reason is not None:
                    text += state["detok"].flush()
                check = state["matcher"].feed(text)
                state["text"] += check.text
                if check.stop is not None or c.finish_reason is not None:
                    state["done"] = True
            if (
                mode == "gateway"
                and not delta.finished
                and all(choices[(delta.request_id, i)]["done"] for i in range(4))
            ):
                engine.abort_request(delta.request_id)  # what the gateway's stream close did
    elapsed = time.perf_counter() - start
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    returned = sum(s["tokens"] for s in choices.values())
    return {
        "mode": mode,
        "requests": num,
        "n": 4,
        "max_tokens": max_tokens,
        "wall_s": round(elapsed, 3),
        "steps": len(step_s),
        "step_ms_mean": round(1e3 * statistics.mean(step_s), 2),
        "step_ms_p50": round(1e3 * statistics.median(step_s), 2),
        "seqs_per_step_mean": round(statistics.mean(batch), 2),
        "kv_blocks_used_mean": round(statistics.mean(blocks_used), 1),
        "sequence_steps": sum(batch),
        "decode_tokens_computed": decoded,
        "returned_tokens": returned,
        "returned_tokens_per_s": round(returned / elapsed, 1),
        "texts": {f"{k[0]}/{k[1]}": s["text"] for k, s in sorted(choices.items())},
    }


# -- 2. TTFT by priority ----------------------------------------------------------------------


def run_priority(
    worker: Worker,
    tokenizer: Any,
    with_priorities: bool,
    num: int,
    rate: float,
    max_num_seqs: int,
    max_tokens: int,
    num_gpu: int,
) -> dict[str, Any]:
    engine = make_engine(worker, max_num_seqs, num_gpu, tokenizer)
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for i in range(num):
        t += rng.expovariate(rate)
        arrivals.append((t, f"p{i}", i % 3))  # priority classes 0, 1, 2 in turn
    classes = {request_id: cls for _, request_id, cls in arrivals}
    ttft: dict[str, float] = {}
    start = time.monotonic()
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0][0] <= now:
            at, request_id, cls = pending.pop(0)
            engine.add_request(
                request_id,
                chat_prompt(tokenizer, TOPICS[int(request_id[1:]) % len(TOPICS)]),
                SamplingParams(
                    temperature=0.8,
                    seed=int(request_id[1:]),
                    max_tokens=max_tokens,
                    ignore_eos=True,
                ),
                arrival_time=start + at,
                priority=cls if with_priorities else 0,
            )
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        for delta in engine.step():
            m = delta.metrics
            if delta.request_id not in ttft and m is not None and m.first_token_time is not None:
                ttft[delta.request_id] = m.first_token_time - m.arrival_time
    by_class: dict[str, dict[str, float]] = {}
    for cls in range(3):
        values = [v for k, v in ttft.items() if classes[k] == cls]
        by_class[str(cls)] = {
            "requests": len(values),
            "ttft_p50_s": round(pct(values, 0.5), 3),
            "ttft_p90_s": round(pct(values, 0.9), 3),
            "ttft_mean_s": round(statistics.mean(values), 3),
        }
    stats = engine.get_stats()
    return {
        "priorities": "0/1/2 in turn" if with_priorities else "all 0 (FCFS)",
        "requests": num,
        "rate_per_s": rate,
        "max_num_seqs": max_num_seqs,
        "max_tokens": max_tokens,
        "ttft_by_class": by_class,
        "preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap,
        "wall_s": round(time.monotonic() - start, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stop-requests", type=int, default=8)
    ap.add_argument("--stop-max-tokens", type=int, default=64)
    ap.add_argument("--priority-requests", type=int, default=30)
    ap.add_argument("--priority-rate", type=float, default=4.0)
    ap.add_argument("--priority-max-num-seqs", type=int, default=4)
    ap.add_argument("--priority-max-tokens", type=int, default=24)
    ap.add_argument("--num-gpu-blocks", type=int, default=512)
    ap.add_argument("--out", default="bench/results/stops-priority.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(resolve_model(args.model))
    worker = Worker(WorkerConfig(model=args.model, dtype=args.dtype, num_threads=args.threads))
    worker.load_model()
    result: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "threads": args.threads}
    # Warm-up (first-call costs), then each mode twice, alternating; the second pair is kept.
    run_stops(worker, tokenizer, "scheduler", 2, 8, args.num_gpu_blocks)
    runs = []
    for _ in range(2):
        for mode in ("gateway", "scheduler"):
            runs.append(
                run_stops(
                    worker,
                    tokenizer,
                    mode,
                    args.stop_requests,
                    args.stop_max_tokens,
                    args.num_gpu_blocks,
                )
            )
    gateway, scheduler = runs[-2], runs[-1]
    assert gateway["texts"] == scheduler["texts"], "the two modes returned different text"
    for r in runs:
        r.pop("texts")
    result["stops"] = runs
    print(json.dumps(runs[-2:], indent=1))
    result["priority"] = [
        run_priority(
            worker,
            tokenizer,
            p,
            args.priority_requests,
            args.priority_rate,
            args.priority_max_num_seqs,
            args.priority_max_tokens,
            args.num_gpu_blocks,
        )
        for p in (False, True)
    ]
    print(json.dumps(result["priority"], indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
