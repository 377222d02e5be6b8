"""The TCP data connection verifies the producer's certificate against the name the gRPC
channel verifies, when the channel overrides it (`grpc.ssl_target_name_override`).

That is the Kubernetes layout (docs/deployment.md): one certificate shared by every producer
names `kvpark-producer`, not the pod IPs decode workers dial; the DataOffer's address is such a
pod IP. Checked against the IP, the handshake fails before the first byte and every load falls
back to the gRPC stream, quietly; checked against the channel's name, it goes over TCP. Here the
certificate names only `kvpark-producer` and the client dials 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from conftest import MiB, running_producer
from tls_certs import CertFiles, make_certs

from kvpark import KVConsumer, KVParker

NAME = "kvpark-producer"
SETTINGS: dict[str, Any] = {"data_listen": "127.0.0.1:0", "pool_bytes": 64 * MiB}


def clients(certs: CertFiles, target: str, override: bool) -> tuple[KVParker, KVConsumer]:
    ca = certs.ca.read_bytes()
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=certs.client_key.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
    )
    options = [("grpc.ssl_target_name_override", NAME)] if override else []
    data_tls = ssl.create_default_context(cadata=ca.decode())  # hostname checked: the default
    data_tls.load_cert_chain(certs.client_cert, certs.client_key)
    parker = KVParker(target, credentials=credentials, channel_options=options)
    consumer = KVConsumer(
        target, credentials=credentials, channel_options=options, data_tls=data_tls, timeout=10
    )
    return parker, consumer


async def test_the_data_connection_checks_the_name_the_channel_checks(tmp_path: Path) -> None:
    certs = make_certs(tmp_path, dns_names=(NAME,), loopback=False)
    async with running_producer(
        **SETTINGS,
        tls_cert_file=str(certs.server_cert),
        tls_key_file=str(certs.server_key),
        tls_client_ca_file=str(certs.ca),
    ) as server:
        data = np.random.default_rng(3).integers(0, 256, 2 * MiB, dtype=np.uint8)

        def run() -> Any:
            parker, consumer = clients(certs, server.target, override=True)
            with parker, consumer:
                assert parker.park("named", [data[:MiB], data[MiB:]]).ok
                into = np.zeros(2 * MiB, np.uint8)
                return consumer.load("named", num_chunks=2, into=into), into

        loaded, into = await asyncio.to_thread(run)
        assert loaded.ok and loaded.transport == "tcp", loaded
        assert np.array_equal(into, data)
        assert server.data is not None and server.data.refused == 0


async def test_without_the_override_the_certificate_does_not_name_the_address(
    tmp_path: Path,
) -> None:
    """The guard of the test above: this certificate really does not name 127.0.0.1, so a
    client that checks the address itself cannot even open its channel."""
    certs = make_certs(tmp_path, dns_names=(NAME,), loopback=False)
    async with running_producer(
        **SETTINGS, tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)
    ) as server:

        def run() -> Any:
            parker, consumer = clients(certs, server.target, override=False)
            with parker, consumer:
                return consumer.load("anything", num_chunks=1, timeout=3)

        result = await asyncio.to_thread(run)
        assert not result.ok and str(result.reason) == "UNAVAILABLE", result
