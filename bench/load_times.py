"""How long a worker takes to load a model, and our GGUF header reader against the gguf
package's (the README's load figures).

Each round runs in a fresh Python process (`--child`), imports done before the clock starts:
- header: parsing the file's header and tensor table, llmserve/gguf_files.py's reader and
  `gguf.GGUFReader`;
- load: `Worker.load_model()` with the worker's defaults (the model's weights read, the
  blocks kept, the native step built), then its linear_impl and weight format.
Prints each model's median and range over --rounds rounds.

    .venv/bin/python bench/load_times.py [--models smollm2 gemma3-270m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _BENCH_DIR]
sys.path.insert(0, os.path.dirname(_BENCH_DIR))


def child(spec: str, threads: int) -> dict[str, object]:
    import torch
    from gguf import GGUFReader

    from llmserve.gguf_files import FastGGUFReader
    from llmserve.model_spec import resolve_model
    from worker_service.config import WorkerConfig
    from worker_service.worker import Worker

    torch.set_num_threads(threads)
    source = resolve_model(spec)
    out: dict[str, object] = {}
    if source.gguf_file:
        path = Path(source.path) / source.gguf_file
        for name, reader in (("ours_s", FastGGUFReader), ("gguf_s", GGUFReader)):
            start = time.perf_counter()
            reader(path)
            out[name] = time.perf_counter() - start
    worker = Worker(WorkerConfig(model=spec, num_threads=threads))
    start = time.perf_counter()
    worker.load_model()
    out["load_s"] = time.perf_counter() - start
    info = worker.model_info
    out["weights"] = f"{info.linear_impl}, {info.weight_format}, {info.weight_bytes / 1e6:.1f} MB"
    return out


def cell(runs: list[dict[str, object]], key: str) -> str:
    """`key`'s median over the runs, and its range."""
    values = [float(r[key]) for r in runs if key in r]  # type: ignore[arg-type]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.threads)))
        return
    from bench.machine import describe

    print(f"Machine: {describe()}; {args.rounds} rounds, each in a fresh process")
    print("| model | weights | worker load s | our header parse s | gguf package's s |")
    print("|---|---|---|---|---|")
    for spec in args.models:
        runs = []
        for _ in range(args.rounds):
            command = [sys.executable, __file__, "--child", spec, "--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))

        cells = [cell(runs, key) for key in ("load_s", "ours_s", "gguf_s")]
        print(f"| {spec} | {runs[0]['weights']} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
