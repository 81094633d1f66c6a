"""Scheduler overhead per iteration: schedule() + StepInput diff + process_outputs().

Drives LLMEngine with N running sequences in steady decode against an executor that does
no model work (it only tracks computed counts and returns one token per sampling sequence),
and reports the engine's time per step minus the executor's.

    .venv/bin/python bench/scheduler_overhead.py [--seqs 256 1024] [--steps 200] [--repeat 3]
        [--pipelined]

`--pipelined` drives the engine as the scheduler service does with asynchronous scheduling
(`PipelinedStepper`): each step is the continuation of the one before it
(`scheduler_service.engine.pipelined_steps`), so an iteration is plan_continuation() +
build_continuation() + process_outputs() + commit_continuation().

Each run prints the 1-minute load average taken just before it: on a shared machine, compare
runs made at a low load, and take the best of several.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time

from llmserve.steps import SequenceOutput, StepInput, StepResult, TokenLogprob
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from scheduler_service.engine.offline import PipelinedStepper


class NullModel:
    """Returns token (seq_id + step) % 32000 for every sequence that reaches its last token."""

    def __init__(self) -> None:
        self.state: dict[int, list[int]] = {}  # seq id -> [computed, known tokens]
        self.seconds = 0.0

    def execute(self, step: StepInput) -> StepResult:
        start = time.perf_counter()
        state = self.state
        for seq_id in step.freed_seq_ids:
            state.pop(seq_id, None)
        for fork in step.forks:
            state[fork.child_seq_id] = list(state[fork.parent_seq_id])
        outputs = []
        for new in step.new_seqs:
            s = state[new.seq_id] = [
                new.num_computed_tokens + new.num_scheduled_tokens,
                len(new.token_ids),
            ]
            if s[0] == s[1]:
                outputs.append(
                    SequenceOutput(new.seq_id, [TokenLogprob(new.seq_id % 32000, -0.5, 1)])
                )
        for c in step.cached_seqs:
            s = state[c.seq_id]
            s[0] += c.num_scheduled_tokens
            s[1] += len(c.new_token_ids)
            if s[0] == s[1]:
                outputs.append(
                    SequenceOutput(
                        c.seq_id, [TokenLogprob((c.seq_id + step.step_id) % 32000, -0.5, 1)]
                    )
                )
        self.seconds += time.perf_counter() - start
        return StepResult(step.step_id, outputs)


def measure(num_seqs: int, steps: int, pipelined: bool, prompt_len: int = 128) -> dict[str, float]:
    block_size = 16
    blocks_per_seq = (prompt_len + steps + 64) // block_size + 1
    engine = LLMEngine(
        SchedulerConfig(
            max_num_seqs=num_seqs,
            max_num_batched_tokens=max(8192, num_seqs),
            max_model_len=4096,
        ),
        CacheConfig(block_size, num_seqs * blocks_per_seq + 16, 16, enable_prefix_caching=True),
        NullModel(),
    )
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    # Warm up until every sequence is decoding.
    while engine.get_stats().num_waiting or any(
        g.seqs[0].get_output_len() == 0 for g in engine.scheduler.running
    ):
        engine.step()
    for _ in range(10):
        engine.step()
    # As the services do (llmserve.service_main.freeze_startup_heap): what exists before the
    # timed loop is not rescanned by every cyclic collection.
    gc.collect()
    gc.freeze()
    model = engine.executor
    assert isinstance(model, NullModel)
    stepper = PipelinedStepper(engine) if pipelined else None
    step = engine.step if stepper is None else stepper.step
    per_step = []
    for _ in range(steps):
        model.seconds = 0.0
        start = time.perf_counter()
        step()
        per_step.append(time.perf_counter() - start - model.seconds)
    assert engine.get_stats().num_running == num_seqs
    if stepper is not None:  # each call built the continuation of the step it finished
        assert stepper.num_continuations == steps, stepper.num_continuations
    return {
        "mean_ms": statistics.fmean(per_step) * 1e3,
        "p50_ms": statistics.median(per_step) * 1e3,
        "p99_ms": sorted(per_step)[int(0.99 * len(per_step))] * 1e3,
        "us_per_seq": statistics.fmean(per_step) * 1e6 / num_seqs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=1, help="runs per size (best mean marked)")
    parser.add_argument(
        "--pipelined", action="store_true", help="each step the continuation of the last"
    )
    args = parser.parse_args()
    mode = "pipelined (continuations)" if args.pipelined else "synchronous steps"
    print(f"python {platform.python_version()} on {platform.machine()}, {mode}")
    print("| running seqs | mean ms/iter | p50 ms | p99 ms | us/seq | load (1 min) |")
    print("|---|---|---|---|---|---|")
    for n in args.seqs:
        runs = []
        for _ in range(args.repeat):
            load = os.getloadavg()[0]
            runs.append((measure(n, args.steps, args.pipelined), load))
        best = min(range(len(runs)), key=lambda i: runs[i][0]["mean_ms"])
        for i, (r, load) in enumerate(runs):
            mark = " (best)" if args.repeat > 1 and i == best else ""
            print(
                f"| {n}{mark} | {r['mean_ms']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                f"{r['us_per_seq']:.2f} | {load:.2f} |"
            )


if __name__ == "__main__":
    main()
