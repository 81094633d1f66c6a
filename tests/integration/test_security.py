"""Keys and mutual TLS on the real stack (issue 15): worker, scheduler and gateway as three
processes with a CA made here, and once more with an internal token and no TLS."""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.client import Client
from llmserve.devcerts import make_dev_pki
from llmserve.tls import ClientTls
from llmserve.v1 import (
    generation_pb2,
    generation_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.stack import RunningStack, start_stack

pytestmark = [pytest.mark.e2e, pytest.mark.services]

KEYS = ("first-key-0123456789", "second-key-9876543210")
TOKEN = "internal-token-abcdef"


def _tls_flags(pki: Path, name: str) -> list[str]:
    return [
        "--tls-cert",
        str(pki / f"{name}.pem"),
        "--tls-key",
        str(pki / f"{name}.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
    ]


def _credentials(pki: Path, name: str | None) -> grpc.ChannelCredentials:
    ca = (pki / "ca.pem").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(ca)
    return grpc.ssl_channel_credentials(
        ca, (pki / f"{name}.key").read_bytes(), (pki / f"{name}.pem").read_bytes()
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    make_dev_pki(out)
    return out


@pytest.fixture(scope="module")
def mtls(
    tiny_model_dir: Path, pki: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("# two keys, any of them works\n" + "\n".join(KEYS) + "\n")
    running = start_stack(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("mtls-logs"),
        worker_args=_tls_flags(pki, "worker"),
        scheduler_args=_tls_flags(pki, "scheduler"),
        gateway_args=[*_tls_flags(pki, "gateway"), "--api-key-file", str(keys)],
        credentials=_credentials(pki, "client"),
    )
    yield running
    running.stop()
    for name in ("worker", "scheduler", "gateway"):
        log = running.logs(name)
        assert not any(key in log for key in KEYS), name  # keys are never logged


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    ) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined,no-any-return]
    return grpc.StatusCode.OK


def test_every_grpc_hop_refuses_a_peer_without_a_certificate_of_the_ca(
    mtls: RunningStack, pki: Path, tmp_path: Path
):
    other = tmp_path / "other-ca"
    make_dev_pki(other)
    for address in (mtls.gateway, mtls.scheduler, mtls.worker):
        assert _health(address, _credentials(pki, "client")) == grpc.StatusCode.OK, address
        for credentials in (None, _credentials(pki, None), _credentials(other, "client")):
            # Plaintext, TLS without a client certificate, a certificate of another CA.
            assert _health(address, credentials) == grpc.StatusCode.UNAVAILABLE, address


def test_a_fake_worker_cannot_register_or_be_reached_without_a_certificate(
    mtls: RunningStack, pki: Path, tmp_path: Path
):
    other = tmp_path / "other-ca"
    make_dev_pki(other)
    with grpc.secure_channel(mtls.scheduler, _credentials(other, "worker")) as channel:
        with pytest.raises(grpc.RpcError) as info:
            scheduler_pb2_grpc.SchedulerStub(channel).RegisterWorker(
                scheduler_pb2.RegisterWorkerRequest(address="127.0.0.1:1"), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with grpc.insecure_channel(mtls.worker) as channel:
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    with grpc.secure_channel(mtls.scheduler, _credentials(pki, "worker")) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).GetStats(
            scheduler_pb2.GetStatsRequest(), timeout=5
        )
    assert [r.address for r in stats.replicas] == [mtls.worker]


def test_grpc_generate_needs_one_of_the_keys_and_works_end_to_end(mtls: RunningStack, pki: Path):
    tls = ClientTls(pki / "ca.pem", pki / "client.pem", pki / "client.key")
    for key in (None, "wrong-key", KEYS[0][:-1]):
        with Client(mtls.gateway, tls=tls, api_key=key, timeout_s=30) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.complete("Hello", max_tokens=4)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, key  # type: ignore[attr-defined]
    for key in KEYS:
        with Client(mtls.gateway, tls=tls, api_key=key, timeout_s=60) as client:
            done = client.complete("Hello", max_tokens=4, ignore_eos=True)
        assert done.completion_tokens == 4 and len(done.token_ids[0]) == 4
    # Health stays open to a client with a certificate and no key.
    with grpc.secure_channel(mtls.gateway, _credentials(pki, "client")) as channel:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(channel).ListModels(
                generation_pb2.ListModelsRequest(), timeout=5
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]


def _https(pki: Path, client_cert: bool) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if client_cert:
        context.load_cert_chain(pki / "client.pem", pki / "client.key")
    return httpx.Client(verify=context, timeout=60)


def test_https_needs_a_client_certificate_and_one_of_the_keys(mtls: RunningStack, pki: Path):
    url = f"https://127.0.0.1:{mtls.http_port}/v1/completions"
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    with _https(pki, client_cert=False) as client, pytest.raises(httpx.TransportError):
        client.get(f"https://127.0.0.1:{mtls.http_port}/health")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{mtls.http_port}/health", timeout=10)
    with _https(pki, client_cert=True) as client:
        models = client.get(
            f"https://127.0.0.1:{mtls.http_port}/v1/models",
            headers={"Authorization": f"Bearer {KEYS[1]}"},
        )
        assert models.status_code == 200, models.text
        body["model"] = models.json()["data"][0]["id"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]}):
            refused = client.post(url, json=body, headers=headers)
            assert refused.status_code == 401, headers
            assert refused.json()["error"]["code"] == "invalid_api_key"
        for key in KEYS:
            accepted = client.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
            assert accepted.status_code == 200, accepted.text
            assert accepted.json()["usage"]["completion_tokens"] <= 2


