"""TLS for every gRPC hop and the HTTPS API: credentials from `--tls-cert/--tls-key/--tls-ca`.

With all three set, a service's servers present `cert` and require a client certificate
signed by `ca` (mutual TLS), and the channels it dials present `cert` and verify the server
against `ca`. One certificate per service serves both ends, so it carries the serverAuth and
clientAuth key usages (`llmserve.devcerts` makes such certificates).

Reload: a gRPC server re-reads the three files when their modification times change, at the
next TLS handshake (gRPC's dynamic server credentials), so established connections keep the
old certificate and new ones get the new one. Channels read the files when they are opened;
the long-lived ones (the scheduler's stream to each worker, the gateway's to the scheduler)
keep their certificate until they reconnect. Replace the files atomically (write, then
rename; Kubernetes swaps a mounted Secret that way). The HTTPS server (uvicorn) reads them
once at start: rotating its certificate takes a restart (a rolling restart of the gateway,
which `llmserve up` and the orchestrators do without losing requests in flight elsewhere).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from llmserve.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one service: its certificate chain, its private key, and the CA that
    signs every peer. `server_name` replaces the dialled host when checking a server's
    certificate (the scheduler dials workers by pod IP, which no certificate names)."""

    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None

    def _mtimes(self) -> tuple[int, ...]:
        return tuple(os.stat(path).st_mtime_ns for path in (self.cert, self.key, self.ca))


def tls_files(
    cert: str | None, key: str | None, ca: str | None, server_name: str | None = None
) -> TlsFiles | None:
    """The files, or None when TLS is off. Raises ValueError naming the flag that is missing
    or unreadable: half a TLS configuration would silently be a plaintext hop."""
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        return None
    for flag, value in given.items():
        if not value:
            raise ValueError(f"{flag}: required with the other --tls-* flags")
        if not os.access(value, os.R_OK):
            raise ValueError(f"{flag}: cannot read {value}")
    assert cert and key and ca
    return TlsFiles(Path(cert), Path(key), Path(ca), server_name or None)


def _server_configuration(files: TlsFiles) -> Any:
    return grpc.ssl_server_certificate_configuration(
        [(files.key.read_bytes(), files.cert.read_bytes())], files.ca.read_bytes()
    )


class _Reloader:
    """gRPC's certificate fetcher: a new configuration when the files changed, else None.
    Called by gRPC at each handshake, from its own threads; stat() is cheap enough."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = files._mtimes()

    def __call__(self) -> Any:
        try:
            stamp = self.files._mtimes()
            if stamp == self._stamp:
                return None
            configuration = _server_configuration(self.files)
        except OSError as exc:
            log.warning("tls files unreadable; keeping the loaded ones", error=str(exc))
            return None
        self._stamp = stamp
        log.info("tls certificate reloaded", cert=str(self.files.cert))
        return configuration


def server_credentials(files: TlsFiles, require_client_cert: bool = True) -> grpc.ServerCredentials:
    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(files), _Reloader(files), require_client_cert
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes(),
        private_key=files.key.read_bytes(),
        certificate_chain=files.cert.read_bytes(),
    )


@dataclass(frozen=True, slots=True)
class ClientTls:
    """TLS for a client of the gateway: the CA its certificate is checked against, and a
    client certificate when the gateway requires one."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


def channel_options(files: TlsFiles) -> list[tuple[str, Any]]:
    return (
        [] if files.server_name is None else [("grpc.ssl_target_name_override", files.server_name)]
    )


def uvicorn_ssl(files: TlsFiles | None, require_client_cert: bool) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for HTTPS (empty for plain HTTP)."""
    if files is None:
        return {}
    return {
        "ssl_certfile": str(files.cert),
        "ssl_keyfile": str(files.key),
        "ssl_ca_certs": str(files.ca),
        "ssl_cert_reqs": ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE,
    }
