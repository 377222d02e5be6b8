"""The demo and the happy paths across containers (compose suite, see conftest.py)."""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest

from kvpark.client import KVConsumer, LoadPath, Reason, State

from .conftest import FETCH_TOKEN, PARK_TOKEN
from .stack import (
    DEMO_REQUESTS,
    LEASE_S,
    Stack,
    demo_rows,
    loaded_via,
    park,
    parked_via,
    run_demo,
    tokens_match,
    wait_for,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]
KiB = 1024


def random_chunks(n: int, size: int) -> dict[int, bytes]:
    return {i: os.urandom(size) for i in range(n)}


def test_demo_across_containers(producer: Stack) -> None:
    """Prefill container -> producer container -> decode container: the README's demo. The
    prefill worker parks the reference model's KV; the decode worker loads it (all, a prefix,
    nothing), prefills the rest, decodes, and exits 0 only when each request took its expected
    path and its KV and tokens equal a local full prefill's. The prefill worker, which shares
    the producer's shm volume, parks every request over shared memory; the decode worker, which
    does not, loads every byte over the TCP data port."""
    demo = run_demo(producer)
    output = demo.decode
    rows = demo_rows(output)
    assert [rows[name][1:4] for name in DEMO_REQUESTS] == [
        ["remote", "-", "8/8"],
        ["partial", "WAIT_TIMEOUT", "4/8"],
        ["recompute", "REAPED", "0/4"],
        ["remote", "-", "6/6"],
    ], output
    assert [tokens_match(rows[name]) for name in DEMO_REQUESTS] == ["yes"] * 4, output
    assert "tokens match a local prefill: 4 of 4" in output
    assert "is bitwise a local full prefill's" in output
    assert parked_via(demo.prefill) == dict.fromkeys(DEMO_REQUESTS, "shm"), demo.prefill
    assert "on-time  demo-" in demo.prefill and "via shm in 8 parks" in demo.prefill
    # `late` was reaped before its load: no bytes, no transport.
    assert loaded_via(output) == ["tcp", "tcp", "-", "tcp"], output
    assert "offers shm /run/kvpark/shm.sock, tcp producer:50052, grpc" in output


def test_happy_path_host_to_container(producer: Stack) -> None:
    """Parked from the host over the published port, loaded by a decode container over the
    compose network: the bytes arrive intact."""
    kid = f"happy-{time.time_ns()}"
    chunks = random_chunks(8, 256 * KiB)
    park(producer.target, PARK_TOKEN, kid, chunks, total_chunks=8)
    expected = hashlib.sha256(b"".join(chunks.values())).hexdigest()
    # Starting a container takes longer than the test producer's 2 s lease: hold it, as a
    # decode worker does for a request waiting in its queue.
    with KVConsumer(producer.target, token=FETCH_TOKEN) as kv:
        kv.extend_leases([kid], 30)

    result = producer.run_loader(kid, "--chunks", "8", "--buffer-bytes", str(8 * 256 * KiB))

    assert result["ok"] and result["path"] == "remote", result
    assert result["chunks_loaded"] == 8 and result["bytes"] == 8 * 256 * KiB
    assert result["sha256"] == expected


def test_happy_path_over_published_port(producer: Stack) -> None:
    """A decode worker outside the compose network reaches the producer through its published
    port and loads into its own numpy buffer; the id is consumed afterwards."""
    kid = f"host-{time.time_ns()}"
    chunks = random_chunks(4, 512 * KiB)
    park(producer.target, PARK_TOKEN, kid, chunks, total_chunks=4)
    buf = np.empty(4 * 512 * KiB, dtype=np.uint8)
    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=10) as kv:
        result = kv.load(kid, num_chunks=4, into=buf)
        assert result.ok, result
        assert buf.tobytes() == b"".join(chunks.values())
        # The client confirms the delivery in the background; then the producer frees the id.
        wait_for(
            lambda: kv.lookup([kid])[0].reason is Reason.ALREADY_CONSUMED,
            timeout=10,
            what="the delivery to be confirmed",
        )


def test_late_fetch_answered_reaped_at_once(producer: Stack) -> None:
    """A fetch after the lease ran out is answered REAPED in one round trip, from a decode
    container and from the host, far below the load timeout."""
    kid = f"late-{time.time_ns()}"
    park(producer.target, PARK_TOKEN, kid, random_chunks(4, 64 * KiB), total_chunks=4)
    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=10) as kv:
        reaped = wait_for(
            lambda: (s := kv.lookup([kid])[0]).state is State.TOMBSTONED and s,
            timeout=LEASE_S + 10,
            what="the id to be reaped",
        )
        assert reaped.reason is Reason.REAPED

        result = producer.run_loader(kid, "--chunks", "4", "--buffer-bytes", str(256 * KiB))
        assert result["reason"] == "REAPED" and result["path"] == "recompute", result
        assert result["recompute_calls"] == [0]
        assert result["elapsed_s"] < 0.5, result

        host = kv.load(kid, num_chunks=4, timeout=10)
        assert host.reason is Reason.REAPED and host.path is LoadPath.RECOMPUTE
        assert host.elapsed_s < 0.5, host
    print(
        f"late: REAPED in {result['elapsed_s'] * 1000:.1f} ms (container), "
        f"{host.elapsed_s * 1000:.1f} ms (host)"
    )
