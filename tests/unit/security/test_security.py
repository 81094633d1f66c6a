"""llmserve.security and llmserve.tls in one process: keys, the internal token on every kind
of call, mutual TLS with a CA made here, and certificate reload."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve import security
from llmserve.devcerts import DevCA, make_dev_pki
from llmserve.grpc_utils import create_server
from llmserve.security import KeySet, Security
from llmserve.tls import tls_files
from llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc

SCHEDULER = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


def test_secrets_file_skips_blank_and_comment_lines(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("# team A\nkey-one\n\n  key-two  \n#key-three\nkey#four\n")
    assert security.read_secrets(str(path)) == ["key-one", "key-two", "key#four"]
    with pytest.raises(ValueError, match="cannot read"):
        security.read_secrets(str(tmp_path / "missing"))


def test_keyset_accepts_any_of_its_keys_and_nothing_else():
    keys = KeySet(["alpha-key", "beta-key", ""])
    assert len(keys) == 2
    assert keys.accepts_authorization("Bearer alpha-key")
    assert keys.accepts_authorization(b"bearer beta-key")
    for header in (
        None,
        "",
        "Bearer",
        "Bearer alpha",
        "Bearer alpha-key2",
        "Basic alpha-key",
        "alpha-key",
        "Bearer alpha-key beta-key",
    ):
        assert not keys.accepts_authorization(header), header
    assert "alpha" not in repr(keys) and "beta" not in repr(keys)
    # Equal when they accept the same keys (two configurations compared), whatever the order.
    assert keys == KeySet(["beta-key", "alpha-key"]) and keys != KeySet(["alpha-key"])
    assert KeySet() == KeySet([""]) and len({keys, KeySet(["beta-key", "alpha-key"])}) == 1


def _args(**values: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    security.add_security_flags(parser)
    parser.add_argument("--api-key")
    parser.add_argument("--api-key-file")
    ns = parser.parse_args([])
    for key, value in values.items():
        setattr(ns, key, value)
    return ns


def test_api_keys_come_from_the_flag_the_file_and_the_environment(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("from-file-1\nfrom-file-2\n")
    keys = security.api_keys_from_args(
        _args(api_key="from-flag", api_key_file=str(path)),
        {"LLMSERVE_API_KEYS": "from-env-1, from-env-2"},
    )
    assert len(keys) == 5
    for key in ("from-flag", "from-file-1", "from-file-2", "from-env-1", "from-env-2"):
        assert keys.accepts_authorization(f"Bearer {key}")
    assert len(security.api_keys_from_args(_args(), {})) == 0


def test_internal_token_from_file_or_environment(tmp_path: Path):
    path = tmp_path / "token"
    path.write_text("# rotate: new first\nnew-token\nold-token\n")
    from_file = security.security_from_args(_args(internal_token_file=str(path)), {})
    assert from_file.internal_tokens == ("new-token", "old-token")
    assert "new-token" not in repr(from_file)
    from_env = security.security_from_args(_args(), {"LLMSERVE_INTERNAL_TOKEN": "env-token"})
    assert from_env.internal_tokens == ("env-token",)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="--internal-token-file"):
        security.security_from_args(_args(internal_token_file=str(tmp_path / "empty")), {})


def test_half_a_tls_configuration_is_refused_naming_the_flag(tmp_path: Path):
    files = make_dev_pki(tmp_path)["scheduler"]
    with pytest.raises(ValueError, match="--tls-ca"):
        tls_files(str(files.cert), str(files.key), None)
    with pytest.raises(ValueError, match="--tls-key: cannot read"):
        tls_files(str(files.cert), str(tmp_path / "nope.key"), str(tmp_path / "ca.pem"))
    assert tls_files(None, None, None) is None


# -- a real server: the scheduler's service, answering GetStats and Connect with nothing -------


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def GetStats(self, request, context):  # type: ignore[no-untyped-def]
        return scheduler_pb2.GetStatsResponse()

    async def Connect(self, requests, context):  # type: ignore[no-untyped-def]
        async for _ in requests:
            pass
        return
        yield


@pytest.fixture(autouse=True)
def _restore_installed() -> Iterator[None]:
    before = security.installed()
    yield
    security.install(before)


@asynccontextmanager
async def serving(
    server_security: Security, require_client_cert: bool = True
) -> AsyncIterator[str]:
    security.install(server_security)
    server, health = create_server([SCHEDULER], interceptors=security.internal_auth([SCHEDULER]))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(_Scheduler(), server)
    port = security.add_port(server, "127.0.0.1:0", require_client_cert)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def codes(address: str, client_security: Security) -> dict[str, grpc.StatusCode]:
    """The status of a unary call, a bidirectional stream and a health check."""
    security.install(client_security)
    out: dict[str, grpc.StatusCode] = {}
    async with security.aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
            out["unary"] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            out["unary"] = exc.code()
        call = stub.Connect(timeout=5)
        with contextlib.suppress(Exception):  # a call that already failed refuses the close
            await call.done_writing()
        out["stream"] = await call.code()
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            out["health"] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            out["health"] = exc.code()
    return out


def test_internal_token_guards_the_service_and_leaves_health_open():
    async def run() -> None:
        async with serving(Security(internal_tokens=("new", "old"))) as address:
            passed = {
                "unary": grpc.StatusCode.OK,
                "stream": grpc.StatusCode.OK,
                "health": grpc.StatusCode.OK,
            }
            refused = {
                "unary": grpc.StatusCode.UNAUTHENTICATED,
                "stream": grpc.StatusCode.UNAUTHENTICATED,
                "health": grpc.StatusCode.OK,
            }
            assert await codes(address, Security(internal_tokens=("old",))) == passed
            assert await codes(address, Security(internal_tokens=("wrong",))) == refused
            assert await codes(address, Security()) == refused
            # The blocking channel of the operator commands (llmserve drain) sends it too.
            assert await asyncio.to_thread(blocking_stats, address, ("new",)) == "OK"
            assert await asyncio.to_thread(blocking_stats, address, ()) == "UNAUTHENTICATED"

    asyncio.run(run())


def blocking_stats(address: str, tokens: tuple[str, ...]) -> str:
    security.install(Security(internal_tokens=tokens))
    with security.channel(address) as channel:
        try:
            scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=5
            )
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]
    return "OK"


def _security(pki: Path, name: str) -> Security:
    return Security(
        tls_files(str(pki / f"{name}.pem"), str(pki / f"{name}.key"), str(pki / "ca.pem"))
    )


def test_mutual_tls_refuses_a_peer_without_a_certificate_of_the_ca(tmp_path: Path):
    pki, other = tmp_path / "pki", tmp_path / "other"
    make_dev_pki(pki)
    make_dev_pki(other)  # a CA of its own: its certificates are worth nothing here

    async def run() -> None:
        async with serving(_security(pki, "scheduler")) as address:
            ok = await codes(address, _security(pki, "worker"))
            assert ok == {
                "unary": grpc.StatusCode.OK,
                "stream": grpc.StatusCode.OK,
                "health": grpc.StatusCode.OK,
            }
            # Plaintext, and a certificate of another CA: no call gets through, health either.
            for client in (Security(), _security(other, "worker")):
                assert set((await codes(address, client)).values()) == {
                    grpc.StatusCode.UNAVAILABLE
                }, client
            # No client certificate at all, trusting the right CA.
            async with grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
            ) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(), timeout=5
                    )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


def test_gateway_may_let_clients_in_without_a_certificate(tmp_path: Path):
    # --no-tls-require-client-cert: TLS, but a client needs only to trust the CA.
    make_dev_pki(tmp_path)

    async def run() -> None:
        async with serving(_security(tmp_path, "gateway"), require_client_cert=False) as address:
            async with grpc.aio.secure_channel(
                address, grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
            ) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert set((await codes(address, Security())).values()) == {
                grpc.StatusCode.UNAVAILABLE  # still no plaintext
            }

    asyncio.run(run())


def test_server_certificate_reloads_when_its_files_change(tmp_path: Path):
    pki = tmp_path / "pki"
    make_dev_pki(pki)
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    new_ca = DevCA(common_name="rotated CA")
    new_ca.write(rotated)
    new_ca.issue(rotated, "scheduler", ["localhost"])
    new_ca.issue(rotated, "worker", ["localhost"])

    async def run() -> None:
        async with serving(_security(pki, "scheduler")) as address:
            assert (await codes(address, _security(rotated, "worker")))["health"] == (
                grpc.StatusCode.UNAVAILABLE
            )
            # Replace the served files (a later mtime, whatever the clock's resolution).
            later = time.time() + 10
            for name in ("scheduler.pem", "scheduler.key", "ca.pem"):
                (pki / name).write_bytes((rotated / name).read_bytes())
                os.utime(pki / name, (later, later))
            assert (await codes(address, _security(rotated, "worker")))["health"] == (
                grpc.StatusCode.OK
            )
            # The old CA is no longer trusted: the worker certificate it signed is refused.
            assert (await codes(address, _security(pki, "worker")))["health"] == (
                grpc.StatusCode.UNAVAILABLE
            )

    asyncio.run(run())


def test_services_dial_and_bind_only_through_llmserve_security():
    # One place applies TLS and the internal token; a channel or port opened elsewhere would
    # be a plaintext, unauthenticated hop (the public client builds its own, from its flags).
    root = Path(__file__).resolve().parents[3]
    allowed = {root / "llmserve" / "security.py", root / "llmserve" / "client.py"}
    found = [
        f"{path.relative_to(root)}:{n}"
        for package in ("llmserve", "gateway", "scheduler_service", "worker_service")
        for path in sorted((root / package).rglob("*.py"))
        if path not in allowed and "v1" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "insecure_channel(" in line
        or "add_insecure_port(" in line
        or "secure_channel(" in line
        or "add_secure_port(" in line
    ]
    assert found == []
