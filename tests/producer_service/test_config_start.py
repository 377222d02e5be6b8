"""Settings that pass each key's own parser but cannot work once the producer runs: each one is
refused at start-up with one line naming its keys (exit 2), and a listener that cannot bind
names its key and address (exit 1), rather than a traceback, a hang or a producer that starts
and then fails every call."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, running_producer
from cryptography.hazmat.primitives import serialization
from tls_certs import make_certs

from kvpark import AsyncKVParker
from kvpark.producer.config import ProducerConfig
from kvpark.producer.config_values import ConfigError
from kvpark.producer.memory_room import MemoryRoom, check_pool_fits

MiB = 1024 * 1024
PAGE = 256 * 1024


def start(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m kvpark.producer` with `args` (loopback ports, no metrics), without a
    terminal: what a container or a service manager gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvpark.producer", "--listen", f"127.0.0.1:{free_port()}",
         "--metrics-listen", "", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
        start_new_session=True,  # no controlling terminal to ask a pass phrase on
    )  # fmt: skip


def refused(result: subprocess.CompletedProcess[str], *keys: str) -> str:
    """The one line a refused start printed, checked to name every key in `keys`."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvpark-producer: config error: "), line
    assert all(key in line for key in keys), line
    return line


# --- the largest chunk against one batch's whole pages --------------------------------------


def test_default_chunk_in_a_pool_whose_batch_cannot_hold_it_is_refused() -> None:
    line = refused(start("--pool-bytes", "16MiB"), "max_chunk_bytes", "pool_bytes")
    assert "max_batch_share (0.5)" in line


async def test_largest_chunk_allowed_is_parked() -> None:
    """At the boundary the check allows, a chunk of max_chunk_bytes is parked whole; a page
    more is refused before the producer starts."""
    settings = {"pool_bytes": 4 * PAGE + 100, "max_batch_share": 0.5}
    with pytest.raises(ConfigError, match=r"^max_chunk_bytes \(524289\) takes 3 pages"):
        ProducerConfig.from_mapping({**settings, "max_chunk_bytes": 2 * PAGE + 1})
    async with running_producer(**settings, max_chunk_bytes=2 * PAGE) as server:
        assert server.lot.max_batch_bytes == 2 * PAGE
        async with AsyncKVParker(server.target) as parker:
            parked = await parker.park("largest", [b"k" * (2 * PAGE)])
        assert parked.ok, parked


# --- addresses ------------------------------------------------------------------------------


def test_relative_shm_socket_is_refused(tmp_path: Path) -> None:
    line = refused(start("--shm-socket", "run/shm.sock", cwd=tmp_path), "shm_socket")
    assert "absolute path" in line and "'run/shm.sock'" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("advertised", ["10.0.0.7:50051", "kv-node-3.example:50051"])
def test_loopback_data_listen_behind_a_dialed_address_is_refused(advertised: str) -> None:
    """The data port is offered at the advertised host, where a loopback listener is not."""
    data = f"127.0.0.1:{free_port()}"
    line = refused(
        start("--data-listen", data, "--advertise-address", advertised),
        "data_listen",
        "advertise_address",
    )
    assert repr(data) in line and repr(advertised) in line
    for loopback in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051"):
        config = ProducerConfig.from_mapping({"data_listen": data, "advertise_address": loopback})
        assert config.advertise_address == loopback


def test_data_listen_and_metrics_listen_must_differ() -> None:
    port = free_port()
    for data, metrics in (
        (f"127.0.0.1:{port}", f"127.0.0.1:{port}"),
        (f"0.0.0.0:{port}", f"127.0.0.1:{port}"),
    ):
        line = refused(
            start("--data-listen", data, "--metrics-listen", metrics, "--allow-insecure"),
            "metrics_listen",
            "data_listen",
        )
        assert f"metrics_listen ({metrics!r}) must not use the same address as data_listen" in line


