"""bench/spec_decode.py's report: the table of a run, one row per workload and server."""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def plain_of(name: str) -> str | None:
    """The server without speculation that server `name` compares with (None: `name` drafts
    nothing): "llmserve-spec" and "llmserve-spec-continue" -> "llmserve"."""
    base, spec, _ = name.partition("-spec")
    return base if spec else None


# Summary fields that add up over rounds (bench/spec_decode.py's client summary).
_SUMS = ("prompts", "outputs", "errors", "duration_s", "output_tokens", "decode_tokens",
         "decode_s", "repeating", "llama_draft_n", "llama_draft_n_accepted")  # fmt: skip


def pool(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's summaries of a workload over several rounds as one: counts and times
    summed, rates taken over the sums, TPOT p50 the median of the rounds' (the first error,
    if a round failed)."""
    if len(summaries) == 1:
        return summaries[0]
    failed = [s for s in summaries if "error" in s]
    if failed:
        return failed[0]
    out: dict[str, Any] = {key: sum(s[key] for s in summaries) for key in _SUMS}
    out["output_tokens_per_s"] = out["output_tokens"] / out["duration_s"]
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["decode_s"] if out["decode_s"] else None
    tpots = [s["tpot_ms_p50"] for s in summaries if s["tpot_ms_p50"] is not None]
    out["tpot_ms_p50"] = statistics.median(tpots) if tpots else None
    counters = [s.get("spec") for s in summaries]
    if all(counters):
        out["spec"] = {k: sum(c[k] for c in counters) for k in counters[0]}
    out["contention"] = "; ".join(s["contention"] for s in summaries)
    out["commands"] = summaries[0].get("commands", [])
    return out


def pool_rounds(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{workload: {server: summary}} pooled over the rounds a server ran in (`pool`; a run
    stopped early leaves its last round short)."""
    if not rounds:
        return {}
    pooled: dict[str, dict[str, Any]] = {}
    for workload in rounds[0]:
        names = dict.fromkeys(name for r in rounds for name in r[workload])
        pooled[workload] = {
            name: pool([r[workload][name] for r in rounds if name in r[workload]]) for name in names
        }
    return pooled


def round_ratios(result: dict[str, Any]) -> list[str]:
    """A note per workload and server with drafts: its output (and decode) tok/s over its
    plain server's, round by round."""
    rounds = result.get("rounds", [])
    if len(rounds) < 2:
        return []
    notes = []
    for workload, runs in result["runs"].items():
        for name in runs:
            plain = plain_of(name)
            if plain is None or plain not in runs:
                continue
            cells = []
            for r in rounds:
                s, base = r[workload].get(name), r[workload].get(plain)
                if s is None or base is None:
                    continue
                if "error" in s or "error" in base:
                    cells.append("failed")
                    continue
                ratio = s["output_tokens_per_s"] / base["output_tokens_per_s"]
                decode = s["decode_tokens_per_s"] / base["decode_tokens_per_s"]
                cells.append(f"{ratio:.2f}x ({decode:.2f}x)")
            notes.append(f"- {workload}: {name} vs {plain} by round, output (decode) tok/s: "
                         f"{', '.join(cells)}")  # fmt: skip
    return notes


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
    notes += round_ratios(result)
    loads = {name: s["contention"] for runs in result["runs"].values() for name, s in runs.items()}
    notes += [f"- {name}: load before / others' cores {load}" for name, load in loads.items()]
    commands = {c: None for runs in result["runs"].values() for s in runs.values()
                for c in s.get("commands", [])[:1]}  # fmt: skip
    return "\n".join([
        f"SmolLM2 GGUF as shipped, {args.threads} threads, 1 stream, greedy, max_tokens "
        f"{args.max_tokens}, {args.num_prompts} prompts per workload"
        f"{f', {args.rounds} rounds pooled' if args.rounds > 1 else ''} (code: "
        f"{result['code_source']}; text: proofreading stdlib docstring paragraphs; random: {random_input_len} "
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
