"""The TLS + mTLS variant (docker-compose.tls.yml) with certificates made for this run only."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tls_certs import CertFiles, make_certs

from kvpark.client import KVConsumer, Reason

from .conftest import FETCH_TOKEN, PARK_TOKEN, TOKENS_ENV
from .stack import (
    DEMO_FILE,
    DEMO_REQUESTS,
    TEST_FILE,
    TLS_FILE,
    Stack,
    demo_rows,
    loaded_via,
    park,
    parked_via,
    run_demo,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def certs() -> Iterator[CertFiles]:
    # Not pytest's tmp_path: its folders are private to root, and the containers' non-root
    # user must read the mounted files. Removed afterwards; never committed (*.pem ignored).
    folder = Path(tempfile.mkdtemp(prefix="kvpark-compose-certs-"))
    folder.chmod(0o755)
    try:
        yield make_certs(folder, dns_names=("producer",))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_stack(kvpark_image: None, certs: CertFiles) -> Iterator[Stack]:
    env = {**TOKENS_ENV, "KVPARK_CERTS_DIR": str(certs.ca.parent)}
    s = Stack(f"kvpark-test-tls-{os.getpid()}", [DEMO_FILE, TLS_FILE, TEST_FILE], env=env)
    s.down()
    try:
        s.up("producer")
        s.wait_healthy()  # the health probe itself goes over TLS with a client certificate
        yield s
    finally:
        s.down()


def client_credentials(certs: CertFiles, *, with_cert: bool = True) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes() if with_cert else None,
        certificate_chain=certs.client_cert.read_bytes() if with_cert else None,
    )


def test_demo_over_tls_and_mtls(tls_stack: Stack) -> None:
    """The demo with TLS and client certificates everywhere: the decode worker's loads still
    take the data port, now over TLS with its client certificate (the producer's data_tls
    follows its TLS files); a failed handshake there would have sent them over gRPC instead.
    The prefill worker's parks go over the shm socket, which TLS does not concern."""
    demo = run_demo(tls_stack)
    output = demo.decode
    rows = demo_rows(output)
    assert [rows[name][1] for name in DEMO_REQUESTS] == [
        "remote",
        "partial",
        "recompute",
        "remote",
    ], output
    assert "tokens match a local prefill: 4 of 4" in output
    assert "tcp producer:50052 (TLS)" in output
    assert loaded_via(output) == ["tcp", "tcp", "-", "tcp"], output
    assert parked_via(demo.prefill) == dict.fromkeys(DEMO_REQUESTS, "shm"), demo.prefill


def test_host_client_needs_tls_and_a_client_certificate(tls_stack: Stack, certs: CertFiles) -> None:
    target = tls_stack.target
    kid = f"tls-{time.time_ns()}"
    data = os.urandom(128 * 1024)
    park(target, PARK_TOKEN, kid, {0: data}, 1, credentials=client_credentials(certs))

    with KVConsumer(target, token=FETCH_TOKEN, timeout=5) as plain:
        assert plain.load(kid, num_chunks=1).reason is Reason.UNAVAILABLE
    anonymous = client_credentials(certs, with_cert=False)
    with KVConsumer(target, token=FETCH_TOKEN, timeout=5, credentials=anonymous) as no_cert:
        assert no_cert.load(kid, num_chunks=1).reason is Reason.UNAVAILABLE

    with KVConsumer(
        target, token=FETCH_TOKEN, timeout=10, credentials=client_credentials(certs)
    ) as kv:
        result = kv.load(kid, num_chunks=1)
    assert result.ok, result
    assert result.data.tobytes() == data


def test_data_port_serves_tls_and_requires_the_client_certificate(
    tls_stack: Stack, certs: CertFiles
) -> None:
    """A decode container with the CA and the client certificate loads over the TLS data
    port. One that leaves its certificate off the data connection only (its gRPC channel has
    it) is refused there during the handshake, before any byte: its load goes on over gRPC."""
    stamp = time.time_ns()
    with_cert, without_cert = f"tls-data-{stamp}", f"tls-nocert-{stamp}"
    data = os.urandom(4 * 256 * 1024)
    chunks = {i: data[i * 256 * 1024 : (i + 1) * 256 * 1024] for i in range(4)}
    credentials = client_credentials(certs)
    with KVConsumer(tls_stack.target, token=FETCH_TOKEN, credentials=credentials) as kv:
        # Intents: the loaders' containers start after the test producer's 2 s lease.
        kv.extend_leases([with_cert, without_cert], 120)
        assert kv.server_info().data_tls is True
    for kid in (with_cert, without_cert):
        park(tls_stack.target, PARK_TOKEN, kid, chunks, 4, credentials=credentials)
    options = [
        "-v", f"{certs.ca.parent}:/certs:ro",
        "-e", "DEMO_TLS_CA=/certs/ca.pem",
        "-e", "DEMO_TLS_CERT=/certs/client.pem",
        "-e", "DEMO_TLS_KEY=/certs/client-key.pem",
    ]  # fmt: skip
    expected = hashlib.sha256(data).hexdigest()
    for kid, extra, transport in (
        (with_cert, [], "tcp"),
        (without_cert, ["--data-tls-without-cert"], "grpc"),
    ):
        result = tls_stack.run_loader(
            kid, "--chunks", "4", "--buffer-bytes", str(len(data)), *extra, options=options
        )
        assert result["ok"] and result["chunks_loaded"] == 4, result
        assert result["transport"] == transport, result
        assert result["sha256"] == expected
