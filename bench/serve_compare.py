"""Serving comparison: llmserve vs HF `transformers serve`, without and with continuous batching.

Back to back on one seeded workload, each server in turn is started on a free loopback port,
waited for (/health), measured with bench/serve.py (bounded by --max-duration; a slow server
yields partial figures), and stopped. Then one markdown row per server is printed, with the
ratios issue #5 asks for (>= 4x the peer's output tok/s at equal or better p50 TTFT), and
written with the exact command lines to <out-dir>/serve-compare.md.

    .venv/bin/python bench/serve_compare.py    # ~10 min on a quiet machine, 25 at most

Same conditions for every server: the same weights (the embedded SmolLM2 GGUF, exported to
safetensors for the peer by bench/export_hf_model.py when --hf-model is missing), the same
--dtype, 2 torch threads each (both default to the core count), the same request bodies
(OpenAI fields only: the peer answers 422 to vLLM's `ignore_eos`, so every server's run asks
for it and leaves it out, which its JSON records, and every server stops at EOS alike), one
unmeasured warm-up request each. Before each server it waits for the 1-minute load average
to fall under --max-load, and it reports how many cores other jobs took during each run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from server_runs import BENCH, BIN, Server, ensure_hf_model, measure_server, shown

from llmserve.ports import free_ports

SERVERS = ("llmserve", "hf", "hf-cb")


def dense_linear_impl(dtype: str) -> str:
    """The worker's linear_impl that keeps a GGUF model's weights dense in `dtype`, as a peer
    that reads them dequantized has them: in float32 `auto` would run them on the file's
    blocks (the default), which no other dtype can."""
    return "onednn" if dtype == "float32" else "auto"


def dense_flags(dtype: str) -> list[str]:
    """`llmserve up`'s flags for `dense_linear_impl`."""
    return ["--linear-impl", dense_linear_impl(dtype)]


