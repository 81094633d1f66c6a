"""What fast mode costs in output quality: SmolLM2 on its GGUF blocks against HF (issue #27).

HF's model is the GGUF file dequantized by transformers, in float32. For each quant mode
(`--linear-impl gguf --quant-mode exact|fast`) a worker runs on the file's blocks, and this
reports:
- greedy agreement on the exactness prompts (tests/support/models.py, 64 new tokens each):
  how many outputs equal HF's token for token, and the mean length of the common prefix;
- perplexity on a fixed text (`FIXED_TEXT` of tests/integration/test_worker_gguf_blocks.py)
  from the prompt logprobs, read in chunks of 32 tokens so that every token goes through the
  mode's kernel (inputs of 64 rows or more take the dequantizing path in both modes).

    .venv/bin/python bench/quant_quality.py [--model path/to/file.gguf]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))

from llmserve.model_spec import resolve_model  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402
from tests.integration.test_worker_gguf_blocks import FIXED_TEXT, perplexity  # noqa: E402
from tests.support.engines import engine_on_worker  # noqa: E402
from tests.support.models import SMOLLM2_EXACTNESS_NEW, SMOLLM2_EXACTNESS_TEXTS  # noqa: E402
from worker_service.config import WorkerConfig  # noqa: E402
from worker_service.worker import Worker  # noqa: E402


def load_hf(spec: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(spec)
    tok = AutoTokenizer.from_pretrained(source.path, **source.pretrained_kwargs())
    model = AutoModelForCausalLM.from_pretrained(
        source.path, **source.pretrained_kwargs(), dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    return tok, model


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a Llama-shaped GGUF model spec")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok, hf = load_hf(args.model)
    prompts = [tok(t)["input_ids"] for t in SMOLLM2_EXACTNESS_TEXTS]
    new = SMOLLM2_EXACTNESS_NEW
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0
            )
        expected.append(out[0, len(prompt) :].tolist())
    ids = tok(FIXED_TEXT)["input_ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    hf_ppl = float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp())
    rows = [f"| HF (dequantized, float32) | {len(prompts)}/{len(prompts)} | {new:.1f} | "
            f"{hf_ppl:.4f} |"]  # fmt: skip
    for mode in ("exact", "fast"):
        worker = Worker(
            WorkerConfig(
                model=args.model,
                dtype="float32",
                num_threads=args.threads,
                linear_impl="gguf",
                quant_mode=mode,
            )
        )
        worker.load_from_hf(hf)
        engine = engine_on_worker(
            worker, gpu_blocks=128, cpu_blocks=0, batched_tokens=64, max_model_len=2048
        )
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        equal = sum(g == e for g, e in zip(got, expected, strict=True))
        prefix = sum(common_prefix(g, e) for g, e in zip(got, expected, strict=True)) / len(got)
        rows.append(
            f"| llmserve gguf, {mode} | {equal}/{len(prompts)} | {prefix:.1f} | "
            f"{perplexity(worker, ids):.4f} |"
        )
    print(f"{args.model}, {len(ids)} tokens of fixed text, {args.threads} threads")
    print("| model | greedy outputs equal to HF's | mean common prefix (tokens) | perplexity |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
