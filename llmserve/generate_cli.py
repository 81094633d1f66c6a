"""`llmserve generate`: stream one completion to the terminal, or run a JSONL file of prompts
through the stack (`--input prompts.jsonl --output out.jsonl`, with a progress bar).

Each input line is {"prompt": "..."} or {"messages": [...]} with optional per-line sampling
fields (max_tokens, temperature, seed, n, stop, ...) that override the flags.

The API key comes from --api-key-file or LLMSERVE_API_KEY (no flag for the key itself: a
command line shows in `ps`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc

from llmserve.client import AsyncClient, Client
from llmserve.security import read_secrets
from llmserve.tls import ClientTls

CLIENT_API_KEY_ENV = "LLMSERVE_API_KEY"

_SAMPLING_FIELDS = {
    "n",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "logprobs",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="llmserve generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", nargs="?", help="the prompt (omit with --input)")
    p.add_argument("--address", default="localhost:50051", help="gateway gRPC host:port")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--input", type=Path, help="JSONL file of prompts")
    p.add_argument("--output", type=Path, help="JSONL file for the results (with --input)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (--input)")
    p.add_argument(
        "--api-key-file",
        default=None,
        help=f"file whose first key is sent (default: ${CLIENT_API_KEY_ENV})",
    )
    p.add_argument("--tls-ca", default=None, help="dial over TLS, checking the gateway against it")
    p.add_argument("--tls-cert", default=None, help="client certificate (with --tls-ca)")
    p.add_argument("--tls-key", default=None, help="its private key")
    args = p.parse_args(argv)
    try:
        args.connection = _connection(args)
    except ValueError as exc:
        p.error(str(exc))
    if (args.prompt is None) == (args.input is None):
        p.error("give either a prompt or --input")
    if args.input is not None and args.output is None:
        p.error("--input needs --output")
    return args


def _connection(args: argparse.Namespace) -> dict[str, Any]:
    """The client's api_key and tls arguments, from the flags and the environment."""
    key = os.environ.get(CLIENT_API_KEY_ENV) or None
    if args.api_key_file:
        keys = read_secrets(args.api_key_file)
        if not keys:
            raise ValueError(f"--api-key-file: no key in {args.api_key_file}")
        key = keys[0]
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_ca is None and args.tls_cert is not None:
        raise ValueError("--tls-cert: needs --tls-ca")
    tls = None
    if args.tls_ca is not None:
        tls = ClientTls(
            Path(args.tls_ca), *(Path(p) if p else None for p in (args.tls_cert, args.tls_key))
        )
    return {"api_key": key, "tls": tls}


def _sampling(args: argparse.Namespace, line: dict[str, Any] | None = None) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": args.temperature, "top_p": args.top_p}
    if args.max_tokens is not None:
        sampling["max_tokens"] = args.max_tokens
    if args.seed is not None:
        sampling["seed"] = args.seed
    for key, value in (line or {}).items():
        if key in _SAMPLING_FIELDS:
            sampling[key] = value
    return sampling


def _stream_one(args: argparse.Namespace) -> int:
    kwargs: dict[str, Any] = {"stop": args.stop, **_sampling(args)}
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        prompt = None
    else:
        prompt = args.prompt
    with Client(args.address, **args.connection) as client:
        for chunk in client.generate(prompt, **kwargs):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


async def _run_file(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    lines = [json.loads(raw) for raw in args.input.read_text().splitlines() if raw.strip()]
    results: list[dict[str, Any] | None] = [None] * len(lines)
    semaphore = asyncio.Semaphore(max(1, args.concurrency))
    failures = 0

    async with AsyncClient(args.address, **args.connection) as client:
        progress = tqdm(total=len(lines), unit="req", file=sys.stderr)

        async def one(i: int, line: dict[str, Any]) -> None:
            nonlocal failures
            kwargs: dict[str, Any] = {"stop": line.get("stop", args.stop), **_sampling(args, line)}
            if "messages" in line:
                kwargs["messages"] = line["messages"]
            async with semaphore:
                try:
                    done = await client.complete(line.get("prompt"), **kwargs)
                    results[i] = {
                        "index": i,
                        "choices": done.choices,
                        "finish_reasons": done.finish_reasons,
                        "usage": {
                            "prompt_tokens": done.prompt_tokens,
                            "completion_tokens": done.completion_tokens,
                        },
                    }
                except (grpc.aio.AioRpcError, ValueError) as exc:
                    failures += 1
                    message = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                    results[i] = {"index": i, "error": message}
            progress.update(1)

        await asyncio.gather(*(one(i, line) for i, line in enumerate(lines)))
        progress.close()
    with args.output.open("w") as out:
        for result in results:
            out.write(json.dumps(result) + "\n")
    print(f"{len(lines) - failures} done, {failures} failed -> {args.output}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        if args.input is not None:
            return asyncio.run(_run_file(args))
        return _stream_one(args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except (ValueError, OSError) as exc:
        # An invalid flag value (SamplingParamsError names it), a bad --input file.
        print(f"error: {exc}", file=sys.stderr)
        return 2
