"""The producer as a real process: configuration errors exit 2 on one line, SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import MiB, ProducerProcess, free_port

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.__main__ import noted_stop_signals
from kvpark.producer.config import KEYS, ProducerConfig
from kvpark.producer.credentials import Credentials
from kvpark.producer.server import serve


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer_service", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("args", "key", "shown"),
    [
        (["--unbound-store-timeout-s", "abc"], "unbound_store_timeout_s", "'abc'"),
        (["--tombstone-retention-s", "0"], "tombstone_retention_s", "0"),
        (["--unbound-store-timeout-s", "nan"], "unbound_store_timeout_s", "nan"),
        (["--max-lease-s", "inf"], "max_lease_s", "inf"),
        (["--unbound-store-timeout-s", "604801"], "unbound_store_timeout_s", "604801"),
        (
            ["--tombstone-retention-s", "30", "--consumer-load-timeout-s", "30"],
            "tombstone_retention_s",
            "30",
        ),
        (["--pool-bytes", "lots"], "pool_bytes", "'lots'"),
        # Values that pass each key's own check but would fail inside grpc or the pool.
        (["--max-chunk-bytes", "1GiB"], "max_chunk_bytes", "1073741824"),
        (["--max-concurrent-rpcs", "9" * 20], "max_concurrent_rpcs", "9" * 20),
        (["--pool-bytes", "1000", "--max-chunk-bytes", "1000"], "pool_bytes", "1000"),
    ],
)
def test_bad_flag_exits_2_naming_the_key(args: list[str], key: str, shown: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert key in lines[0] and shown in lines[0]


@pytest.mark.parametrize(
    ("document", "key", "shown"),
    [
        ({"unbound_store_timeout_s": True}, "unbound_store_timeout_s", "True"),
        ({"unbound_store_timeout_s": None}, "unbound_store_timeout_s", "None"),
        ({"unbound_store_timout_s": 5}, "unbound_store_timout_s", ""),
        ({"tombstone_retention_s": 10}, "tombstone_retention_s", "10"),
    ],
)
def test_bad_config_file_exits_2_naming_the_key(
    tmp_path: Path, document: dict[str, object], key: str, shown: str
) -> None:
    path = tmp_path / "kvpark.json"
    path.write_text(json.dumps(document))
    result = run_cli("--config", str(path))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and key in line and shown in line


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen"])
def test_a_port_in_use_exits_1_saying_so_on_one_line(flag: str) -> None:
    """No traceback, and nothing left running to complain as the process ends (a gRPC server
    started before the metrics port failed used to log "Event loop is closed")."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        others = {"--listen": "127.0.0.1:0", "--metrics-listen": ""}
        others[flag] = f"127.0.0.1:{port}"
        result = run_cli(*(word for pair in others.items() for word in pair))
    assert result.returncode == 1, result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("kvpark-producer")]
    assert len(ours) == 1 and "cannot start" in ours[0], result.stderr
    assert f"cannot bind '127.0.0.1:{port}'" in ours[0] or "Address already in use" in ours[0]
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr


def test_console_script_starts_the_same_cli() -> None:
    script = Path(sys.executable).with_name("kvpark-producer")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "kvpark-producer" in result.stdout
    bad = subprocess.run(
        [str(script), "--max-lease-s", "true"], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "max_lease_s" in bad.stderr


def test_help_documents_every_key() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for key in KEYS:
        assert "--" + key.replace("_", "-") in result.stdout, key


def test_seconds_as_string_accepted_and_served(producer_process) -> None:  # type: ignore[no-untyped-def]
    producer: ProducerProcess = producer_process(unbound_store_timeout_s="180")
    with grpc.insecure_channel(producer.target) as channel:
        info = pb_grpc.KVProducerStub(channel).GetServerInfo(pb.GetServerInfoRequest())
    assert info.unbound_store_timeout_s == 180.0


def test_bad_env_value_exits_2_naming_the_key() -> None:
    env = {**os.environ, "KVPARK_UNBOUND_STORE_TIMEOUT_S": "abc"}
    result = run_cli(env=env)
    assert result.returncode == 2
    assert "unbound_store_timeout_s" in result.stderr and "'abc'" in result.stderr


def test_sigterm_during_bound_fetch_drains_it_and_exits_0(producer_process) -> None:  # type: ignore[no-untyped-def]
    producer: ProducerProcess = producer_process(shutdown_grace_s=20, pool_bytes="128MiB")
    chunk = 1024 * 1024
    payload = {i: bytes([i]) * chunk for i in range(40)}
    with grpc.insecure_channel(
        producer.target, options=[("grpc.max_receive_message_length", 8 * chunk)]
    ) as channel:
        stub = pb_grpc.KVProducerStub(channel)
        requests = [pb.ParkRequest(header=pb.ParkHeader(kv_request_id="d", total_chunks=40))]
        requests += [
            pb.ParkRequest(chunk=pb.Chunk(chunk_id=i, data=d, crc32c=crc32c_of(d)))
            for i, d in payload.items()
        ]
        commit = pb.ParkCommit(chunks=40, bytes=40 * chunk)
        requests.append(pb.ParkRequest(commit=commit))
        assert stub.Park(iter(requests)).status == pb.STATUS_OK
        stream = stub.Fetch(pb.FetchRequest(kv_request_id="d"))
        assert next(stream).chunk.data == payload[0]  # bound; the rest is in flight
        producer.proc.send_signal(signal.SIGTERM)
        # Parks are refused from now on, but the bound fetch is drained to the end.
        rest = list(stream)
    assert [m.chunk.data for m in rest[:-1]] == [payload[i] for i in range(1, 40)]
    assert rest[-1].done.status == pb.STATUS_OK
    assert producer.proc.wait(timeout=30) == 0
    log = producer.output()
    assert "signal received" in log and "undrained_fetches=0" in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_pool_is_allocated_stops_it_cleanly(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """A stop signal while the producer touches its pool's pages (a large pool takes seconds,
    the window a rollout's SIGTERM often meets) ends it as gracefully as one while serving:
    exit 0, no KeyboardInterrupt traceback, no death by the signal."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpark.producer", "--pool-bytes", "2GiB",
         "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "allocating the pool" in line:
                proc.send_signal(sig)
                break
        assert proc.wait(timeout=60) == 0, "".join(seen) + proc.stdout.read()
        log = "".join(seen) + proc.stdout.read()
    finally:
        proc.kill()
    assert "Traceback" not in log and "signal received" in log, log


def test_a_signal_before_serving_starts_nothing() -> None:
    """A stop signal before the event loop took the signals over (while the configuration
    loads) is noted; the producer then returns 0 without allocating its pool or binding."""
    port, before = free_port(), signal.getsignal(signal.SIGTERM)
    config = ProducerConfig(listen=f"127.0.0.1:{port}", metrics_listen="", pool_bytes=64 * MiB)
    with noted_stop_signals() as stop_requested:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested()
        assert asyncio.run(serve(config, Credentials(), stop_requested)) == 0
    with socket.socket() as free:
        free.bind(("127.0.0.1", port))  # nothing took the port
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are given back
