"""Are a drafting server's outputs the plain server's, token for token and logprob for logprob?
(issue #28: "Same output, always").

Starts two `llmserve up` stacks side by side on SmolLM2's GGUF blocks (as bench/spec_decode.py
does): one without drafts and one with them (K = 8, n-grams 2-6, plus `--spec-env`
variables, e.g. LLMSERVE_ASYNC_SCHEDULING=false), both idle but for the request at hand. Each
of `--num-prompts` random-token prompts (bench/spec_decode.py's `random` workload: seeded
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
from serve_compare import BIN, stop, wait_healthy
from spec_decode import MODEL, parse_args, workload_bodies

from llmserve.supervisor import free_ports


def start(spec_env: dict[str, str] | None, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """An `llmserve up` stack (drafting when `spec_env` is given) and its base URL."""
    http, grpc = free_ports(2)
    env = {**os.environ, "LLMSERVE_SERVED_MODEL_NAME": MODEL, "LLMSERVE_NUM_THREADS": "2",
           "LLMSERVE_LINEAR_IMPL": "gguf", "LLMSERVE_QUANT_MODE": "exact"}  # fmt: skip
    if spec_env is not None:
        env |= {"LLMSERVE_NUM_SPECULATIVE_TOKENS": "8", "LLMSERVE_NGRAM_MIN": "2",
                "LLMSERVE_NGRAM_MAX": "6", **spec_env}  # fmt: skip
    command = [str(BIN / "llmserve"), "up", "--model", MODEL, "--grpc-port", str(grpc),
               "--http-port", str(http), "--dtype", "float32"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{http}/v1"


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
    stacks = [start(None, args.out_dir / "plain.log"), start(spec_env, args.out_dir / "spec.log")]
    differed = 0
    try:
        for proc, url in stacks:
            wait_healthy(proc, f"{url.removesuffix('/v1')}/health", 300.0)
        with httpx.Client(timeout=600.0) as client:
            for _, url in stacks:  # the scheduler needs its worker ready, not only up
                for _ in range(120):
                    try:
                        complete(client, url, {**bodies[0], "max_tokens": 2})
                        break
                    except httpx.HTTPError:
                        time.sleep(1.0)
            for i, body in enumerate(bodies):
                plain, spec = (complete(client, url, body) for _, url in stacks)
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
        for proc, _ in stacks:
            stop(proc)
    print(f"{differed} of {len(bodies)} prompts differed (spec env: {spec_env or 'none'})")
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
