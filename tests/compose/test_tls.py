"""The TLS + mTLS variant (docker-compose.tls.yml) with certificates made for this run only."""

from __future__ import annotations

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
    park,
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
    output = run_demo(tls_stack)
    rows = demo_rows(output)
    assert [rows[name][1] for name in DEMO_REQUESTS] == [
        "remote",
        "partial",
        "recompute",
        "remote",
    ], output
    assert "tokens match a local prefill: 4 of 4" in output


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
