"""`python -m llmserve.devcerts OUTDIR`: a development CA and a certificate for each service.

Writes OUTDIR/ca.pem (and ca.key, which signs them), and for each of gateway, scheduler,
worker and client NAME.pem + NAME.key. Every service certificate is good as a server and as
a client (mutual TLS uses one certificate for both ends) and names `localhost`, 127.0.0.1,
the service (`scheduler`: the compose service and Kubernetes Service names) and its
in-cluster names (`scheduler.llmserve.svc`, ...). Workers are dialled by pod address, so the
scheduler checks them under the name `worker` (`--tls-server-name worker`).

For development and tests only (the tests make their CA with it): keys are unencrypted
files, and the CA lives as long as `--days`. Needs the `cryptography` package (a dev
dependency).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICES = ("gateway", "scheduler", "worker")
CLIENT = "client"
NAMESPACE = "llmserve"


@dataclass(frozen=True, slots=True)
class Issued:
    cert: Path
    key: Path


def _names(name: str, namespace: str) -> list[str]:
    if name == CLIENT:
        return [CLIENT]
    return [
        name,
        f"{name}.{namespace}",
        f"{name}.{namespace}.svc",
        f"{name}.{namespace}.svc.cluster.local",
        "localhost",
    ]


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.write_bytes(data)
    os.chmod(path, mode)


class DevCA:
    """A self-signed CA that issues leaf certificates (ECDSA P-256)."""

    def __init__(
        self, common_name: str = "llmserve dev CA", days: int = 365, key_mode: int = 0o600
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.days = days
        self.key_mode = key_mode
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def write(self, out: Path) -> Path:
        """ca.pem and ca.key under `out`; returns the certificate's path."""
        _write(out / "ca.pem", _pem(self.cert))
        _write(out / "ca.key", _key_pem(self.key), 0o600)
        return out / "ca.pem"

    def issue(
        self, out: Path, name: str, dns: list[str], ips: tuple[str, ...] = ("127.0.0.1",)
    ) -> Issued:
        """NAME.pem / NAME.key under `out`, for server and client use, naming `dns` and `ips`."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        alt = [x509.DNSName(d) for d in dns] + [
            x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        issued = Issued(out / f"{name}.pem", out / f"{name}.key")
        _write(issued.cert, _pem(cert))
        _write(issued.key, _key_pem(key), self.key_mode)
        return issued


def _pem(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(cert.public_bytes(serialization.Encoding.PEM))


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def make_dev_pki(
    out: Path, days: int = 365, namespace: str = NAMESPACE, readable_keys: bool = False
) -> dict[str, Issued]:
    """The CA and one certificate for each service and for a client, written under `out`
    (keys 0600, or 0644 with `readable_keys`)."""
    out.mkdir(parents=True, exist_ok=True)
    ca = DevCA(days=days, key_mode=0o644 if readable_keys else 0o600)
    ca.write(out)
    return {name: ca.issue(out, name, _names(name, namespace)) for name in (*SERVICES, CLIENT)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m llmserve.devcerts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("outdir", type=Path)
    p.add_argument("--days", type=int, default=365, help="validity of the CA and certificates")
    p.add_argument("--namespace", default=NAMESPACE, help="Kubernetes namespace in the names")
    p.add_argument(
        "--readable-keys",
        action="store_true",
        help="service keys readable by all (0644), for bind mounts into containers "
        "that run as another user (compose); development only",
    )
    args = p.parse_args(argv)
    issued = make_dev_pki(args.outdir, args.days, args.namespace, args.readable_keys)
    print(f"CA: {args.outdir / 'ca.pem'}")
    for name, files in issued.items():
        print(f"{name}: {files.cert} {files.key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
