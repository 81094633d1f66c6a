"""Structured output through the whole stack: what a grammar costs a served request.

Issue #26's serving figures, on the embedded SmolLM2 through `llmserve up`
(bench/server_runs.py's measure_clients: quiet machine, health, serve.py clients, stop):

  tpot-free         16 streams, one wave of 16 requests started together, input 128, output
                    64, no grammar;
  tpot-json         the same, every request with the json_schema below (an array of 40
                    strings, so no answer is complete within 64 tokens);
  tpot-json-nf      the same with forced tokens off (LLMSERVE_FORCED_TOKENS=0);
  tpot-json-maxlen  the same schema with `"maxLength": 12` on the strings: llguidance's
                    masks inside a length-bounded string cost ~35x those inside a free one;
  ttft-free         1 stream, 16 requests, input 128, output 8, no grammar;
  ttft-cold         the same, each request with a schema of its own (serve.py --cold-grammars):
                    every grammar is checked at admission and compiled on the request's path.

One wave, not several: forced tokens end some constrained requests early, and the next
wave's prefills then interleave with the others' decoding, which moves time from TTFT to TPOT
and makes the two runs' TPOT incomparable (measured: 48 requests in three waves gave json
TPOT p50 1.15x the free run's at equal end-to-end times).

Greedy, ignore_eos, usage from the server. TPOT, ITL and TTFT are serve.py's per-request
p50s. Runs that need the same server environment share a stack: each of `--repeats` stacks
runs its group `--waves` times, interleaved (the order reversed every other wave, so neither
warm-up nor drift favours a run). The ratios compare the medians of the p50s, and for runs
of one group also wave by wave on the same stack, which takes the stack-to-stack spread
(up to 10% in TPOT here) out of the comparison.

Every run of a stack sends the same prompts (the same seed), so a stack's first wave, which
prefills them, is a prime wave that is not counted: the counted waves find every prompt in
the prefix cache, their TTFT is a cached prefill, and their TPOT is decoding alone. A cold
wave's TPOT also carries the other requests' prefill chunks, whose split over the first
steps varies from run to run (TTFT p50 2.1 to 2.8 s here).

    .venv/bin/python bench/grammar_serve.py               # ~20 minutes on a quiet machine
    .venv/bin/python bench/grammar_serve.py --runs tpot-free tpot-json --repeats 3 --waves 4
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_runs import BENCH, BIN, Server, ensure_hf_model, measure_clients, shown

from llmserve.ports import free_ports

MODEL = "smollm2"
NOTES_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "notes",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "notes": {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 40,
                    "maxItems": 40,
                }
            },
            "required": ["notes"],
            "additionalProperties": False,
        },
    },
}


def bounded(schema: dict[str, Any], max_length: int) -> dict[str, Any]:
    """`schema` (NOTES_SCHEMA) with a maxLength on the notes."""
    out = json.loads(json.dumps(schema))
    out["json_schema"]["schema"]["properties"]["notes"]["items"]["maxLength"] = max_length
    return out


@dataclass(frozen=True, slots=True)
class Run:
    streams: int
    num_prompts: int
    output_len: int
    schema: dict[str, Any] | None = None
    cold: bool = False
    env: dict[str, str] = field(default_factory=dict)


NO_FORCED = {"LLMSERVE_FORCED_TOKENS": "0"}
RUNS = {
    "tpot-free": Run(16, 16, 64),
    "tpot-json": Run(16, 16, 64, schema=NOTES_SCHEMA),
    "tpot-json-nf": Run(16, 16, 64, schema=NOTES_SCHEMA, env=NO_FORCED),
    "tpot-json-maxlen": Run(16, 16, 64, schema=bounded(NOTES_SCHEMA, 12)),
    "ttft-free": Run(1, 16, 8),
    "ttft-cold": Run(1, 16, 8, schema=NOTES_SCHEMA, cold=True),
}


def env_groups(names: list[str]) -> list[list[str]]:
    """`names` grouped by the server environment their runs need, in order: the runs of a
    group share a stack."""
    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for name in names:
        groups.setdefault(tuple(sorted(RUNS[name].env.items())), []).append(name)
    return list(groups.values())


def client(server: Server, run: Run, name: str, label: str, args: argparse.Namespace) -> list[str]:
    """serve.py's command for the run `name`, its output labelled `label`."""
    command = [
        sys.executable, str(BENCH / "serve.py"), "--base-url", server.base_url,
        "--model", MODEL, "--tokenizer", str(args.hf_model), "--endpoint", "chat",
        "--num-prompts", str(max(1, round(run.num_prompts * args.scale))),
        "--input-len", "128", "--output-len", str(run.output_len),
        "--max-concurrency", str(run.streams), "--seed", str(args.seed), "--ignore-eos",
        "--include-usage", "--warmup", "1", "--max-duration", str(args.max_duration),
        "--request-timeout", str(args.max_duration), "--label", label,
        "--out", str(args.out_dir / "runs" / label),
    ]  # fmt: skip
    if run.schema is not None:
        path = args.out_dir / f"{name}-schema.json"
        path.write_text(json.dumps(run.schema, indent=1) + "\n")
        command += ["--response-format", str(path)]
    if run.cold:
        command.append("--cold-grammars")
    return command