def test_health_cli_dials_with_the_tls_flags(mtls: RunningStack, pki: Path):
    def health(address: str, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "llmserve.cli", "health", address, *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )

    for address in (mtls.gateway, mtls.scheduler, mtls.worker):
        assert health(address, *_tls_flags(pki, "client")).returncode == 0, address
        assert health(address).returncode == 1, address


# -- without TLS: the internal token ------------------------------------------------------------


@pytest.fixture(scope="module")
def token_stack(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    token = tmp_path_factory.mktemp("token") / "internal-token"
    token.write_text(f"{TOKEN}\n")
    flags = ["--internal-token-file", str(token)]
    running = start_stack(
        str(tiny_model_dir),
        tmp_path_factory.mktemp("token-logs"),
        worker_args=flags,
        scheduler_args=flags,
        gateway_args=flags,
    )
    yield running
    running.stop()
    assert not any(TOKEN in running.logs(name) for name in ("worker", "scheduler", "gateway"))


def test_without_the_internal_token_no_worker_registers_and_no_worker_call_passes(
    token_stack: RunningStack,
):
    register = scheduler_pb2.RegisterWorkerRequest(address="127.0.0.1:1")
    drain = scheduler_pb2.DrainWorkerRequest(address=token_stack.worker)
    with grpc.insecure_channel(token_stack.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for md in [(), (("authorization", "Bearer not-the-token"),)]:
            for method, request in (
                (stub.RegisterWorker, register),
                (stub.DrainWorker, drain),
                (stub.GetStats, scheduler_pb2.GetStatsRequest()),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    method(request, timeout=5, metadata=md)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        stats = stub.GetStats(
            scheduler_pb2.GetStatsRequest(),
            timeout=5,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
    # The fake never joined; the real worker still serves (nothing was drained).
    assert [(r.address, r.healthy) for r in stats.replicas] == [(token_stack.worker, True)]
    with grpc.insecure_channel(token_stack.worker) as channel:
        with pytest.raises(grpc.RpcError) as info:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert _health(token_stack.worker, None) == grpc.StatusCode.OK  # health stays open
    # The gateway's calls to the scheduler carry the token: a generation goes through.
    with Client(token_stack.gateway, timeout_s=60) as client:
        done = client.complete("Hello", max_tokens=3, ignore_eos=True)
    assert done.completion_tokens == 3
