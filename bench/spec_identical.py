"""Are a drafting server's outputs the plain server's, token for token and logprob for logprob?
(issue #28: "Same output, always").

Starts two `llmserve up` stacks side by side, bench/spec_decode.py's `llmserve` and
`llmserve-spec` (SmolLM2's GGUF blocks; K = 8, n-grams 2-6), the drafting one with the
`--spec-env` variables added (e.g. LLMSERVE_ASYNC_SCHEDULING=false), both idle but for the
request at hand. Each of `--num-prompts` random-token prompts (bench/spec_decode.py's `random` workload: seeded
sampling at temperature 1, ignore_eos, `--max-tokens`) goes to one server, then the other,
with `logprobs: 1`. A seeded request must give the same tokens with and without drafts, and,
since a draft row computes what the row alone would, the same logprobs. Prints each prompt
whose logprobs or text differ: the first token whose logprob differs (a K/V or logits
difference shows there first, often long before the text parts) and the first token that
differs; writes both responses to <out-dir>/prompt-<i>.json. Exits 1 if any prompt differed.

    .venv/bin/python bench/spec_identical.py --num-prompts 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from server_runs import Server, stop, wait_healthy
from spec_decode import parse_args, server_for
from spec_report import plain_of
from spec_workloads import MODEL, workload_bodies


def start(
    name: str, args: argparse.Namespace, spec_env: dict[str, str], log: Path
) -> tuple[Server, subprocess.Popen[bytes]]:
    """`llmserve` or `llmserve-spec` as bench/spec_decode.py starts it (`spec_env` added to the
    drafting one's environment), and its process."""
    server, env = server_for(name, args)
    if plain_of(name):
        env |= spec_env
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server.command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    return server, proc


def complete(client: httpx.Client, base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One non-streamed completion with a logprob per token: its first choice."""
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    response = client.post(f"{base_url}/completions", json={**body, "logprobs": 1})
    response.raise_for_status()
    return response.json()["choices"][0]


def first_difference(a: list[Any], b: list[Any]) -> int | None:
    """The first index where `a` and `b` differ (the shorter one's length if one is a prefix
    of the other), None if they are equal."""
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if index is None and len(a) != len(b):
        return min(len(a), len(b))
    return index


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=7, help="the prompts' and the requests' seeds")
    p.add_argument("--spec-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more environment for the drafting stack")  # fmt: skip
    p.add_argument("--hf-model", type=Path, default=Path(f"/tmp/bench/{MODEL}-hf"))
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench/spec-identical"))
    args = p.parse_args()
    from transformers import AutoTokenizer

    workload = parse_args(["--num-prompts", str(args.num_prompts), "--max-tokens",
                           str(args.max_tokens), "--seed", str(args.seed)])  # fmt: skip
    bodies = workload_bodies("random", workload, AutoTokenizer.from_pretrained(args.hf_model))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spec_env = dict(item.split("=", 1) for item in args.spec_env)
    stacks = [
        start(name, workload, spec_env, args.out_dir / f"{name}.log")
        for name in ("llmserve", "llmserve-spec")
    ]
    differed = 0
    try:
        for server, proc in stacks:
            wait_healthy(proc, server.health_url, 300.0)
        with httpx.Client(timeout=600.0) as client:
            for server, _ in stacks:  # the scheduler needs its worker ready, not only up
                for _ in range(120):
                    try:
                        complete(client, server.base_url, {**bodies[0], "max_tokens": 2})
                        break
                    except httpx.HTTPError:
                        time.sleep(1.0)
            for i, body in enumerate(bodies):
                plain, spec = (complete(client, server.base_url, body) for server, _ in stacks)
                logprob_at = first_difference(
                    plain["logprobs"]["token_logprobs"], spec["logprobs"]["token_logprobs"]
                )
                token_at = first_difference(plain["logprobs"]["tokens"], spec["logprobs"]["tokens"])
                if logprob_at is None and token_at is None:
                    continue
                differed += 1
                print(f"prompt {i} (seed {body['seed']}): first logprob difference at token "
                      f"{logprob_at}, first token difference at {token_at}", flush=True)  # fmt: skip
                record = {"body": body, "plain": plain, "spec": spec}
                (args.out_dir / f"prompt-{i}.json").write_text(json.dumps(record, indent=1))
    finally:
        for _, proc in stacks:
            stop(proc)
    print(f"{differed} of {len(bodies)} prompts differed (spec env: {spec_env or 'none'})")
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
