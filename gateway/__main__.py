"""`llmserve gateway`: the public gRPC API and the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import TYPE_CHECKING, Any

from gateway.reasoning import REASONING_PARSERS
from llmserve.config_env import parse_service_args
from llmserve.limits import add_limit_flags, limits_from_args
from llmserve.logs import get_logger
from llmserve.service_main import add_common_flags, start_service
from llmserve.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from gateway.server import GatewayConfig

log = get_logger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from gateway.server import GatewayConfig

    defaults = GatewayConfig()  # every flag's default is the config's
    p = argparse.ArgumentParser(prog="llmserve gateway", description=__doc__)
    add_common_flags(p, default_port=defaults.grpc_port)
    p.add_argument(
        "--http-port",
        type=int,
        default=defaults.http_port,
        help="OpenAI-compatible API, /health and /metrics (0 disables HTTP)",
    )
    p.add_argument(
        "--scheduler",
        default=defaults.scheduler_address,
        help="scheduler host:port; several comma-separated for scheduler shards "
        "(each owns its own workers): requests go to a shard by prompt prefix and "
        "load, and a lost shard's requests continue on the others",
    )
    p.add_argument("--model", default=defaults.model, help="model spec (for the tokenizer)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="name clients use for the model (default: the model spec)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'authorization: Bearer KEY' on the HTTP and gRPC APIs; shows "
        "in `ps`, so prefer --api-key-file, LLMSERVE_API_KEY or LLMSERVE_API_KEYS",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="API keys, one a line ('#' lines are comments); any key given by "
        "--api-key, this file or LLMSERVE_API_KEYS (comma-separated) is accepted",
    )
    p.add_argument(
        "--tls-require-client-cert",
        action=argparse.BooleanOptionalAction,
        default=defaults.tls_require_client_cert,
        help="with TLS, API clients too must present a certificate signed by "
        "--tls-ca (--no-tls-require-client-cert: keys alone, over TLS)",
    )
    p.add_argument(
        "--max-pending-requests",
        type=int,
        default=defaults.max_pending_requests,
        help="generation requests in flight (HTTP and gRPC) before new ones are "
        "refused at once: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=defaults.request_timeout_s,
        help="a request still running after this long is aborted (504 / "
        "DEADLINE_EXCEEDED) and its blocks freed; a gRPC deadline may be shorter",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=defaults.shutdown_grace_s,
        help="on SIGTERM: health turns NOT_SERVING, new requests get 503 / "
        "UNAVAILABLE, and those in flight have this long to finish",
    )
    p.add_argument(
        "--scheduler-reconnect-timeout-s",
        type=float,
        default=defaults.scheduler_reconnect_timeout_s,
        help="when the scheduler stream breaks, requests in flight wait this long "
        "for it to come back (they are re-submitted and continue), then fail 503",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the tokenizer's (a model "
        "without one answers chat requests with 400)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=defaults.tool_call_parser,
        choices=TOOL_CALL_PARSERS,
        help="how chats with tools are prompted and their calls parsed: hermes "
        "(<tool_call> blocks: Hermes, Qwen), llama3_json (Llama 3.x JSON calls), "
        "generic (tools in the system prompt, a JSON envelope), or auto: read off "
        "the chat template (one that never uses `tools` gets generic)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=defaults.reasoning_parser,
        choices=REASONING_PARSERS,
        help="how a chat's reasoning is told from its answer (message.reasoning_content): "
        "think_tags (<think>...</think>: Qwen3, DeepSeek-R1, also when the template opens "
        "the block in the prompt), harmony (gpt-oss's analysis and final channels; no "
        "tools), none, or auto: harmony when the chat template writes <|channel|> and "
        "<|message|>, think_tags when it writes both think tags",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="variables every chat template rendering gets, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs override them",
    )
    p.add_argument(
        "--thinking-token-budget",
        type=int,
        default=defaults.thinking_token_budget,
        metavar="N",
        help="tokens a chat's reasoning may take when the request names no "
        "thinking_token_budget; the scheduler then closes the block (needs a reasoning "
        "parser). Default: no bound but max_tokens",
    )
    add_limit_flags(p)
    return parse_service_args(p, argv, validate)


def template_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """--default-chat-template-kwargs, parsed; ValueError naming the flag."""
    from gateway.tokenization import check_template_kwargs
    from llmserve.errors import FieldError

    if args.default_chat_template_kwargs is None:
        return {}
    flag = "--default-chat-template-kwargs"
    try:
        return check_template_kwargs(json.loads(args.default_chat_template_kwargs), flag)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON: {exc}") from None
    except FieldError as exc:
        raise ValueError(str(exc)) from None


def validate(args: argparse.Namespace) -> None:
    """What --check-config checks beyond the parser."""
    from llmserve.errors import ModelNotFoundError
    from llmserve.model_spec import resolve_model
    from llmserve.security import api_keys_from_args
    from llmserve.service_main import check_security, shard_addresses

    check_security(args)
    api_keys_from_args(args)
    limits_from_args(args)  # each limit at least 1
    if args.max_pending_requests < 1:
        raise ValueError("--max-pending-requests: must be at least 1")
    if args.thinking_token_budget is not None and args.thinking_token_budget < 0:
        raise ValueError("--thinking-token-budget: must be at least 0")
    shard_addresses(args.scheduler)
    if args.metrics_port is not None and args.metrics_port == args.http_port:
        raise ValueError("--metrics-port: the HTTP port already serves /metrics")
    try:
        resolve_model(args.model)
    except ModelNotFoundError as exc:
        raise ValueError(f"model: {exc}") from None
    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    check_tool_call_parser(args.tool_call_parser, template, args.model)
    template_kwargs_from_args(args)


def check_tool_call_parser(name: str, template: str | None, model: str) -> None:
    """ValueError naming --tool-call-parser when a template-native format meets a chat
    template (the --chat-template one, else the model's) that never renders tools."""
    from gateway.tokenization import Tokenization
    from gateway.tool_formats import tool_format
    from llmserve.model_spec import load_tokenizer, resolve_model

    if name in ("auto", "generic"):
        return  # any template will do
    if template is not None:
        tool_format(name, template)
    else:
        Tokenization(load_tokenizer(resolve_model(model)), None, name)


def read_chat_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {path!r}: {exc.strerror}") from None


def build_config(args: argparse.Namespace) -> GatewayConfig:
    from gateway.server import GatewayConfig
    from llmserve.security import api_keys_from_args

    return GatewayConfig(
        host=args.host,
        grpc_port=args.port,
        http_port=args.http_port,
        scheduler_address=args.scheduler,
        model=args.model,
        served_model_name=args.served_model_name or args.model,
        # Empty (an unset `LLMSERVE_API_KEY: ${KEY:-}` in compose) means no key, not "".
        api_keys=api_keys_from_args(args),
        tls_require_client_cert=args.tls_require_client_cert,
        max_pending_requests=args.max_pending_requests,
        max_message_bytes=args.max_message_bytes,
        scheduler_reconnect_timeout_s=args.scheduler_reconnect_timeout_s,
        limits=limits_from_args(args),
        request_timeout_s=args.request_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
        chat_template=None
        if args.chat_template is None
        else read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        default_chat_template_kwargs=template_kwargs_from_args(args),
        thinking_token_budget=args.thinking_token_budget,
    )


def main(argv: list[str]) -> int:
    from gateway.server import serve

    args = parse_args(argv)
    start_service("gateway", args)
    asyncio.run(serve(build_config(args)))
    return 0
