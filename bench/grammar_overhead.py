"""Scheduler-side cost of structured output, without a model: grammar compile time, token-mask
time per step at N constrained streams, and the decode steps forced tokens save.

A stand-in executor samples uniformly among each row's allowed tokens (seeded), so outputs
are valid for their grammar but not sensible; the figures are the scheduler's work only.
The worker waits for the mask time (masks travel with their step; a constrained request
turns asynchronous scheduling off for its replica while it runs).

    PYTHONPATH=. .venv/bin/python bench/grammar_overhead.py [--streams 16] [--repeat 3]

Not for timed assertions; on a shared machine take the best of several runs. The serving
comparison the issue asks for (TPOT at 16 streams constrained vs not, cold-grammar TTFT) needs
the real stack and an idle machine: bench/serve.py with --structured (to do).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import numpy as np

from gateway.tool_formats import FORMATS
from gateway.tools import parse_tools
from llmserve.grammar.cache import GrammarCache
from llmserve.grammar.llguidance_backend import LLGuidanceBackend
from llmserve.grammar.spec import GrammarSpec
from llmserve.limits import RequestLimits
from llmserve.model_spec import load_tokenizer, resolve_model
from llmserve.steps import MaskKind, SequenceOutput, StepInput, StepResult, TokenLogprob
from scheduler_service.engine import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from tests.support.grammar import BOUNDED_SCHEMA, WEATHER_TOOL

TOOLS = [
    WEATHER_TOOL,
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def schemas() -> list[GrammarSpec]:
    """The grammars of the test suite (tests/unit, tests/integration)."""
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "favourite": {"enum": ["red", "green", "blue"]},
            "address": {"$ref": "#/$defs/Address"},
            "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": ["name", "age", "favourite", "address", "hobbies", "nickname"],
        "additionalProperties": False,
        "$defs": {
            "Address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip_code"],
                "additionalProperties": False,
            }
        },
    }
    limits = RequestLimits()
    return [
        GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format"),
        GrammarSpec.json_schema(person, "response_format"),
        GrammarSpec.json_object("response_format"),
        FORMATS["generic"].grammar(parse_tools(TOOLS, "required", True, limits)),
        FORMATS["generic"].grammar(parse_tools(TOOLS, "auto", True, limits)),
        GrammarSpec.regex(r"[0-9]{3}-[A-Z]{3}-[0-9]{2}", "r"),
        GrammarSpec.choice(["yes, certainly", "no, never", "perhaps"], "c"),
        GrammarSpec.grammar('start: "x" NUM\nNUM: /[0-9]+/', "g"),
    ]


class MaskedRandomModel:
    """Samples each constrained row uniformly among its allowed tokens."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.state: dict[int, list[int]] = {}  # seq id -> [computed, known]
        self.steps = 0

    def execute(self, step: StepInput) -> StepResult:
        self.steps += 1
        state = self.state
        for seq_id in step.freed_seq_ids:
            state.pop(seq_id, None)
        for new in step.new_seqs:
            state[new.seq_id] = [new.num_computed_tokens, len(new.token_ids)]
        for c in step.cached_seqs:
            state[c.seq_id][1] += len(c.new_token_ids)
        masks = {m.seq_id: m for m in step.token_masks}
        outputs = []
        for seq_id, n in [(s.seq_id, s.num_scheduled_tokens) for s in step.new_seqs] + [
            (c.seq_id, c.num_scheduled_tokens) for c in step.cached_seqs
        ]:
            st = state[seq_id]
            st[0] += n
            if st[0] == st[1]:
                outputs.append(
                    SequenceOutput(seq_id, [TokenLogprob(self._pick(masks.get(seq_id)), -1.0, 1)])
                )
        return StepResult(step.step_id, outputs)

    def _pick(self, mask: Any) -> int:
        if mask is None:
            return self.rng.randrange(self.vocab)
        if mask.kind == MaskKind.ALLOW:
            return self.rng.choice(mask.token_ids)
        if mask.kind == MaskKind.DENY:
            denied = set(mask.token_ids)
            while True:
                t = self.rng.randrange(mask.vocab_size)
                if t not in denied:
                    return t
        bits = np.unpackbits(np.frombuffer(mask.bitmap, dtype=np.uint8), bitorder="little")
        return int(self.rng.choice(np.flatnonzero(bits[: mask.vocab_size])))


def compile_times(tok: Any, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        for spec in schemas():
            cache = GrammarCache(LLGuidanceBackend)
            cache.backend(tok)  # the tokenizer's backend is built once per process, not timed
            start = time.perf_counter()
            cache.get(tok, spec)
            times.append(time.perf_counter() - start)
    return times


def run_streams(tok: Any, streams: int, forced: bool, spec: GrammarSpec) -> dict[str, float]:
    engine = LLMEngine(
        SchedulerConfig(
            max_num_seqs=streams,
            max_num_batched_tokens=2048,
            max_model_len=1024,
            enable_forced_tokens=forced,
        ),
        CacheConfig(16, 4096, 64),
        MaskedRandomModel(len(tok)),
        tokenizer=lambda: tok,
    )
    for i in range(streams):
        engine.add_request(
            f"r{i}",
            [1 + i, 2, 3, 4],
            SamplingParams(max_tokens=400, seed=i),
            eos_token_id=tok.eos_token_id,
            grammar=spec,
        )
    step_masks: list[float] = []
    rows = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step_input and engine.last_step_input.token_masks:
            step_masks.append(engine.last_mask_seconds)
            rows += len(engine.last_step_input.token_masks)
    first = step_masks.pop(0)  # waits for the compile (and the tokenizer's backend, cold)
    step_masks.sort()
    return {
        "first_ms": 1e3 * first,
        "steps": engine.executor.steps,
        "mask_ms_mean": 1e3 * statistics.fmean(step_masks),
        "mask_ms_p50": 1e3 * step_masks[len(step_masks) // 2],
        "mask_ms_p99": 1e3 * step_masks[min(len(step_masks) - 1, int(0.99 * len(step_masks)))],
        "mask_us_per_row": 1e6 * sum(step_masks) / max(rows, 1),
        "forced_tokens": engine.num_forced_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    tok = load_tokenizer(resolve_model("smollm2"))
    times = sorted(compile_times(tok, args.repeat))
    print(
        f"compile over {len(times)} grammar compiles: p50 {1e3 * times[len(times) // 2]:.2f} ms,"
        f" p99 {1e3 * times[min(len(times) - 1, int(0.99 * len(times)))]:.2f} ms, "
        f"max {1e3 * times[-1]:.2f} ms"
    )
    workloads = {
        "json_schema": GrammarSpec.json_schema(BOUNDED_SCHEMA, "response_format"),
        "tool_call": FORMATS["generic"].grammar(
            parse_tools(TOOLS, "required", False, RequestLimits())
        ),
    }
    for name, spec in workloads.items():
        on = run_streams(tok, args.streams, True, spec)
        off = run_streams(tok, args.streams, False, spec)
        print(
            f"{name} x{args.streams}: masks per step mean {on['mask_ms_mean']:.2f} ms "
            f"(p50 {on['mask_ms_p50']:.2f}, p99 {on['mask_ms_p99']:.2f}), "
            f"{on['mask_us_per_row']:.0f} us per row, first step {on['first_ms']:.0f} ms "
            f"(compile wait); steps {on['steps']} with forced tokens "
            f"({on['forced_tokens']} forced) vs {off['steps']} without"
        )


if __name__ == "__main__":
    main()
