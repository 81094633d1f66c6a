"""The `llmserve` command: `up` (the whole stack), one service each, `generate` and `health`."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import importlib
import os
import sys
from typing import NoReturn

from llmserve.logs import configure_logging
from llmserve.security import add_security_flags, install, security_from_args
from llmserve.tool_parsers import TOOL_CALL_PARSERS

_SERVICES = {
    "worker": "worker_service.__main__",
    "scheduler": "scheduler_service.__main__",
    "gateway": "gateway.__main__",
}


def _up_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve up",
        description="Run worker(s), scheduler and gateway as separate processes on loopback.",
    )
    p.add_argument("--model", default="smollm2", help="model spec (default: embedded SmolLM2)")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="number of worker processes that prefill and decode (default 1, or 0 "
        "with --prefill-workers/--decode-workers)",
    )
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=0,
        help="disaggregated serving: workers that prefill long prompts and hand each "
        "request to a decode worker with its KV blocks (worker --role prefill)",
    )
    p.add_argument(
        "--decode-workers",
        type=int,
        default=0,
        help="disaggregated serving: workers that decode (worker --role decode)",
    )
    p.add_argument(
        "--schedulers",
        type=int,
        default=1,
        help="scheduler shards, each driving its share of the workers (worker i on "
        "shard i mod N); the gateway spreads requests over them",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    p.add_argument("--http-port", type=int, default=8000, help="gateway HTTP port (OpenAI API)")
    p.add_argument("--dtype", default=None, help="worker dtype (float32, bfloat16, float16)")
    p.add_argument(
        "--device",
        default=None,
        choices=["auto", "cpu", "cuda"],
        help="worker device; on CUDA each worker gets a GPU of its own",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per worker, the fraction of its GPU it may use (CUDA)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="workers run decode steps eagerly (no CUDA graphs)",
    )
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (workers)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest prompt + output (workers; default: the model's own length); the "
        "scheduler and the gateway take it from the workers",
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="workers quantize a float checkpoint's weights as they load it (CPU, float32); "
        "the formats are those of `llmserve worker --help`, which checks the name",
    )
    p.add_argument(
        "--quant-mode",
        default=None,
        help="how workers multiply on GGUF blocks: fast (the default) or exact (HF's model); "
        "see `llmserve worker --help`",
    )
    p.add_argument(
        "--linear-impl",
        default=None,
        help="workers' matmuls (auto, the default: a quantized GGUF file on its blocks); see "
        "`llmserve worker --help`",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="workers' K/V cache dtype (auto, the default: bfloat16 in fast mode on GGUF "
        "blocks, else the model's); see `llmserve worker --help`",
    )
    p.add_argument("--kv-cache-memory", type=float, default=None, help="per worker, GiB (CPU)")
    p.add_argument("--swap-space", type=float, default=None, help="per worker, GiB")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="speculative decoding: n-gram drafts per sequence and step (scheduler; "
        "0 = off, the default)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="multi-step decoding: tokens a decoding sequence computes in one step (scheduler; "
        "1 = off; see `llmserve scheduler --help`)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="tokens a request gathers before they are streamed (scheduler; 1, the default, "
        "sends each step's; see `llmserve scheduler --help`)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--api-key-file",
        default=None,
        help="the gateway's API keys, one a line (LLMSERVE_API_KEYS also works)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients use for the model, in requests, /v1/models and responses "
        "(gateway; default: --model)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template for models without one (base models)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the gateway's tool-call format (default: auto, read off the chat "
        "template); see `llmserve gateway --help`",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="the gateway's reasoning format: auto (the default, read off the chat "
        "template), none or think_tags; see `llmserve gateway --help`",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="variables every chat template rendering gets (gateway)",
    )
    p.add_argument(
        "--thinking-token-budget",
        default=None,
        metavar="N",
        help="thinking tokens a chat gets when it names no thinking_token_budget (gateway)",
    )
    # --tls-cert/--tls-key/--tls-ca (one certificate for every service: they all listen on
    # loopback) and --internal-token-file, passed to every service.
    add_security_flags(p)
    return p


def _passthrough(args: argparse.Namespace, names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None:
            out += [f"--{name}", str(value)]
    return out


_SECURITY_FLAGS = ["tls-cert", "tls-key", "tls-ca", "tls-server-name", "internal-token-file"]
# The flags `up` passes on, each to the service that owns it (and validates it).
_WORKER_FLAGS = [
    "dtype",
    "device",
    "gpu-memory-utilization",
    "block-size",
    "max-model-len",
    "quantization",
    "quant-mode",
    "linear-impl",
    "kv-cache-dtype",
    "kv-cache-memory",
    "swap-space",
    "log-level",
]
_SCHEDULER_FLAGS = [
    "num-gpu-blocks-override",
    "max-num-seqs",
    "max-num-batched-tokens",
    "num-speculative-tokens",
    "decode-steps",
    "stream-interval",
    "log-level",
]
_GATEWAY_FLAGS = [
    "log-level",
    "api-key-file",
    "served-model-name",
    "chat-template",
    "tool-call-parser",
    "reasoning-parser",
    "default-chat-template-kwargs",
    "thinking-token-budget",
]


def _run_up(argv: list[str]) -> int:
    from llmserve.supervisor import StackConfig, run_stack

    args = _up_parser().parse_args(argv)
    pools = args.prefill_workers + args.decode_workers
    if args.workers is None:
        args.workers = 0 if pools else 1
    if min(args.workers, args.prefill_workers, args.decode_workers) < 0:
        _up_parser().error("--workers, --prefill-workers and --decode-workers must be >= 0")
    if args.prefill_workers and not (args.workers or args.decode_workers):
        _up_parser().error(
            "--prefill-workers needs a worker to hand requests to (--decode-workers or --workers)"
        )
    roles = ["mixed"] * args.workers + ["prefill"] * args.prefill_workers
    roles += ["decode"] * args.decode_workers
    args.workers = len(roles)
    if args.workers < 1:
        _up_parser().error("--workers must be at least 1")
    if not 1 <= args.schedulers <= args.workers:
        _up_parser().error("--schedulers must be between 1 and --workers (each shard needs one)")
    try:
        # `up` itself dials every service's health with the same credentials.
        install(security_from_args(args))
    except ValueError as exc:
        _up_parser().error(str(exc))
    configure_logging("llmserve-up", args.log_level)
    from llmserve.supervisor import DeviceAssignmentError, assign_cuda_devices, visible_cuda_devices

    try:
        visible = [] if args.device == "cpu" else visible_cuda_devices()
        devices = assign_cuda_devices(args.workers, visible)
    except DeviceAssignmentError as exc:
        _up_parser().error(str(exc))
    secured = _passthrough(args, _SECURITY_FLAGS)
    config = StackConfig(
        model=args.model,
        num_workers=args.workers,
        worker_roles=roles,
        num_schedulers=args.schedulers,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        host=args.host,
        worker_args=_passthrough(args, _WORKER_FLAGS)
        + (["--enforce-eager"] if args.enforce_eager else [])
        + secured,
        worker_devices=devices,
        scheduler_args=_passthrough(args, _SCHEDULER_FLAGS) + secured,
        gateway_args=_passthrough(args, _GATEWAY_FLAGS) + secured,
        https=args.tls_cert is not None,
    )
    return asyncio.run(run_stack(config))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["up", *_SERVICES, "generate", "drain", "health"]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: llmserve {up,worker,scheduler,gateway,generate,drain,health} [options]\n\n"
            "  up         run the whole stack on this machine (default model: SmolLM2)\n"
            "  worker     run one worker service\n"
            "  scheduler  run the scheduler service\n"
            "  gateway    run the gateway (gRPC + OpenAI HTTP)\n"
            "  generate   stream a completion from a running gateway\n"
            "  drain      take a worker out of the fleet without failing a request\n"
            "  health     check a service's gRPC health (exit 0 when SERVING)\n\n"
            "`llmserve COMMAND --help` lists a command's options.",
            file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        return _run_up(rest)
    if command == "generate":
        from llmserve.generate_cli import main as generate_main

        return generate_main(rest)
    if command == "drain":
        from llmserve.drain_cli import main as drain_main

        return drain_main(rest)
    if command == "health":
        from llmserve.health_cli import main as health_main

        return health_main(rest)
    if command == "worker":
        # Before torch loads libgomp, which reads it once: torch's OpenMP threads sleep as
        # soon as a parallel region ends instead of spinning. The C++ kernels run on threads
        # of their own (llmserve_kernels/cpu/pool.h) between torch's regions, and spinning OpenMP
        # threads took the cores from them: prefills were slower spinning than passive, in
        # bfloat16 and in float32 beside oneDNN's matmuls (bench/RESULTS.md, "Figures moved
        # out of code comments").
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if command in ("gateway", "scheduler"):
        from llmserve.service_main import keep_triton_out

        keep_triton_out()  # they run no kernel (a worker decides once it knows its device)
    module = importlib.import_module(_SERVICES[command])
    _end_service_process(int(module.main(rest) or 0))


def _end_service_process(code: int) -> NoReturn:
    """A service has stopped: run the exit handlers (telemetry and log flushes), then leave
    without tearing the interpreter down. The teardown did nothing a stopped service needs
    and printed hundreds of nanobind "leaked" lines about Triton's native module, which
    torch loads in every process that touches torch._dynamo (transformers does), Triton
    kernels used or not."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
