"""Bytes per step on the Execute stream (ExecuteRequest out, ExecuteResult back).

Runs the real scheduler (LLMEngine) with 256 running sequences against a model-less executor
and serializes every step with the real proto conversions. Decode steps are measured at two
very different sequence lengths: a step is a diff, so its size must not depend on length.

    .venv/bin/python bench/step_bytes.py [--seqs 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmserve.sampling_params import SamplingParams
from llmserve.step_proto import step_input_to_proto, step_result_to_proto
from llmserve.steps import SequenceOutput, StepInput, StepResult, TokenLogprob
from scheduler_service.engine import CacheConfig, LLMEngine, SchedulerConfig


class CountingExecutor:
    """Tracks each sequence from the diffs (as a worker does) and samples token 7 where a
    sequence reaches its end; records the serialized size of every step and result."""

    def __init__(self) -> None:
        self.known: dict[int, list[int]] = {}  # seq id -> [tokens known, tokens computed]
        self.sizes: list[tuple[int, int, int]] = []  # (decode seqs, request bytes, result bytes)
        self.encode_ns: list[int] = []

    def execute(self, step: StepInput) -> StepResult:
        for seq_id in step.freed_seq_ids:
            self.known.pop(seq_id, None)
        for fork in step.forks:
            self.known[fork.child_seq_id] = list(self.known[fork.parent_seq_id])
        sampled: list[int] = []
        for new in step.new_seqs:
            state = [len(new.token_ids), new.num_computed_tokens + new.num_scheduled_tokens]
            self.known[new.seq_id] = state
            if state[1] == state[0]:
                sampled.append(new.seq_id)
        for cached in step.cached_seqs:
            state = self.known[cached.seq_id]
            state[0] += len(cached.new_token_ids)
            state[1] += cached.num_scheduled_tokens
            if state[1] == state[0]:
                sampled.append(cached.seq_id)
        result = StepResult(
            step.step_id,
            [SequenceOutput(s, [TokenLogprob(7, -0.5, 1)]) for s in sampled],
            forward_ns=1,
            sample_ns=1,
        )
        start = time.perf_counter_ns()
        request = step_input_to_proto(step).SerializeToString()
        reply = step_result_to_proto(result).SerializeToString()
        self.encode_ns.append(time.perf_counter_ns() - start)
        decodes = sum(1 for c in step.cached_seqs if c.num_scheduled_tokens == 1)
        self.sizes.append((decodes, len(request), len(reply)))
        return result


def measure(num_seqs: int, prompt_len: int, decode_steps: int) -> dict[str, float]:
    executor = CountingExecutor()
    blocks = num_seqs * ((prompt_len + decode_steps) // 16 + 2)
    engine = LLMEngine(
        SchedulerConfig(
            max_num_seqs=num_seqs,
            # No model: admit every prompt in one step so all sequences decode together.
            max_num_batched_tokens=num_seqs * (prompt_len + 1),
            max_model_len=prompt_len + decode_steps + 16,
        ),
        CacheConfig(
            block_size=16, num_gpu_blocks=blocks, num_cpu_blocks=0, enable_prefix_caching=False
        ),
        executor,
    )
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", [(i + j) % 1000 + 3 for j in range(prompt_len)], params)
    while engine.has_unfinished_requests():
        engine.step()
    full = [(req, res) for decodes, req, res in executor.sizes if decodes == num_seqs]
    return {
        "prompt_len": prompt_len,
        "decode_steps_measured": len(full),
        "request_bytes_median": statistics.median(r for r, _ in full),
        "request_bytes_max": max(r for r, _ in full),
        "result_bytes_median": statistics.median(r for _, r in full),
        "encode_us_median": statistics.median(executor.encode_ns) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=40)
    args = parser.parse_args()
    print(f"{args.seqs} running sequences, block size 16, decode steps with every sequence")
    print(
        "| prompt tokens | decode steps | ExecuteRequest bytes (median / max) | "
        "ExecuteResult bytes | bytes per seq | serialize both, us |"
    )
    print("|---|---|---|---|---|---|")
    for prompt_len in (16, 1000, 4000):
        m = measure(args.seqs, prompt_len, args.decode_steps)
        print(
            f"| {prompt_len} | {m['decode_steps_measured']} | "
            f"{m['request_bytes_median']:.0f} / {m['request_bytes_max']} | "
            f"{m['result_bytes_median']:.0f} | "
            f"{m['request_bytes_median'] / args.seqs:.1f} | {m['encode_us_median']:.0f} |"
        )


if __name__ == "__main__":
    main()
