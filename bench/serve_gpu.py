"""Serving on one CUDA GPU: llmserve through its OpenAI API vs HF transformers on the same GPU.

In one command, one after the other on the same device:
1. `llmserve up --model MODEL` (default SmolLM2; worker on CUDA, decode CUDA graphs) measured
   with bench/serve.py at each --streams concurrency (output tok/s, TTFT, TPOT, E2E; requests
   to --endpoint, chat by default, of --input-len random-token prompts, --output-len tokens
   each with ignore_eos, greedy);
2. HF `generate` on the same weights and device at static batch sizes (`--hf-batches`):
   batch b generates --output-len tokens for b prompts of --input-len random tokens; TTFT is
   a 1-token generate of the batch, TPOT the rest over the remaining tokens, output tok/s
   b x output_len over the whole generate (the best batch is HF's best static figure);
3. HF continuous batching (`generate_batch`, paged attention) on the largest stream count's
   requests, when this transformers has it (`--skip hf-cb` leaves it out).
For each stream count it also reads where llmserve's steps went from the services' own
metrics (bench/step_metrics.py: steps/s, iteration, forward pass, sampling, idle gap, graph
replays and eager steps by reason, host CPU per step by service) and nvidia-smi's GPU
utilization. Writes <out-dir>/serve-gpu.json and .md after each run (a run cut short keeps
what it measured) and serve.py's per-run JSON, and prints the table.

    PYTHONPATH=$PWD python3 bench/serve_gpu.py --dtype bfloat16 --out-dir /tmp/out
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

import serve  # noqa: E402  (bench/serve.py)
import step_metrics  # noqa: E402
from server_runs import server_cpu_s, stop, wait_healthy  # noqa: E402

from llmserve.model_spec import resolve_model  # noqa: E402
from llmserve.ports import free_ports  # noqa: E402


def export_tokenizer(model: str, path: Path) -> None:
    from transformers import AutoTokenizer

    src = resolve_model(model)
    AutoTokenizer.from_pretrained(src.path, **src.pretrained_kwargs()).save_pretrained(path)


def run_llmserve(args: argparse.Namespace, tokenizer_dir: Path, result: dict[str, Any]) -> None:
    """Each stream count's run into result["llmserve"], saved after each (`save`)."""
    http, grpc = free_ports(2)
    command = [sys.executable, "-m", "llmserve.cli", "up", "--model", args.model,
               "--dtype", args.dtype, "--http-port", str(http), "--grpc-port", str(grpc),
               "--max-num-seqs", str(max(args.streams))]  # fmt: skip
    log_path = args.out_dir / "llmserve-up.log"
    started = time.monotonic()
    env = dict(os.environ)
    if args.max_model_len is not None:  # the worker's --max-model-len (graphs' table width)
        env["LLMSERVE_MAX_MODEL_LEN"] = str(args.max_model_len)
    env.update(item.split("=", 1) for item in args.up_env)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    runs: dict[str, Any] = {"command": " ".join([*args.up_env, *command[1:]])}
    result["llmserve"] = runs
    try:
        wait_healthy(proc, f"http://127.0.0.1:{http}/health", 300)
        runs["startup_s"] = time.monotonic() - started
        ports = step_metrics.metrics_ports(proc.pid)
        for streams in args.streams:
            prompts = max(args.min_prompts, args.prompts_per_stream * streams)
            argv = ["--base-url", f"http://127.0.0.1:{http}/v1", "--model", args.model,
                    "--endpoint", args.endpoint,
                    "--tokenizer", str(tokenizer_dir), "--num-prompts", str(prompts),
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--max-concurrency", str(streams), "--ignore-eos", "--seed", "0",
                    "--warmup", "2", "--max-duration", str(args.max_duration),
                    "--label", f"llmserve {streams} streams",
                    "--out", str(args.out_dir / f"serve-llmserve-{streams}")]  # fmt: skip
            log = args.out_dir / f"serve-llmserve-{streams}.log"
            metrics0, cpu0, t0 = (
                step_metrics.snapshot(ports),
                server_cpu_s(proc.pid),
                time.monotonic(),
            )
            with log.open("w") as out, contextlib.redirect_stdout(out), GpuBusy() as busy:
                summary = serve.main(argv)
            steps = step_metrics.step_breakdown(
                metrics0, step_metrics.snapshot(ports), cpu0, server_cpu_s(proc.pid),
                time.monotonic() - t0,
            )  # fmt: skip
            steps["gpu_busy_pct"] = busy.mean
            runs[str(streams)] = {
                "summary": summary, "steps": steps, "client": "bench/serve.py " + " ".join(argv)
            }  # fmt: skip
            print(f"llmserve {streams} streams: {brief(summary)}", flush=True)
            save(args, result)
    finally:
        stop(proc)


