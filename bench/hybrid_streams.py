"""Decode throughput of a hybrid model (linear-attention states beside paged K/V): output
tokens per second of 1 and 16 streams on a tiny random Qwen3.5 (tests/support/models.py
`qwen3_5`, 8 layers: 6 Gated DeltaNet, 2 gated attention), llmserve's engine on the real
worker (`cpu` backend, float32) against HF transformers' `generate` of the same batch, in
the same run.

Every stream has a prompt of the same length (HF's batch needs no padding then) and
generates the same number of tokens, greedily, past any EOS. Each round runs llmserve and HF
in alternating order; prints the median and the spread (min-max) of each over the rounds,
and the machine.

    .venv/bin/python bench/hybrid_streams.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per stream")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = random.Random(0)
    length = args.prompt + args.tokens
    prompts = [
        [rng.randrange(2, 128) for _ in range(args.prompt)] for _ in range(max(args.streams))
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model("qwen3_5", Path(tmp) / "qwen3_5", max_position_embeddings=length)
        hf = load_hf(path)
        worker = Worker(
            WorkerConfig(model=str(path), block_size=BLOCK, num_threads=2, attention_backend="cpu")
        )
        worker.load_model()

        def llmserve(n: int) -> float:
            engine = engine_on_worker(
                worker,
                gpu_blocks=n * (-(-length // BLOCK) + 1) + 8,
                cpu_blocks=4,
                batched_tokens=max(512, args.prompt),
                max_model_len=length,
            )  # its cache allocated outside the time
            start = time.perf_counter()
            outputs = generate(engine, prompts[:n], params)
            seconds = time.perf_counter() - start
            assert all(len(o.outputs[0].token_ids) == args.tokens for o in outputs)
            return n * args.tokens / seconds

        def peer(n: int) -> float:
            batch = torch.tensor(prompts[:n])
            start = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    max_new_tokens=args.tokens,
                    min_new_tokens=args.tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            seconds = time.perf_counter() - start
            assert out.shape == (n, length)
            return n * args.tokens / seconds

        rates: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for n in args.streams:
                order = [("llmserve", llmserve), ("HF", peer)]
                if r % 2:
                    order.reverse()
                for name, run in order:
                    rates.setdefault((name, n), []).append(run(n))
    print(f"machine: {describe()}")
    print(f"{args.prompt}-token prompts, {args.tokens} new tokens each; {args.rounds} rounds")
    print("| streams | run | output tok/s median | min-max |")
    print("|---|---|---|---|")
    for (name, n), values in sorted(rates.items(), key=lambda item: (item[0][1], item[0][0])):
        print(
            f"| {n} | {name} | {statistics.median(values):.1f} | "
            f"{min(values):.1f}-{max(values):.1f} |"
        )


if __name__ == "__main__":
    main()
