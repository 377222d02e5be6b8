"""The `kvpark` CLI against TLS producers: the TCP data connection gets TLS from the same files
as the gRPC channel (else a fetch quietly goes over the gRPC stream and `kvpark bench
--transport tcp` fails), and `--tls-server-name` names the host the producer's certificate
carries when it does not name the address dialed (docs/deployment.md: one certificate shared
by producers dialed by pod IP), for the gRPC channel and the data connection alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import running_producer
from consumer_support import in_thread, joined, payload
from tls_certs import CertFiles, make_certs

from kvpark import KVParker
from kvpark.client import cli
from kvpark.producer.server import ProducerServer

SHARED_NAME = "kvpark-producer"


async def run_cli(*argv: str) -> int:
    return int(await in_thread(cli.main, list(argv)))


def tls_settings(certs: CertFiles) -> dict[str, Any]:
    """A producer with mTLS on its gRPC port and, from the same files, on its data port."""
    return {
        "data_listen": "127.0.0.1:0",
        "tls_cert_file": str(certs.server_cert),
        "tls_key_file": str(certs.server_key),
        "tls_client_ca_file": str(certs.ca),
    }


def tls_options(certs: CertFiles) -> list[str]:
    return [
        "--tls-ca", str(certs.ca),
        "--tls-cert", str(certs.client_cert),
        "--tls-key", str(certs.client_key),
    ]  # fmt: skip


async def park_over_tls(
    server: ProducerServer, certs: CertFiles, kid: str, chunks: dict[int, bytes], name: str
) -> None:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes(),
        certificate_chain=certs.client_cert.read_bytes(),
    )

    def park() -> bool:
        options = [("grpc.ssl_target_name_override", name)]
        with KVParker(server.target, credentials=credentials, channel_options=options) as parker:
            return parker.park(kid, [chunks[i] for i in sorted(chunks)]).ok

    assert await in_thread(park)


async def test_fetch_from_a_tls_producer_takes_the_tls_data_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs = make_certs(tmp_path / "certs")
    async with running_producer(**tls_settings(certs)) as server:
        assert server.data is not None and server.data.tls
        chunks = payload(3, 100_000)
        await park_over_tls(server, certs, "tls-1", chunks, "localhost")
        out = tmp_path / "kv.bin"
        argv = ["--target", server.target, *tls_options(certs), "--json"]
        code = await run_cli(*argv, "fetch", "tls-1", "--chunks", "3", "--out", str(out))
        assert code == cli.EXIT_OK, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["ok"]
        assert out.read_bytes() == joined(chunks)
        # The bytes came over the data connection, not the gRPC stream.
        assert (server.data.accepted, server.data.refused) == (1, 0)


async def test_bench_measures_tcp_on_a_tls_producer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What docs/deployment.md tells operators to run from a decode node, kept small."""
    certs = make_certs(tmp_path / "certs")
    async with running_producer(**tls_settings(certs)) as server:
        code = await run_cli(
            "--target", server.target, *tls_options(certs), "bench", "--quick", "--json",
            "--quiet", "--transport", "tcp", "--size", "1MiB", "--chunk", "512KiB",
            "--reps", "1", "--latency-tries", "2",
        )  # fmt: skip
        out = capsys.readouterr().out
        doc = json.loads(out)
        assert code == 0 and doc["ok"], doc["failures"]
        assert doc["plan"]["transports"] == ["tcp"]
        assert server.data is not None and server.data.accepted >= 1
        assert server.data.refused == 0


async def test_tls_server_name_checks_the_name_a_shared_certificate_carries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The certificate names only the shared name, not 127.0.0.1 the CLI dials: without the
    override neither call gets through; with it both do, the fetch over the data connection
    (which checks the same name)."""
    certs = make_certs(tmp_path / "certs", dns_names=(SHARED_NAME,), loopback=False)
    async with running_producer(**tls_settings(certs)) as server:
        assert server.data is not None
        chunks = payload(2, 50_000)
        await park_over_tls(server, certs, "named-1", chunks, SHARED_NAME)
        base = ["--target", server.target, *tls_options(certs), "--rpc-timeout", "5"]
        out = tmp_path / "kv.bin"
        fetch = ["fetch", "named-1", "--chunks", "2", "--out", str(out), "--timeout", "5"]

        assert await run_cli(*base, "info") == cli.EXIT_RPC
        assert "UNAVAILABLE" in capsys.readouterr().err
        assert await run_cli(*base, *fetch) == cli.EXIT_RPC
        capsys.readouterr()
        assert not out.exists()

        named = [*base, "--tls-server-name", SHARED_NAME]
        assert await run_cli(*named, "info") == cli.EXIT_OK, capsys.readouterr().err
        assert "transports: grpc,tcp+tls" in capsys.readouterr().out
        # The option after the command works as well as before it.
        code = await run_cli(*base, *fetch, "--tls-server-name", SHARED_NAME)
        assert code == cli.EXIT_OK, capsys.readouterr().err
        assert out.read_bytes() == joined(chunks)
        assert (server.data.accepted, server.data.refused) == (1, 0)


async def test_bench_with_tls_server_name_runs_every_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvpark bench --target <pod IP> --tls-server-name NAME`: the concurrent section's
    late-fetch prober, a process of its own, checks the same name (16 chunks run that
    section)."""
    certs = make_certs(tmp_path / "certs", dns_names=(SHARED_NAME,), loopback=False)
    async with running_producer(**tls_settings(certs)) as server:
        code = await run_cli(
            "--target", server.target, *tls_options(certs), "--tls-server-name", SHARED_NAME,
            "bench", "--quick", "--json", "--quiet", "--transport", "tcp", "--size", "1MiB",
            "--chunk", "64KiB", "--reps", "1", "--latency-tries", "2",
        )  # fmt: skip
        doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"], doc["failures"]
    busy = [row for row in doc["latency"] if row["kind"] == "late_fetch_busy"]
    assert busy and busy[0]["n"] >= 1, doc["latency"]


@pytest.mark.parametrize(
    "command", [["info"], ["lookup", "x"], ["fetch", "x", "--out", "-"], ["bench", "--quick"]]
)
async def test_tls_server_name_without_tls_is_a_usage_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_producer() as server:
        argv = ["--target", server.target, "--tls-server-name", SHARED_NAME, *command]
        assert await run_cli(*argv) == cli.EXIT_USAGE
    assert "--tls-server-name goes with TLS" in capsys.readouterr().err


async def test_tls_files_the_data_connection_cannot_use_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CA file holding no certificate, and a client certificate with another's key, are
    named before any call, as a TLS file holding no PEM is."""
    certs = make_certs(tmp_path / "certs")
    other = make_certs(tmp_path / "other")
    async with running_producer(**tls_settings(certs)) as server:
        t = ("--target", server.target)
        for command in (["info"], ["fetch", "x", "--out", "-"], ["bench", "--quick"]):
            ca_is_a_key = ["--tls-ca", str(certs.client_key)]
            assert await run_cli(*t, *ca_is_a_key, *command) == cli.EXIT_USAGE
            assert f"{certs.client_key}: holds no usable CA certificate" in (
                capsys.readouterr().err
            )
            mismatched = [
                "--tls-ca", str(certs.ca),
                "--tls-cert", str(certs.client_cert),
                "--tls-key", str(other.client_key),
            ]  # fmt: skip
            assert await run_cli(*t, *mismatched, *command) == cli.EXIT_USAGE
            assert "not a client certificate and its key" in capsys.readouterr().err