class GpuBusy:
    """nvidia-smi's GPU utilization, sampled every 200 ms while the block runs; `mean` is
    None where nvidia-smi is missing (a CPU rehearsal)."""

    def __enter__(self) -> GpuBusy:
        self.mean: float | None = None
        command = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                   "-lms", "200"]  # fmt: skip
        try:
            self._proc: subprocess.Popen[str] | None = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except FileNotFoundError:
            self._proc = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        values = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        self.mean = sum(values) / len(values) if values else None


def brief(s: dict[str, Any]) -> str:
    return (
        f"{s['output_tokens_per_s']:.0f} tok/s, TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
        f"TPOT p50 {s['tpot_ms']['p50']:.2f} ms, {s['completed']} done"
    )


def random_prompts(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=generator)  # [n, length]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def run_hf(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Each static batch into result["hf"], saved after each (`save`), then continuous
    batching unless skipped."""
    from transformers import AutoModelForCausalLM

    src = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(src.path, **src.pretrained_kwargs(), dtype=dtype)
    model = model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    results: dict[str, Any] = {"static": {}, "continuous_batching": {}}
    result["hf"] = results

    def generate(ids: torch.Tensor, new: int) -> None:
        with torch.no_grad():
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0,
            )  # fmt: skip

    for batch in args.hf_batches:
        ids = random_prompts(batch, args.input_len, vocab, batch).to(DEVICE)
        generate(ids, 2)  # warm-up
        ttft = timed(lambda ids=ids: generate(ids, 1))
        total = timed(lambda ids=ids: generate(ids, args.output_len))
        row = dict(
            batch=batch,
            output_tokens_per_s=batch * args.output_len / total,
            ttft_ms=ttft * 1e3,
            tpot_ms=(total - ttft) / max(args.output_len - 1, 1) * 1e3,
            total_s=total,
        )
        results["static"][str(batch)] = row
        print(
            f"HF generate, static batch {batch}: {row['output_tokens_per_s']:.0f} tok/s, "
            f"TTFT {row['ttft_ms']:.1f} ms, TPOT {row['tpot_ms']:.2f} ms",
            flush=True,
        )
        save(args, result)
    if "hf-cb" not in args.skip:
        results["continuous_batching"] = run_hf_cb(model, args, vocab)


def run_hf_cb(model: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """transformers' continuous batching over the largest stream count's number of requests."""
    from transformers import GenerationConfig

    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    n = max(args.min_prompts, args.prompts_per_stream * max(args.streams))
    prompts = random_prompts(n, args.input_len, vocab, 7).tolist()
    config = GenerationConfig(
        max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0,
        max_batch_tokens=args.cb_max_batch_tokens,
    )  # fmt: skip
    try:
        with torch.no_grad():
            model.generate_batch(prompts[:4], generation_config=config, progress_bar=False)
            sync()
            start = time.perf_counter()
            out = model.generate_batch(prompts, generation_config=config, progress_bar=False)
            sync()
            elapsed = time.perf_counter() - start
    except Exception as exc:  # an API this transformers does not have, or a failure in it
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    generated = sum(len(r.generated_tokens) for r in out.values())
    result = dict(
        requests=n,
        output_tokens=generated,
        seconds=elapsed,
        output_tokens_per_s=generated / elapsed,
        max_batch_tokens=args.cb_max_batch_tokens,
    )
    print(f"HF continuous batching, {n} requests: {result['output_tokens_per_s']:.0f} tok/s")
    return result


def save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The results so far, as JSON and as the markdown report: a run cut short keeps them."""
    (args.out_dir / "serve-gpu.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "serve-gpu.md").write_text(report(result) + "\n")


def report(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']}, driver {result['driver']}, torch {result['torch']}, triton "
        f"{result['triton']}, transformers {result['transformers']}; {result['model']} "
        f"{result['dtype']}; {result['input_len']} prompt tokens, {result['output_len']} "
        "output tokens per request (ignore_eos), greedy.",
        "",
        "| server | streams / batch | output tok/s | TTFT p50 ms | TPOT p50 ms | E2E p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for streams, run in result["llmserve"].items():
        if not isinstance(run, dict) or "summary" not in run:
            continue
        s = run["summary"]
        lines.append(
            f"| llmserve (OpenAI API) | {streams} | {s['output_tokens_per_s']:.0f} "
            f"| {s['ttft_ms']['p50']:.1f} | {s['tpot_ms']['p50']:.2f} | {s['e2e_ms']['p50']:.0f} |"
        )
    for batch, row in result["hf"]["static"].items():
        lines.append(
            f"| HF generate, static batch (in process) | {batch} "
            f"| {row['output_tokens_per_s']:.0f} | {row['ttft_ms']:.1f} | {row['tpot_ms']:.2f} "
            f"| {row['total_s'] * 1e3:.0f} |"
        )
    cb = result["hf"]["continuous_batching"]
    if "error" in cb:
        lines.append(f"| HF generate_batch (continuous batching) | - | {cb['error']} | | | |")
    elif cb:
        lines.append(
            f"| HF generate_batch (continuous batching, in process) | {cb['requests']} requests "
            f"| {cb['output_tokens_per_s']:.0f} | - | - | {cb['seconds'] * 1e3:.0f} (all) |"
        )
    levels = {
        k: v["steps"] for k, v in result["llmserve"].items() if isinstance(v, dict) and "steps" in v
    }
    if levels:
        lines += ["", "Where llmserve's steps went, from the services' own metrics (means per step; "
                  "'prepare' is the worker's host time before the model call, its input "
                  "building also inside 'forward'; on CUDA 'forward' is the host's launch of "
                  "the step and 'sample' includes waiting for the device; 'worker waited' is "
                  "its model thread's idle time per step, waiting for the next; host CPU per "
                  "step by service; GPU busy: nvidia-smi's utilization over the level):", ""]  # fmt: skip
        lines += step_metrics.breakdown_table(levels)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="llmserve's --model: a name or a path")
    p.add_argument("--model-label", default="SmolLM2-135M", help="the model, in the report")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="completions for a model without a chat template")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--up-env", nargs="*", action="extend", default=[], metavar="NAME=VALUE",
                   help="set for `llmserve up`'s services, e.g. "
                   "LLMSERVE_ENABLE_CHUNKED_PREFILL=false")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    p.add_argument("--hf-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=16)
    p.add_argument("--max-duration", type=float, default=120.0)
    p.add_argument("--cb-max-batch-tokens", type=int, default=2048)
    p.add_argument("--skip", nargs="*", action="extend", default=[], choices=["llmserve", "hf", "hf-cb"],
                   help="hf-cb: HF's continuous batching alone")  # fmt: skip
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import transformers
    import triton

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
    except FileNotFoundError:
        driver = "-"
    result: dict[str, Any] = dict(
        device=torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", driver=driver, torch=torch.__version__,
        triton=triton.__version__, transformers=transformers.__version__, dtype=args.dtype,
        model=args.model_label,
        input_len=args.input_len, output_len=args.output_len,
        command=" ".join(sys.argv), llmserve={}, hf={"static": {}, "continuous_batching": {}},
    )  # fmt: skip
    tokenizer_dir = args.out_dir / "tokenizer"
    export_tokenizer(args.model, tokenizer_dir)
    if "llmserve" not in args.skip:
        run_llmserve(args, tokenizer_dir, result)
    if "hf" not in args.skip:
        run_hf(args, result)
    save(args, result)
    print(report(result))


if __name__ == "__main__":
    main()