def make_server(name: str, args: argparse.Namespace) -> Server:
    port, grpc_port = free_ports(2)
    if name == "llmserve":
        command = [str(BIN / "llmserve"), "up", "--model", "smollm2", "--dtype", args.dtype,
                   "--grpc-port", str(grpc_port), "--http-port", str(port),
                   *dense_flags(args.dtype)]  # fmt: skip
        return Server(name, f"llmserve ({args.dtype})", command, port, "smollm2")
    hf_model = str(args.hf_model)
    command = [str(BIN / "transformers"), "serve", hf_model, "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--dtype", args.dtype]  # fmt: skip
    if name == "hf":
        return Server(name, f"transformers serve, no CB ({args.dtype})", command, port, hf_model)
    # Continuous batching runs on CPU with SDPA over its paged cache (no flash kernels there).
    # Its cache defaults to 60% of RAM, zero-filled; 64 blocks of 256 tokens hold 16 requests of
    # up to 1,024 tokens. 2,048 tokens per step is llmserve's default step budget too.
    command += ["--continuous-batching", "--cb-num-blocks", str(args.cb_num_blocks),
                "--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]  # fmt: skip
    return Server(name, f"transformers serve, CB ({args.dtype})", command, port, hf_model)


def client_command(server: Server, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, str(BENCH / "serve.py"), "--base-url", server.base_url,
        "--model", server.model, "--tokenizer", str(args.hf_model),
        "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
        "--seed", str(args.seed), "--ignore-eos", "--openai-only", "--warmup", "1",
        "--max-duration", str(args.max_duration), "--request-timeout", str(args.max_duration),
        "--label", server.label, "--out", str(args.out_dir / f"serve-{server.name}"),
    ]  # fmt: skip


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    server = make_server(name, args)
    client = client_command(server, args)
    return measure_server(server, client, args.out_dir / f"serve-{name}.json", args)


def table_row(s: dict[str, Any], common_notes: set[str]) -> str:
    if "error" in s or "completed" not in s:
        return f"| {s['label']} | {s.get('error', 'no result written')} | | | | | | | {s['contention']} | |"
    ttft, n = s["ttft_ms"], s["workload"]["num_prompts"]
    ttft_text = " / ".join(f"{ttft[q]:.0f}" for q in ("p50", "p90", "p99")) if ttft else "none"
    return (
        f"| {s['label']} | {s['completed']}/{n} | {s['duration_s']:.1f} "
        f"| {s['output_tokens_per_s']:.1f} | {s['request_throughput']:.3f} | {ttft_text} "
        f"| {s['tpot_ms'].get('p50', 0):.0f} | {s['e2e_ms'].get('p50', 0):.0f} "
        f"| {s['contention']} | {'; '.join(n for n in s['notes'] if n not in common_notes)} |"
    )


def same_text_lines(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Greedy decoding of the same weights: the responses should match llmserve's, which shows
    that every server did the same work (float reductions may flip a near-tie now and then)."""
    texts = {}
    for name in names:
        path = args.out_dir / f"serve-{name}.json"
        if path.exists():
            requests = json.loads(path.read_text())["requests"]
            texts[name] = [r["text"] if r["status"] == "completed" else None for r in requests]
    if "llmserve" not in texts:
        return []
    lines = []
    for name, peer in texts.items():
        both = [(a, b) for a, b in zip(texts["llmserve"], peer, strict=True) if a and b]
        if name != "llmserve":
            same = sum(a == b for a, b in both)
            lines.append(f"- {name}: {same}/{len(both)} responses identical to llmserve's")
    return lines


def target_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    ours = summaries.get("llmserve", {})
    if not ours.get("ttft_ms"):
        return ["no llmserve figures: nothing to compare"]
    lines = []
    for name, peer in summaries.items():
        if name == "llmserve" or not peer.get("output_tokens_per_s") or not peer.get("ttft_ms"):
            continue
        ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        ours_p50, peer_p50 = ours["ttft_ms"]["p50"], peer["ttft_ms"]["p50"]
        met = ratio >= 4 and ours_p50 <= peer_p50
        lines.append(
            f"- vs {peer['label']}: output tok/s {ratio:.2f}x (target >= 4x), p50 TTFT "
            f"{ours_p50:.0f} vs {peer_p50:.0f} ms (target: llmserve <=): "
            f"{'met' if met else 'NOT met'}"
        )
    return lines


def report(summaries: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    header = (
        "| server | completed | duration s | output tok/s | req/s | TTFT p50 / p90 / p99 ms "
        "| TPOT p50 ms | E2E p50 ms | load before / others' cores | notes |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    notes = [s["notes"] for s in summaries.values() if "notes" in s]
    common = [n for n in notes[0] if all(n in other for other in notes)] if len(notes) > 1 else []
    rows = [table_row(s, set(common)) for s in summaries.values()]
    commands = [c for s in summaries.values() for c in s["commands"]]
    return "\n".join(
        [
            f"Workload: {args.num_prompts} chat requests, {args.input_len} random-token prompts, "
            f"max_tokens {args.output_len}, max concurrency {args.max_concurrency}, seed "
            f"{args.seed}, greedy, EOS honoured, --max-duration {args.max_duration:.0f} s; "
            f"dtype {args.dtype}.",
            *(f"Every run: {n}." for n in common),
            "",
            header,
            *rows,
            "",
            "Load before: the 1-minute load average at the server's start; others' cores: CPU time "
            "that other jobs on the machine took while the server ran, in cores (of "
            f"{os.cpu_count()}). Figures with others' cores well above 0 are contended.",
            "",
            *target_lines(summaries),
            *same_text_lines(args, list(summaries)),
            "",
            "```",
            "$ " + shown([sys.executable, *sys.argv]),
            *("$ " + c for c in commands),
            "```",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    # Default workload: the first attempt's (32 requests, 128-token prompts, 64 tokens out,
    # 16 in flight), sized for the slowest server. transformers serve without continuous
    # batching runs one request at a time: 60 ms per output token on this 2-core CPU when it
    # was quiet (4 x 16 tokens in 4.2 s), up to ~450 ms while another job held the cores. With
    # ~150-token prompts (128 + chat template) and 40-64 tokens per response (EOS honoured),
    # 32 requests take it 2-3 minutes quiet; --max-duration 300 leaves room for twice that,
    # and a run cut off there still reports tok/s over the 300 s, TTFT over the requests that
    # got a first token, and how many did not.
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration", type=float, default=300.0, help="seconds per server")
    p.add_argument(
        "--cb-num-blocks", type=int, default=64, help="peer's CB cache, 256-token blocks"
    )
    p.add_argument("--cb-max-batch-tokens", type=int, default=2048)
    p.add_argument("--hf-model", type=Path, default=Path("/tmp/bench/smollm2-hf"))
    p.add_argument("--out-dir", type=Path, default=BENCH / "results")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench/logs"))
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--max-load", type=float, default=1.0, help="wait for a lower 1-min load")
    p.add_argument("--load-patience", type=float, default=600.0, help="seconds to wait for it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # `timeout` and kill send SIGTERM: unwind like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ensure_hf_model(args.hf_model)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name in args.servers:
        try:
            summaries[name] = measure(name, args)
        except (KeyboardInterrupt, SystemExit):
            print(f"stopped during {name}; reporting the servers before it")
            break
    text = report(summaries, args)
    (args.out_dir / "serve-compare.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
