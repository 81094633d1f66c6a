"""Prefix caching of linear-attention states: time to first token of a prompt whose 2k-token
prefix an earlier prompt computed (a hit starts from the state snapshot kept at its last block)
against the same prompt cold, on a tiny random Qwen3.5 (tests/support/models.py `qwen3_5`,
8 layers: 6 Gated DeltaNet, 2 gated attention), with HF transformers' `generate` of one token
on the same prompt as the peer, in the same run.

Each round, in alternating order: llmserve cold (a fresh engine, nothing cached), llmserve
warm (an engine that first served the prefix with another tail, then the prompt), HF. The
in-process engine runs the real worker (`cpu` backend, float32). Prints the median and the
spread (min-max) of each over the rounds, and the machine.

    .venv/bin/python bench/hybrid_state.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from scheduler_service.engine.offline import generate  # noqa: E402
from tests.support.engines import engine_on_worker  # noqa: E402
from tests.support.models import load_hf, save_tiny_model  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.worker import Worker  # noqa: E402

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--tail", type=int, default=32, help="tokens after the prefix")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = random.Random(0)
    prefix = [rng.randrange(2, 128) for _ in range(args.prefix)]
    prompt = prefix + [rng.randrange(2, 128) for _ in range(args.tail)]
    other = prefix + [rng.randrange(2, 128) for _ in range(args.tail)]
    length = len(prompt) + 64
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(
            "qwen3_5", Path(tmp) / "qwen3_5", max_position_embeddings=length, sharpen=True
        )
        hf = load_hf(path)
        worker = Worker(
            WorkerConfig(model=str(path), block_size=BLOCK, num_threads=2, attention_backend="cpu")
        )
        worker.load_model()

        def engine():  # type: ignore[no-untyped-def]
            blocks = 2 * length // BLOCK + 8
            return engine_on_worker(
                worker, gpu_blocks=blocks, cpu_blocks=4, batched_tokens=512, max_model_len=length
            )

        def cold() -> float:
            fresh = engine()  # its cache allocated outside the time
            return timed(lambda: generate(fresh, [prompt], ONE_TOKEN))

        def warm() -> float:
            warmed = engine()
            generate(warmed, [other], ONE_TOKEN)
            hits = warmed.get_stats().prefix_cache_hits
            seconds = timed(lambda: generate(warmed, [prompt], ONE_TOKEN))
            assert warmed.get_stats().prefix_cache_hits > hits, "the prompt did not hit"
            return seconds

        def peer() -> None:
            with torch.no_grad():
                hf.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)

        times: dict[str, list[float]] = {"llmserve cold": [], "llmserve hit": [], "HF": []}
        for r in range(args.rounds):
            order = ["llmserve cold", "llmserve hit", "HF"]
            if r % 2:
                order.reverse()
            for name in order:
                run = {"llmserve cold": cold, "llmserve hit": warm, "HF": lambda: timed(peer)}
                times[name].append(run[name]())
    print(f"machine: {describe()}")
    print(f"prompt: {args.prefix} shared + {args.tail} tokens; {args.rounds} rounds")
    print("| run | TTFT median (s) | min-max (s) |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} |")


if __name__ == "__main__":
    main()
