"""HF transformers `generate` as the in-process peer: output and decode tok/s at fixed batches.

For each batch size the same seeded random-token prompts (input --input-len tokens each) are
generated greedily to exactly --output-len tokens (`min_new_tokens` = `max_new_tokens`, so EOS
cannot end a row early), after one unmeasured warm-up. Two timings per batch: the whole call,
and a call that stops after its first token (the prefill); decode tok/s counts the tokens
after the first over the difference. Output tok/s is comparable with bench/serve.py's
`output_tokens_per_s` for the same workload, less the HTTP and scheduling around it.

    .venv/bin/python bench/hf_generate.py --model gemma3-270m --dtype float32 --batches 1 16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from server_runs import ensure_hf_model, wait_for_quiet
from transformers import AutoModelForCausalLM


def timed_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> float:
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - started
    assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape
    return elapsed


def measure(model: Any, vocab: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed + batch)
    ids = torch.randint(100, vocab - 100, (batch, args.input_len), generator=generator)
    timed_generate(model, ids[:, : min(16, args.input_len)], 4)  # warm-up
    prefill_s = min(timed_generate(model, ids, 1) for _ in range(args.repeats))
    total_s = min(timed_generate(model, ids, args.output_len) for _ in range(args.repeats))
    return {
        "batch": batch,
        "prefill_s": prefill_s,
        "total_s": total_s,
        "output_tokens_per_s": batch * args.output_len / total_s,
        "decode_tokens_per_s": batch * (args.output_len - 1) / (total_s - prefill_s),
        "tpot_ms": (total_s - prefill_s) / (args.output_len - 1) * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="llmserve model spec to export")
    p.add_argument("--hf-model", type=Path, default=None, help="default /tmp/bench/<model>-hf")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--load-patience", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="JSON of the figures")
    args = p.parse_args()
    if args.output_len < 2:
        p.error("--output-len: at least 2 (decode is timed after the first token)")
    hf_model = args.hf_model or Path(f"/tmp/bench/{args.model}-hf")
    ensure_hf_model(hf_model, args.model)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=getattr(torch, args.dtype))
    model.eval()
    load = wait_for_quiet(args.max_load, args.load_patience)
    rows = [measure(model, model.config.vocab_size, b, args) for b in args.batches]
    result = {"model": args.model, "dtype": args.dtype, "load_before": load, "rows": rows,
              "input_len": args.input_len, "output_len": args.output_len,
              "threads": args.threads, "torch": torch.__version__}  # fmt: skip
    print("| batch | output tok/s | decode tok/s | TPOT ms | prefill s |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['output_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} "
            f"| {r['tpot_ms']:.1f} | {r['prefill_s']:.2f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
