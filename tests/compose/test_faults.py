"""Faults injected with Docker while a load runs: kill, pause, restart, network cut.

Mid-stream is made deterministic the same way each time: chunks 0..3 of 8 are parked, so the
Fetch is bound, has delivered 4 chunks and waits for chunk 4, which never comes. Every test
starts from a healthy producer (the `producer` fixture restarts it after a kill).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvpark.client import KVConsumer, LoadPath, LoadReport, Reason, State, Timeout

from .conftest import FETCH_TOKEN, PARK_TOKEN
from .stack import Stack, docker, park, serving, wait_for

pytestmark = [pytest.mark.compose, pytest.mark.timeout(900)]
KiB = 1024
CHUNK = 256 * KiB
TOTAL = 8
PARKED = 4  # chunks 0..3 parked, 4..7 never: the stream stalls after 4


def park_half(stack: Stack, kid: str) -> None:
    chunks = {i: os.urandom(CHUNK) for i in range(PARKED)}
    park(stack.target, PARK_TOKEN, kid, chunks, total_chunks=TOTAL)


def state(kv: KVConsumer, kid: str) -> Any:
    return kv.lookup([kid])[0]


def test_producer_killed_mid_stream_falls_back_fast(producer: Stack) -> None:
    """`docker kill` while a load waits mid-stream: the load ends within ~2 s with a transport
    reason and recompute starts exactly at the first chunk that did not arrive."""
    kid = f"kill-{time.time_ns()}"
    park_half(producer, kid)
    buf = np.empty(TOTAL * CHUNK, dtype=np.uint8)
    got_parked = threading.Event()
    recomputed: list[int] = []
    outcome: dict[str, Any] = {}

    def on_chunk(index: int, chunk_id: int, _view: memoryview) -> None:
        if index == PARKED - 1:
            got_parked.set()

    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=Timeout(total_s=20)) as kv:
        kv.server_info()

        def load() -> None:
            outcome["report"] = kv.load_or_recompute(
                kid, num_chunks=TOTAL, into=buf, on_chunk=on_chunk, recompute=recomputed.append
            )
            outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        assert got_parked.wait(10), "the first chunks never arrived"
        with KVConsumer(producer.target, token=FETCH_TOKEN) as observer:
            assert state(observer, kid).state is State.BOUND

        killed = time.monotonic()
        docker("kill", producer.container())
        thread.join(timeout=15)
        assert not thread.is_alive(), "the load did not end after the producer was killed"

    report: LoadReport[Any] = outcome["report"]
    took = outcome["ended"] - killed
    assert report.reason in (Reason.UNAVAILABLE, Reason.CANCELLED), report.result
    assert report.path is LoadPath.PARTIAL
    assert report.result.chunks_loaded == PARKED
    assert recomputed == [PARKED]
    assert took < 2.0, f"fell back {took:.2f}s after the kill"
    print(f"killed: {report.reason} and recompute({PARKED}) {took:.2f}s after `docker kill`")


def test_producer_paused_load_times_out_then_recovers(producer: Stack) -> None:
    """`docker pause`: nothing answers, so the client's own load timeout fires at its configured
    value and the caller recomputes; after `unpause` the producer is healthy and serves."""
    kid = f"pause-{time.time_ns()}"
    park(producer.target, PARK_TOKEN, kid, {i: os.urandom(CHUNK) for i in range(4)}, 4)
    timeout_s = 2.0
    recomputed: list[int] = []
    cid = producer.container()
    with KVConsumer(producer.target, token=FETCH_TOKEN) as kv:
        kv.server_info()  # connected before the pause, as a running decode worker is
        docker("pause", cid)
        try:
            started = time.monotonic()
            report = kv.load_or_recompute(
                kid, num_chunks=4, timeout=Timeout(total_s=timeout_s), recompute=recomputed.append
            )
            took = time.monotonic() - started
        finally:
            docker("unpause", cid)

    assert report.reason is Reason.TIMEOUT, report.result
    assert report.path is LoadPath.RECOMPUTE and recomputed == [0]
    assert timeout_s <= took <= timeout_s + 1.0, f"load took {took:.2f}s for a {timeout_s}s timeout"
    print(f"paused: TIMEOUT after {took:.3f}s (timeout {timeout_s}s)")

    producer.wait_healthy(timeout=30)
    assert serving(producer.target)
    fresh = f"after-pause-{time.time_ns()}"
    chunks = {i: os.urandom(CHUNK) for i in range(4)}
    park(producer.target, PARK_TOKEN, fresh, chunks, 4)
    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=10) as kv:
        result = kv.load(fresh, num_chunks=4)
    assert result.ok, result
    assert result.data.tobytes() == b"".join(chunks.values())


def test_producer_restarted_old_epoch_mismatch_at_once(producer: Stack) -> None:
    """After a restart the parked data is gone with the old process; a fetch naming the old
    epoch is answered EPOCH_MISMATCH at once."""
    kid = f"restart-{time.time_ns()}"
    park(producer.target, PARK_TOKEN, kid, {0: os.urandom(CHUNK)}, 1)
    with KVConsumer(producer.target, token=FETCH_TOKEN) as kv:
        old_epoch = kv.server_info().producer_epoch

    producer.restart()

    with KVConsumer(producer.target, token=FETCH_TOKEN, timeout=10) as kv:
        result = kv.load(kid, num_chunks=1, expected_epoch=old_epoch)
        new_epoch = kv.server_info(refresh=True).producer_epoch
        assert state(kv, kid).state is State.UNKNOWN  # died with the old process
    assert new_epoch != old_epoch
    assert result.reason is Reason.EPOCH_MISMATCH, result
    assert result.elapsed_s < 1.0, result
    print(f"restarted: EPOCH_MISMATCH in {result.elapsed_s * 1000:.1f} ms (first contact included)")


def test_decode_container_disconnected_mid_stream(producer: Stack) -> None:
    """A decode container cut off the network mid-stream: its load timeout fires and it
    recomputes from the first missing chunk. Its cancel never reaches the producer; the
    producer's transport notices the vanished peer by itself (keepalive pings every 5 s, or an
    unreachable-host error first), returns the id to PARKED, and reaps it when the lease ends."""
    kid = f"cut-{time.time_ns()}"
    park_half(producer, kid)
    load_timeout_s = 2.0
    with KVConsumer(producer.target, token=FETCH_TOKEN) as kv:
        # Hold the lease past the producer's detection of the cut (at most ~10 s of keepalive),
        # so PARKED can be seen before the reap.
        kv.extend_leases([kid], 20)
        name = producer.start_oneoff(
            "loader", kid, "--chunks", str(TOTAL), "--buffer-bytes", str(TOTAL * CHUNK),
            "--timeout", str(load_timeout_s), name="cut-loader",
        )  # fmt: skip
        producer.wait_event(
            name, lambda e: e.get("index") == PARKED - 1, timeout=60, what="4 chunks loaded"
        )
        ready = producer.wait_event(name, lambda e: e["event"] == "ready", 1, "ready")
        assert state(kv, kid).state is State.BOUND
        docker("network", "disconnect", "-f", producer.network, name)
        cut_at = time.time()
        assert cut_at < ready["t"] + load_timeout_s, "disconnected only after the load ended"

        result = producer.wait_event(name, lambda e: e["event"] == "result", 30, "result")
        assert result["reason"] == "TIMEOUT", result
        assert result["path"] == "partial" and result["recompute_calls"] == [PARKED], result
        assert result["chunks_loaded"] == PARKED
        assert load_timeout_s <= result["elapsed_s"] <= load_timeout_s + 1.0, result

        parked_again = wait_for(
            lambda: (s := state(kv, kid)).state is State.PARKED and s,
            timeout=20,
            what="the producer to drop the vanished Fetch and park the id again",
        )
        assert parked_again.chunks_parked == PARKED
        detected_s = time.time() - cut_at
        reaped = wait_for(
            lambda: (s := state(kv, kid)).state is State.TOMBSTONED and s,
            timeout=30,
            what="the id to be reaped",
        )
        assert reaped.reason is Reason.REAPED
    print(
        f"cut: loader {result['reason']} after {result['elapsed_s']:.2f}s, recompute({PARKED}); "
        f"PARKED again {detected_s:.1f}s after the cut, then REAPED"
    )
