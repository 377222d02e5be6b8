"""Throwaway certificates for TLS/mTLS tests: a CA, a server cert for localhost/127.0.0.1 (and
any extra DNS names), and a client cert. Made fresh per test run into a temp folder; never
committed (.gitignore excludes *.pem)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o644)  # containers run as a non-root user and must read it


def make_certs(
    folder: Path, dns_names: tuple[str, ...] = (), *, loopback: bool = True
) -> CertFiles:
    """`loopback=False`: the server certificate names only `dns_names`, not localhost and
    127.0.0.1 (a certificate shared by producers that clients dial by IP)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = {
        "not_valid_before": now - datetime.timedelta(minutes=5),
        "not_valid_after": now + datetime.timedelta(days=2),
    }
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder(
            subject_name=_name("kvpark test CA"),
            issuer_name=_name("kvpark test CA"),
            public_key=ca_key.public_key(),
            serial_number=x509.random_serial_number(),
            **valid,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder(
                subject_name=_name(cn),
                issuer_name=ca_cert.subject,
                public_key=key.public_key(),
                serial_number=x509.random_serial_number(),
                **valid,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server_sans: list[x509.GeneralName] = []
    if loopback:
        server_sans += [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
    server_sans += [x509.DNSName(n) for n in dns_names]
    server_cert, server_key = leaf("kvpark producer", ExtendedKeyUsageOID.SERVER_AUTH, server_sans)
    client_cert, client_key = leaf("kvpark decode worker", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    files = CertFiles(
        folder / "ca.pem",
        folder / "server.pem",
        folder / "server-key.pem",
        folder / "client.pem",
        folder / "client-key.pem",
    )
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    files.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(server_key, files.server_key)
    _write_key(client_key, files.client_key)
    return files
