"""What fast mode costs in output quality: SmolLM2 on its GGUF blocks against HF (issue #27).

HF's model is the GGUF file dequantized by transformers, in float32. For each quant mode
(`--linear-impl gguf --quant-mode exact|fast`) a worker runs on the file's blocks (or, with
`--quantization`, on the model saved in float32 and quantized at load into that type); fast
mode twice, with its K/V cache in float32 (`--kv-cache-dtype model`) and as it defaults
(bfloat16). This reports, per run:
- greedy agreement on the exactness prompts (tests/support/models.py, 64 new tokens each):
  how many outputs equal HF's, and exact mode's, token for token, and the mean length of the
  common prefix;
- perplexity on a fixed text (`FIXED_TEXT` of tests/integration/test_worker_gguf_blocks.py)
  from the prompt logprobs, read in chunks of 32 tokens so that every token goes through the
  mode's kernel (larger inputs take the dequantizing path: gguf_weights.dequantize_rows).

    .venv/bin/python bench/quant_quality.py [--model path/to/file.gguf] [--quantization q8_0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

from bench.export_hf_model import export  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from scheduler_service.engine.offline import generate  # noqa: E402
from tests.integration.test_worker_gguf_blocks import (  # noqa: E402
    FIXED_TEXT,
    hf_perplexity,
    perplexity,
)
from tests.support.engines import engine_on_worker  # noqa: E402
from tests.support.models import (  # noqa: E402
    SMOLLM2_EXACTNESS_NEW,
    SMOLLM2_EXACTNESS_TEXTS,
    hf_greedy_outputs,
    load_spec,
)
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.worker import Worker  # noqa: E402


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# (quant mode, K/V cache dtype) of each run; exact mode's outputs, the first, are the others'
# reference.
RUNS = (("exact", "model"), ("fast", "model"), ("fast", "auto"))


def worker_for(
    args: argparse.Namespace, model: str, mode: str, kv_cache_dtype: str, hf: Any
) -> Worker:
    worker = Worker(
        WorkerConfig(
            model=model,
            dtype="float32",
            num_threads=args.threads,
            linear_impl="gguf",
            quantization=args.quantization,
            quant_mode=mode,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    worker.load_from_hf(hf)
    return worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a Llama-shaped GGUF model spec")
    parser.add_argument(
        "--quantization",
        choices=["none", "q8_0", "q4_1"],
        default="none",
        help="the model dequantized, saved, and quantized at load into this type instead",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok, hf = load_spec(args.model)
    prompts = [tok(t)["input_ids"] for t in SMOLLM2_EXACTNESS_TEXTS]
    new = SMOLLM2_EXACTNESS_NEW
    expected = hf_greedy_outputs(hf, prompts, new)
    ids = tok(FIXED_TEXT)["input_ids"]
    rows = [f"| HF (dequantized, float32) | - | - | {hf_perplexity(hf, ids):.4f} |"]
    with tempfile.TemporaryDirectory() as saved:
        model = args.model
        if args.quantization != "none":  # a float checkpoint of the same weights
            export(args.model, Path(saved), torch.float32)
            model = saved
        exact: list[list[int]] = []
        for mode, kv_cache_dtype in RUNS:
            worker = worker_for(args, model, mode, kv_cache_dtype, hf)
            engine = engine_on_worker(
                worker, gpu_blocks=128, cpu_blocks=0, batched_tokens=64, max_model_len=2048
            )
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            got = [o.outputs[0].token_ids for o in generate(engine, prompts, params)]
            exact = exact or got
            agree = [
                f"{sum(g == e for g, e in zip(got, ref, strict=True))}/{len(prompts)}, "
                f"{sum(common_prefix(g, e) for g, e in zip(got, ref, strict=True)) / len(got):.1f}"
                for ref in (expected, exact)
            ]
            rows.append(
                f"| {worker.model_info.weight_format}, K/V {worker.model_info.cache_dtype} | "
                f"{agree[0]} | {agree[1]} | "
                f"{perplexity(worker, ids):.4f} |"
            )
    print(f"{args.model}, {len(ids)} tokens of fixed text, {args.threads} threads")
    print(
        "| weights, mode | greedy outputs equal to HF's, mean common prefix (tokens) | "
        "to exact mode's | perplexity |"
    )
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