def p50(summary: dict[str, Any], key: str) -> float | None:
    value = (summary.get(key) or {}).get("p50")
    return float(value) if value is not None else None


def median_p50(repeats: list[dict[str, Any]], key: str) -> float | None:
    values = [v for s in repeats if (v := p50(s, key)) is not None]
    return statistics.median(values) if values else None


def shown_ms(values: list[float | None]) -> str:
    return " / ".join("-" if v is None else f"{v:.1f}" for v in values)


def report(results: dict[str, list[dict[str, Any]]]) -> str:
    """One row per run: each repeat's p50s, then ratios of the runs' medians."""
    lines = [
        "| run | completed | output tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms "
        "| load before / others |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, repeats in results.items():
        completed = " / ".join(str(s.get("completed", s.get("error", "-"))) for s in repeats)
        rate = " / ".join(f"{s.get('output_tokens_per_s', 0):.1f}" for s in repeats)
        ttft = shown_ms([p50(s, "ttft_ms") for s in repeats])
        tpot = shown_ms([p50(s, "tpot_ms") for s in repeats])
        itl = shown_ms([p50(s, "itl_ms") for s in repeats])
        load = " ; ".join(sorted({str(s.get("contention", "?")) for s in repeats}))
        lines.append(f"| {name} | {completed} | {rate} | {ttft} | {tpot} | {itl} | {load} |")

    def ratio(a: str, b: str, key: str) -> str | None:
        x, y = median_p50(results.get(a, []), key), median_p50(results.get(b, []), key)
        if not (x and y):
            return None
        line = f"- {key} p50, {a} / {b}: {x / y:.3f} (medians of the repeats)"
        if env_groups([a, b]) == [[a, b]]:  # the same stacks: compare wave by wave
            pairs = [
                (u, v) for sa, sb in zip(results[a], results[b], strict=False)
                if (u := p50(sa, key)) and (v := p50(sb, key))
            ]  # fmt: skip
            paired = sorted(u / v for u, v in pairs)
            if paired:
                line += (
                    f"; paired on the same stack, {len(paired)} pairs: median "
                    f"{statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}"
                )
        return line

    pairs = [("tpot-json", "tpot-free", "tpot_ms"), ("tpot-json", "tpot-free", "itl_ms"),
             ("tpot-json-nf", "tpot-free", "tpot_ms"),
             ("tpot-json-maxlen", "tpot-free", "tpot_ms"), ("ttft-cold", "ttft-free", "ttft_ms")]  # fmt: skip
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
    p.add_argument("--repeats", type=int, default=3, help="stacks started per group of runs")
    p.add_argument(
        "--waves",
        type=int,
        default=1,
        help="rounds over a group's runs on each stack (interleaved, the order "
        "reversed every other round)",
    )
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ensure_hf_model(args.hf_model)
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.runs}
    try:
        for repeat in range(args.repeats):
            for group in env_groups(args.runs):
                port, grpc_port = free_ports(2)
                command = [str(BIN / "llmserve"), "up", "--model", MODEL, "--dtype", args.dtype,
                           "--grpc-port", str(grpc_port), "--http-port", str(port)]  # fmt: skip
                server = Server(group[0], group[0], command, port, MODEL)
                env = {"LLMSERVE_NUM_THREADS": str(args.threads), **RUNS[group[0]].env}
                # The first wave primes the prefix cache and is not counted (see above).
                order = [(group[0], f"{group[0]}-{repeat}-prime")] + [
                    (name, f"{name}-{repeat}-{wave}")
                    for wave in range(args.waves)
                    for name in (group if wave % 2 == 0 else group[::-1])
                ]
                clients = [
                    (client(server, RUNS[name], name, label, args),
                     args.out_dir / "runs" / f"{label}.json")
                    for name, label in order
                ]  # fmt: skip
                summaries = measure_clients(server, clients, args, env)
                for (name, _), summary in zip(order[1:], summaries[1:], strict=True):
                    results[name].append(summary)
    except (KeyboardInterrupt, SystemExit):
        print("stopped; reporting the runs that finished")
    text = report(results)
    header = f"$ {shown([sys.executable, *sys.argv])}\n\n"
    (args.out_dir / "grammar-serve.md").write_text(header + text + "\n")
    (args.out_dir / "grammar-serve.json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