@pytest.mark.parametrize("key", ["metrics_listen", "data_listen"])
def test_a_listener_port_in_use_is_named(key: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        result = start(f"--{key.replace('_', '-')}", address)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == (
        f"kvpark-producer: cannot start: {key}: cannot bind {address!r}: Address already in use"
    )


async def test_a_name_with_one_address_taken_is_refused_not_half_bound() -> None:
    """`localhost` is 127.0.0.1 and ::1: with another process on 127.0.0.1:P, a producer on
    localhost:P must not start on ::1 alone while clients dialing 127.0.0.1:P reach the other
    one."""
    try:
        with socket.socket(socket.AF_INET6) as v6:
            v6.bind(("::1", 0))
    except OSError:
        pytest.skip("no ::1 here: grpc binds localhost on 127.0.0.1 alone")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(
            OSError, match=rf"^listen: cannot bind 'localhost:{port}' on 127.0.0.1: Address"
        ):
            async with running_producer(listen=f"localhost:{port}"):
                pass
    async with running_producer(listen=f"localhost:{port}") as server:  # once free: both
        for host in ("127.0.0.1", "[::1]"):
            async with AsyncKVParker(f"{host}:{port}") as parker:
                assert (await parker.server_info()).producer_epoch == server.epoch


def test_an_shm_socket_another_producer_serves_is_named(shm_socket: str) -> None:
    with socket.socket(socket.AF_UNIX) as busy:
        busy.bind(shm_socket)
        busy.listen(1)
        result = start("--shm-socket", shm_socket)
    assert result.returncode == 1, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line == (
        f"kvpark-producer: cannot start: shm_socket: cannot bind {shm_socket!r}: "
        "another process serves this socket"
    )


async def test_a_start_that_fails_part_way_leaves_nothing_listening(shm_socket: str) -> None:
    """In a process that goes on (an embedding, a test), a producer whose data port is taken
    fails to start and leaves no metrics port, shm socket or gRPC port behind: each can be
    bound again at once."""
    grpc_port, metrics_port = free_port(), free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(OSError, match="data_listen"):
            async with running_producer(
                listen=f"127.0.0.1:{grpc_port}",
                metrics_listen=f"127.0.0.1:{metrics_port}",
                shm_socket=shm_socket,
                data_listen=f"127.0.0.1:{busy.getsockname()[1]}",
            ):
                pass
    for port in (grpc_port, metrics_port):
        with socket.socket() as again:
            again.bind(("127.0.0.1", port))  # EADDRINUSE while anything still listens
    assert not os.path.exists(shm_socket)


# --- TLS files ------------------------------------------------------------------------------


def test_encrypted_tls_key_is_refused_without_asking_for_a_pass_phrase(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass phrase"),
        )
    )
    line = refused(
        start("--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(encrypted)),
        "tls_key_file",
    )
    assert "tls_key_file: encrypted private keys are not supported" in line
    assert repr(str(encrypted)) in line


def test_swapped_certificate_and_key_are_named(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    line = refused(
        start("--tls-cert-file", str(certs.server_key), "--tls-key-file", str(certs.server_cert)),
        "tls_cert_file",
        "tls_key_file",
    )
    assert line.endswith("(are the two swapped?)"), line


# --- tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["tök-en", "tab\tin", "bell\x07", "del\x7f"])
def test_token_outside_printable_ascii_is_refused_unshown(token: str) -> None:
    """gRPC metadata values are printable ASCII: any other token fails every call."""
    line = refused(start("--park-token", token), "park_token")
    assert "printable ASCII" in line and token not in line


def test_token_file_with_a_byte_order_mark_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fetch-token"
    path.write_text("\ufefffetch-secret\n", encoding="utf-8")
    line = refused(start("--fetch-token-file", str(path)), "fetch_token_file")
    assert "byte-order mark" in line and "fetch-secret" not in line


# --- memory ---------------------------------------------------------------------------------


def test_memory_warning_counts_the_remembered_ids(caplog: pytest.LogCaptureFixture) -> None:
    """The sizing rule is pool + 256 MiB + about 1 KiB per max_tombstones: a pool that leaves
    the burst margin but not the id tables' starts with a warning."""
    caplog.set_level(logging.WARNING, logger="kvpark")
    room = MemoryRoom(468 * MiB, "cgroup memory.max 512 MiB with 44 MiB in use")
    check_pool_fits(240 * MiB, room, 10_000)
    assert caplog.records == []
    check_pool_fits(240 * MiB, room, 1_000_000)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "max_tombstones (1000000) ids ~977 MiB" in warning
    assert "pool_bytes + 256 MiB + 1 KiB per max_tombstones" in warning
