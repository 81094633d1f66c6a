"""Who may call what: API keys for clients, an internal credential between the services, and
the one place every gRPC port is bound and every channel is dialled.

- Clients of the gateway send `authorization: Bearer KEY` (gRPC metadata or the HTTP
  header). Keys come from `--api-key` (visible in `ps`: prefer the others),
  `--api-key-file` (one key a line; blank lines and lines starting with `#` are skipped)
  and `LLMSERVE_API_KEYS` (separated by commas or white space); any of them is accepted.
- The services' own calls (the scheduler's and the worker's whole gRPC service: Connect,
  RegisterWorker, DrainWorker, Execute, ...) need the internal credential: a client
  certificate signed by `--tls-ca` when TLS is on (see llmserve.tls), and an internal token
  when one is set (`--internal-token-file`, or `LLMSERVE_INTERNAL_TOKEN`; the first token
  is sent, every one listed is accepted, so tokens rotate without downtime). Without TLS,
  set a token: otherwise anything that reaches the ports is trusted.
- grpc.health.v1 and reflection stay open on every port (no key or token; with TLS, the
  transport still wants a certificate): probes and `llmserve health` need no secret.
- Keys are compared with hmac.compare_digest against every key, and never logged: a
  `KeySet` prints as its size.

A service builds its `Security` once from its flags and the environment and `install`s it;
`aio_channel`/`channel`/`add_port` then apply it everywhere, so no hop can be dialled or
bound without it by forgetting a parameter.
"""

from __future__ import annotations

import argparse
import hmac
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmserve.errors import UnauthenticatedError, grpc_status
from llmserve.tls import TlsFiles, channel_credentials, server_credentials, tls_files
from llmserve.tls import channel_options as tls_channel_options

API_KEYS_ENV = "LLMSERVE_API_KEYS"
INTERNAL_TOKEN_ENV = "LLMSERVE_INTERNAL_TOKEN"
_BEARER = re.compile(rb"\s*bearer\s+(\S+)\s*", re.IGNORECASE)


def read_secrets(path: str) -> list[str]:
    """One secret a line; blank lines and `#` comment lines skipped. ValueError if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    return [s for line in lines if (s := line.strip()) and not s.startswith("#")]


class KeySet:
    """Secrets any of which is accepted. Prints as its size, never its contents."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = tuple(sorted({k.encode() for k in keys if k}))

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"KeySet({len(self._keys)} keys)"

    def __eq__(self, other: object) -> bool:  # two configurations' sets, never a client's key
        return isinstance(other, KeySet) and self._keys == other._keys

    def __hash__(self) -> int:
        return hash(self._keys)

    def accepts(self, given: bytes) -> bool:
        # Every key is compared, in constant time each: the time taken says nothing about
        # which key, or how much of one, matched.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return matched

    def accepts_authorization(self, header: str | bytes | None) -> bool:
        """Whether `authorization: Bearer KEY` carries one of the keys."""
        if header is None:
            return False
        raw = header.encode() if isinstance(header, str) else header
        m = _BEARER.fullmatch(raw)
        return m is not None and self.accepts(m.group(1))


@dataclass(frozen=True, slots=True)
class Security:
    """A process's credentials: its TLS files and the internal tokens (first one is sent)."""

    tls: TlsFiles | None = None
    internal_tokens: tuple[str, ...] = field(default=(), repr=False)

    @property
    def internal_keys(self) -> KeySet:
        return KeySet(self.internal_tokens)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("security", "TLS and the internal credential (llmserve.security)")
    g.add_argument("--tls-cert", default=None, help="this service's certificate chain (PEM)")
    g.add_argument("--tls-key", default=None, help="its private key (PEM)")
    g.add_argument(
        "--tls-ca",
        default=None,
        help="CA that signs every peer: with the two above, mutual TLS on every hop",
    )
    g.add_argument(
        "--tls-server-name",
        default=None,
        help="name to expect in the certificates of the servers this service dials "
        "(default: the dialled host)",
    )
    g.add_argument(
        "--internal-token-file",
        default=None,
        help=f"internal tokens, one a line (or {INTERNAL_TOKEN_ENV}): required on the "
        "scheduler's and workers' services, sent on this service's calls",
    )


def security_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Security:
    """ValueError naming the flag when a file is missing or TLS is half configured."""
    environ = os.environ if environ is None else environ
    tls = tls_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    tokens: list[str] = []
    if args.internal_token_file:
        try:
            tokens = read_secrets(args.internal_token_file)
        except ValueError as exc:
            raise ValueError(f"--internal-token-file: {exc}") from None
        if not tokens:
            raise ValueError("--internal-token-file: no token in the file")
    elif environ.get(INTERNAL_TOKEN_ENV):
        tokens = environ[INTERNAL_TOKEN_ENV].split()
    return Security(tls, tuple(tokens))


