"""Structured output through the whole stack: what a grammar costs a served request.

Issue #26's serving figures, on the embedded SmolLM2 through `llmserve up`, each run on a
freshly started stack (bench/serve_compare.py's measure_server: quiet machine, health, serve.py
client, stop):

  tpot-free     16 streams, 48 requests, input 128, output 64, no grammar;
  tpot-json     the same with a json_schema every request shares (an array of 40 short
                strings, so no answer is complete within 64 tokens);
  tpot-json-nf  the same with forced tokens off (LLMSERVE_FORCED_TOKENS=0);
  ttft-free     1 stream, 16 requests, input 128, output 8, no grammar;
  ttft-cold     the same, each request with a schema of its own (serve.py --cold-grammars):
                every grammar is checked at admission and compiled on the request's path.

Greedy, ignore_eos, usage from the server. TPOT and TTFT are serve.py's per-request p50s.

    .venv/bin/python bench/grammar_serve.py               # ~8 minutes on a quiet machine
    .venv/bin/python bench/grammar_serve.py --runs tpot-free tpot-json --scale 0.25
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve_compare import BENCH, BIN, Server, ensure_hf_model, measure_server, shown

from llmserve.supervisor import free_ports

MODEL = "smollm2"
LONG_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "notes",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "notes": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 40,
                    "maxItems": 40,
                }
            },
            "required": ["notes"],
            "additionalProperties": False,
        },
    },
}


@dataclass(frozen=True, slots=True)
class Run:
    streams: int
    num_prompts: int
    output_len: int
    schema: bool = False
    cold: bool = False
    env: dict[str, str] = field(default_factory=dict)


RUNS = {
    "tpot-free": Run(16, 48, 64),
    "tpot-json": Run(16, 48, 64, schema=True),
    "tpot-json-nf": Run(16, 48, 64, schema=True, env={"LLMSERVE_FORCED_TOKENS": "0"}),
    "ttft-free": Run(1, 16, 8),
    "ttft-cold": Run(1, 16, 8, schema=True, cold=True),
}


def client(server: Server, run: Run, name: str, args: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, str(BENCH / "serve.py"), "--base-url", server.base_url,
        "--model", MODEL, "--tokenizer", str(args.hf_model), "--endpoint", "chat",
        "--num-prompts", str(max(1, round(run.num_prompts * args.scale))),
        "--input-len", "128", "--output-len", str(run.output_len),
        "--max-concurrency", str(run.streams), "--seed", str(args.seed), "--ignore-eos",
        "--include-usage", "--warmup", "1", "--max-duration", str(args.max_duration),
        "--request-timeout", str(args.max_duration), "--label", name,
        "--out", str(args.out_dir / "runs" / name),
    ]  # fmt: skip
    if run.schema:
        command += ["--response-format", str(args.out_dir / "schema.json")]
    if run.cold:
        command.append("--cold-grammars")
    return command


def p50(summary: dict[str, Any], key: str) -> str:
    value = (summary.get(key) or {}).get("p50")
    return f"{value:.1f}" if value is not None else "-"


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| run | completed | output tok/s | TTFT p50 ms | TPOT p50 ms | load before / others |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        if "error" in s:
            lines.append(f"| {name} | {s['error']} | | | | {s.get('contention', '?')} |")
            continue
        lines.append(
            f"| {name} | {s.get('completed', '-')} | {s.get('output_tokens_per_s', 0):.1f} "
            f"| {p50(s, 'ttft_ms')} | {p50(s, 'tpot_ms')} | {s.get('contention', '?')} |"
        )

    def ratio(a: str, b: str, key: str) -> str | None:
        x, y = results.get(a, {}).get(key, {}), results.get(b, {}).get(key, {})
        if x.get("p50") and y.get("p50"):
            return f"- {key} p50 {a} / {b}: {x['p50'] / y['p50']:.3f}"
        return None

    pairs = [("tpot-json", "tpot-free", "tpot_ms"), ("tpot-json-nf", "tpot-free", "tpot_ms"),
             ("ttft-cold", "ttft-free", "ttft_ms")]  # fmt: skip
    lines += [line for a, b, key in pairs if (line := ratio(a, b, key))]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--scale", type=float, default=1.0, help="request counts x this")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-duration", type=float, default=600.0)
    p.add_argument("--hf-model", type=Path, default=Path("/tmp/bench/smollm2-hf"))
    p.add_argument("--out-dir", type=Path, default=BENCH / "results" / "grammar-serve")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench/logs"))
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--load-patience", type=float, default=600.0)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ensure_hf_model(args.hf_model)
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    (args.out_dir / "schema.json").write_text(json.dumps(LONG_SCHEMA, indent=1) + "\n")
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in args.runs:
            run = RUNS[name]
            port, grpc_port = free_ports(2)
            command = [str(BIN / "llmserve"), "up", "--model", MODEL, "--dtype", args.dtype,
                       "--grpc-port", str(grpc_port), "--http-port", str(port)]  # fmt: skip
            server = Server(name, name, command, port, MODEL)
            env = {"LLMSERVE_NUM_THREADS": str(args.threads), **run.env}
            out = args.out_dir / "runs" / f"{name}.json"
            results[name] = measure_server(server, client(server, run, name, args), out, args, env)
    except (KeyboardInterrupt, SystemExit):
        print("stopped; reporting the runs that finished")
    text = report(results)
    header = f"$ {shown([sys.executable, *sys.argv])}\n\n"
    (args.out_dir / "grammar-serve.md").write_text(header + text + "\n")
    (args.out_dir / "grammar-serve.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
