"""bench/spec_decode.py's report: the table of a run, one row per workload and server."""

from __future__ import annotations

import argparse
from typing import Any


def plain_of(name: str) -> str | None:
    """The server without speculation that server `name` compares with (None: `name` drafts
    nothing): "llmserve-spec" and "llmserve-spec-continue" -> "llmserve"."""
    base, spec, _ = name.partition("-spec")
    return base if spec else None


def spec_cells(s: dict[str, Any], name: str) -> list[str]:
    """drafts | draft tokens | accepted | acceptance | mean accepted length per draft."""
    if plain_of(name) is None:
        return ["-"] * 5
    if name.startswith("llama"):
        drafts, drafted, accepted = None, s["llama_draft_n"], s["llama_draft_n_accepted"]
    elif c := s.get("spec"):
        drafts, drafted, accepted = c["drafts"], c["draft_tokens"], c["accepted_tokens"]
    else:
        return ["n/a"] * 5
    rate = f"{accepted / drafted:.2f}" if drafted else "-"
    length = f"{1 + accepted / drafts:.2f}" if drafts else "-"
    count = "-" if drafts is None else f"{drafts:.0f}"
    return [count, f"{drafted:.0f}", f"{accepted:.0f}", rate, length]


def report(result: dict[str, Any], args: argparse.Namespace, random_input_len: int) -> str:
    """The markdown report of a run (`random_input_len`: the random workload's prompt length)."""
    rows, notes = [], []
    for workload, runs in result["runs"].items():
        for name, s in runs.items():
            if "error" in s:
                rows.append(f"| {workload} | {name} | {s['error']} |" + " |" * 11)
                continue
            plain = runs.get(plain_of(name) or "", {})
            base = plain.get("output_tokens_per_s")
            speedup = f"{s['output_tokens_per_s'] / base:.2f}x" if base else "-"
            decode, decode_base = s.get("decode_tokens_per_s"), plain.get("decode_tokens_per_s")
            decode_speedup = f"{decode / decode_base:.2f}x" if decode and decode_base else "-"
            tpot = f"{s['tpot_ms_p50']:.1f}" if s["tpot_ms_p50"] else "-"
            cells = [workload, name, f"{s['outputs']}/{s['prompts']}", str(s["repeating"]),
                     f"{s['output_tokens_per_s']:.1f}", f"{decode:.1f}" if decode else "-",
                     tpot, *spec_cells(s, name), speedup, decode_speedup]  # fmt: skip
            rows.append(f"| {' | '.join(cells)} |")
        for spec, same in result["identical"].get(workload, {}).items():
            if same:
                notes.append(f"- {workload}: {spec} vs {plain_of(spec)}: identical {same}")
    loads = {name: s["contention"] for runs in result["runs"].values() for name, s in runs.items()}
    notes += [f"- {name}: load before / others' cores {load}" for name, load in loads.items()]
    commands = {c: None for runs in result["runs"].values() for s in runs.values()
                for c in s.get("commands", [])[:1]}  # fmt: skip
    return "\n".join([
        f"SmolLM2 GGUF as shipped, {args.threads} threads, 1 stream, greedy, max_tokens "
        f"{args.max_tokens}, {args.num_prompts} prompts per workload (code: "
        f"{result['code_source']}; text: stdlib module docstrings; random: {random_input_len} "
        f"random tokens, ignore_eos, seeded sampling at temperature 1). llmserve-spec: K={args.num_speculative_tokens}, n-gram "
        f"{args.ngram_min}-{args.ngram_max}; llama.cpp-spec: {args.llama_spec}.",
        "Repeating: outputs whose second half holds some 8-token window 3+ times. Acceptance: "
        "accepted / draft tokens; accepted/draft: 1 + accepted tokens / drafts (llmserve only: "
        "llama-server reports tokens, not drafts). n/a: the server reported no such figures. "
        "Load before: 1-minute load average at the server's start; others' cores: CPU time "
        "other jobs took while it ran, in cores.",
        "",
        "Decode tok/s: tokens after the first over the time after the first token (no prefill).",
        "",
        "| workload | server | outputs | repeating | tok/s | decode tok/s | TPOT p50 ms | drafts "
        "| draft tokens | accepted | acceptance | accepted/draft | vs no spec | decode vs no "
        "spec |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", *notes, "",
        "```", "$ " + result["command"], *("$ " + c for c in commands), "```",
    ])  # fmt: skip