def api_keys_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> KeySet:
    """--api-key, --api-key-file and LLMSERVE_API_KEYS together (empty: no key required)."""
    environ = os.environ if environ is None else environ
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file:
        try:
            keys += read_secrets(args.api_key_file)
        except ValueError as exc:
            raise ValueError(f"--api-key-file: {exc}") from None
    keys += re.split(r"[\s,]+", environ.get(API_KEYS_ENV, "").strip())
    return KeySet(keys)


def parse_cli_security(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """For the operator commands (`llmserve health`, `llmserve drain`): the security flags,
    defaulting to the container's own `LLMSERVE_TLS_*` variables, parsed and installed."""
    from llmserve.config_env import EnvConfigError, apply_env_defaults

    add_security_flags(parser)
    try:
        apply_env_defaults(parser)
    except EnvConfigError as exc:
        parser.error(str(exc))
    args = parser.parse_args(list(argv))
    try:
        install(security_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))
    return args


# -- the process's security, applied to every port and channel --------------------------------

_installed = Security()


def install(security: Security) -> None:
    """Set the credentials of this process (once, at start-up, from its flags)."""
    global _installed
    _installed = security


def installed() -> Security:
    return _installed


def add_port(server: grpc.aio.Server, address: str, require_client_cert: bool = True) -> int:
    tls = _installed.tls
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls, require_client_cert))


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """A channel to another service with this process's TLS files and internal token."""
    token = next(iter(_installed.internal_tokens), None)
    interceptors = [] if not token else aio_bearer(token)
    tls = _installed.tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        channel_credentials(tls),
        options=[*options, *tls_channel_options(tls)],
        interceptors=interceptors,
    )


def channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """The blocking counterpart of `aio_channel`."""
    token = next(iter(_installed.internal_tokens), None)
    tls = _installed.tls
    if tls is None:
        ch = grpc.insecure_channel(address, options=options)
    else:
        ch = grpc.secure_channel(
            address, channel_credentials(tls), options=[*options, *tls_channel_options(tls)]
        )
    return grpc.intercept_channel(ch, SyncBearer(token)) if token else ch


# -- server side -------------------------------------------------------------------------------


def internal_auth(services: Iterable[str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor that guards a service's own RPCs with the internal token, if one is
    set (with TLS alone, the client certificate the port requires is the credential)."""
    tokens = _installed.internal_keys
    return [AuthInterceptor(tokens, services, "internal token")] if len(tokens) else []


def service_of(method: str) -> str:
    """`/llmserve.v1.Worker/Execute` -> `llmserve.v1.Worker`."""
    return method.lstrip("/").split("/", 1)[0]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, calls to `services` whose `authorization` metadata
    carries none of `keys`. Other services (health, reflection) pass untouched."""

    def __init__(self, keys: KeySet, services: Iterable[str], what: str = "API key") -> None:
        self.keys = keys
        self.services = frozenset(services)
        self.what = what

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or service_of(details.method) not in self.services:
            return handler
        given = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        if len(given) == 1 and self.keys.accepts_authorization(given[0]):
            return handler
        return _refusal(
            handler,
            UnauthenticatedError(f"incorrect or missing {self.what} (authorization: Bearer ...)"),
        )


def _refusal(handler: grpc.RpcMethodHandler, exc: UnauthenticatedError) -> grpc.RpcMethodHandler:
    code, message = grpc_status(exc)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        if getattr(handler, kind):
            return make(refuse, handler.request_deserializer, handler.response_serializer)
    raise AssertionError("a handler of no kind")


# -- client side: the bearer token on every call -----------------------------------------------


def _with_bearer(details: Any, token: str) -> Any:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata["authorization"] = f"Bearer {token}"
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


def aio_bearer(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that send `authorization: Bearer token` on every call of a channel."""

    # grpc.aio files an interceptor under the first of the four kinds it is an instance of,
    # so one class per kind.
    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(_with_bearer(details, token), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
            return await continuation(_with_bearer(details, token), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
            return await continuation(_with_bearer(details, token), requests)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
            return await continuation(_with_bearer(details, token), requests)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]


@dataclass(frozen=True, slots=True)
class _SyncDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """`aio_bearer` for blocking channels (grpc.intercept_channel)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, d: Any) -> _SyncDetails:
        metadata = [*(d.metadata or ()), ("authorization", f"Bearer {self._token}")]
        return _SyncDetails(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            d.wait_for_ready,
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), requests)
