"""The compose demo's two workers, run as plain processes against a producer process.

The same scripts the compose stack runs (examples/prefill_worker.py, examples/demo_decode.py),
started in the order compose gates them (the decode worker's ready file first), with a 1 s
lease so the whole run takes a few seconds. tests/compose runs them in containers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, ProducerProcess, wait_for

pytestmark = pytest.mark.timeout(120)
EXAMPLES = ROOT / "examples"
NAMES = ("on-time", "partial", "late", "queued")


def demo_rows(output: str) -> dict[str, list[str]]:
    rows = {}
    for line in output.splitlines():
        words = line.split()
        if words and words[0] in NAMES and len(words) >= 8:
            rows[words[0]] = words
    return rows


def run_workers(
    producer: ProducerProcess,
    tmp_path: Path,
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], str, float]:
    """Runs the decode worker, and the prefill worker once it is ready; returns the prefill
    worker's run, the decode worker's output (it exited 0) and the wall time of both."""
    ready = tmp_path / "ready"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("KVPARK_", "DEMO_"))},
        "DEMO_TARGET": producer.target,
        "DEMO_READY_FILE": str(ready),
        "DEMO_QUEUE_EXTRA_S": "0.5",
        "DEMO_CHUNK_WAIT_S": "0.3",
        "OPENBLAS_NUM_THREADS": "1",
    }
    started = time.monotonic()
    decode = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "demo_decode.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**env, **(decode_env or {})},
    )  # fmt: skip
    try:
        wait_for(lambda: ready.exists() or decode.poll() is not None, 30, "the ready file")
        prefill = subprocess.run(
            [sys.executable, str(EXAMPLES / "prefill_worker.py")],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**env, "DEMO_EXIT_AFTER_PARK": "true", **(prefill_env or {})},
        )  # fmt: skip
        output, _ = decode.communicate(timeout=60)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait(timeout=10)
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    assert decode.returncode == 0, output
    return prefill, output, time.monotonic() - started


def assert_demo_table(output: str) -> dict[str, list[str]]:
    rows = demo_rows(output)
    assert [rows[name][1:4] for name in ("on-time", "partial", "late", "queued")] == [
        ["remote", "-", "8/8"],
        ["partial", "WAIT_TIMEOUT", "4/8"],
        ["recompute", "REAPED", "0/4"],
        ["remote", "-", "6/6"],
    ], output
    # ... load time "ms", the computed chunks, then whether the tokens match.
    assert all(row[row.index("ms") + 2] == "yes" for row in rows.values()), output
    assert "tokens match a local prefill: 4 of 4" in output
    assert "is bitwise a local full prefill's" in output
    return rows


def parked_via(prefill_stdout: str) -> dict[str, str]:
    """Each request's `via` from the prefill worker's "parked NAME ID: ... via T ..." lines."""
    return dict(re.findall(r"parked (\S+) +\S+: .* via (\S+) in ", prefill_stdout))


def test_demo_workers_decode_every_request_as_a_local_prefill_would(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    """A producer with the gRPC stream only: everything goes over it."""
    producer = producer_process(unbound_store_timeout_s=1, max_lease_s=600)
    prefill, output, took = run_workers(producer, tmp_path)

    assert "parked partial" in prefill.stdout and ": 4 of 8 chunks" in prefill.stdout
    assert parked_via(prefill.stdout) == dict.fromkeys(NAMES, "grpc"), prefill.stdout
    rows = assert_demo_table(output)
    assert [rows[name][4] for name in NAMES] == ["grpc", "grpc", "-", "grpc"], output
    assert took < 30, f"the demo took {took:.1f}s"


def test_demo_workers_park_over_shared_memory_and_load_over_the_data_port(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    """The compose demo's data plane on one host: the prefill worker parks its KV from shared
    memory it lends the producer, the decode worker (which loads into its model's cache, not
    into a lent buffer) takes the zero-copy TCP data port. DEMO_EXPECT_TRANSPORT makes each
    worker exit 1 when a request took another way; the output says which way each took."""
    # A short folder: a Unix socket path has a limit of about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="kvpark-") as run_dir:
        producer = producer_process(
            unbound_store_timeout_s=1,
            max_lease_s=600,
            data_listen="127.0.0.1:0",
            shm_socket=f"{run_dir}/shm.sock",
        )
        prefill, output, _ = run_workers(
            producer,
            tmp_path,
            prefill_env={"DEMO_EXPECT_TRANSPORT": "shm"},
            decode_env={"DEMO_EXPECT_TRANSPORT": "tcp"},
        )

    assert parked_via(prefill.stdout) == dict.fromkeys(NAMES, "shm"), prefill.stdout
    assert "in 8 parks, streamed chunk by chunk" in prefill.stdout
    rows = assert_demo_table(output)
    assert [rows[name][4] for name in NAMES] == ["tcp", "tcp", "-", "tcp"], output
    assert f"offers shm {run_dir}/shm.sock, tcp :" in output


def test_demo_workers_refuse_an_unexpected_transport(
    producer_process: Callable[..., ProducerProcess], tmp_path: Path
) -> None:
    """DEMO_EXPECT_TRANSPORT is a real check: against a producer without shared memory the
    prefill worker that expects it stops after its first park, exit 1, saying why."""
    producer = producer_process(unbound_store_timeout_s=1, max_lease_s=600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPARK_", "DEMO_"))}
    prefill = subprocess.run(
        [sys.executable, str(EXAMPLES / "prefill_worker.py")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**env, "DEMO_TARGET": producer.target, "DEMO_EXIT_AFTER_PARK": "true",
             "DEMO_EXPECT_TRANSPORT": "shm", "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    assert prefill.returncode == 1, prefill.stdout + prefill.stderr
    assert "UNEXPECTED: on-time was parked via grpc, not shm" in prefill.stdout
    assert "parked partial" not in prefill.stdout
