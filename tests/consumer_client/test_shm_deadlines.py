"""A shared-memory load keeps to the limits that bound it, not to the total alone: the lend
before its Fetch takes a share of the size-scaled budget (counted from the load's start), and
a load cut off by its first-chunk limit waits for a late copy no longer than that limit
allows. And a keep-alive round is bounded by the interval worked out from the leases. Real
producers; a silent shm socket and a frozen producer (SIGSTOP) stand for the slow parts."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import running_producer, start_producer_process
from consumer_support import park_sync

from kvpark import AsyncKVConsumer, KVConsumer, KVParker, Reason, Timeout
from kvpark.client import _shm as kvpark_shm
from kvpark.client.keepalive import _KeepAliveState

# Far above what each load needs when it keeps to its limit (tens of ms, or the limit plus
# the 0.25 s settle grace), below what it took when it did not (2 s and more).
BOUND_S = 1.6


@pytest.fixture
def silent_socket() -> Iterator[str]:
    """A Unix socket that accepts connections into its backlog and never answers."""
    directory = tempfile.mkdtemp(prefix="kvpark-")
    path = os.path.join(directory, "silent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind(path)
        silent.listen(8)
        yield path
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_lend_keeps_to_the_size_scaled_budget(flavour: str, silent_socket: str) -> None:
    budget = Timeout(20, base_s=0.2, per_gib_s=1.0)  # 0.2 s for 4 KiB
    async with running_producer() as server:
        with KVParker(server.target, transport="grpc") as parker:
            assert (await asyncio.to_thread(parker.park, "kv", [b"x" * 4096])).ok
        if flavour == "sync":

            def load() -> object:
                with KVConsumer(server.target, shm_socket=silent_socket) as consumer:
                    consumer.server_info()
                    into = consumer.shared_buffer(4096)
                    started_here = time.monotonic()
                    result = consumer.load("kv", num_chunks=1, into=into, timeout=budget)
                    return result, time.monotonic() - started_here

            result, took = await asyncio.to_thread(load)
        else:
            async with AsyncKVConsumer(server.target, shm_socket=silent_socket) as consumer:
                await consumer.server_info()
                into = consumer.shared_buffer(4096)
                started = time.monotonic()
                result = await consumer.load("kv", num_chunks=1, into=into, timeout=budget)
                took = time.monotonic() - started
    assert took < BOUND_S, (took, result)


def test_a_load_cut_off_before_its_first_chunk_settles_within_that_limit(tmp_path: Path) -> None:
    directory = tempfile.mkdtemp(prefix="kvpark-")
    producer = start_producer_process(tmp_path, shm_socket=os.path.join(directory, "s.sock"))
    try:
        for kid in ("warm", "kv"):
            park_sync(producer.target, kid, {0: b"x" * 65536})
        with KVConsumer(producer.target, transport="shm") as consumer:
            into = consumer.shared_buffer(65536)
            assert consumer.load("warm", num_chunks=1, into=into).transport == "shm"
            os.kill(producer.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            result = consumer.load(
                "kv", num_chunks=1, into=into, timeout=Timeout(10, first_chunk_s=0.5)
            )
            took = time.monotonic() - started
            os.kill(producer.proc.pid, signal.SIGCONT)
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
        producer.proc.kill()
        producer.proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
    assert result.reason is Reason.TIMEOUT and "first chunk" in result.detail, result
    assert took < BOUND_S, took


def test_a_keep_alive_round_is_bounded_by_the_interval_from_the_leases() -> None:
    state = _KeepAliveState(["kv"], None, 0.0)
    info = SimpleNamespace(unbound_store_timeout_s=1.5)
    assert state.interval(info) == pytest.approx(0.5)
    assert state.call_timeout(info) == pytest.approx(0.5)
    assert _KeepAliveState(["kv"], 30.0, 0.0).call_timeout(info) == 5.0  # at most 5 s
    assert 0 < _KeepAliveState(["kv"], None, 0.0).call_timeout(None) <= 5.0


@pytest.mark.parametrize("replacement_fails_once", [False, True])
def test_a_staging_buffer_a_late_copy_may_still_reach_is_not_used_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replacement_fails_once: bool
) -> None:
    """A load staged through the client's lent buffer is cut off while the producer is frozen,
    so the producer cannot say its copy stopped: the next load stages through a new buffer,
    so that late copy cannot land under chunks the next load already verified."""
    directory = tempfile.mkdtemp(prefix="kvpark-")
    producer = start_producer_process(tmp_path, shm_socket=os.path.join(directory, "s.sock"))
    try:
        for kid in ("warm", "cut", "mid", "next"):
            park_sync(producer.target, kid, {0: bytes([len(kid)]) * 65536})
        with KVConsumer(producer.target, transport="shm") as consumer:
            into = bytearray(65536)  # not a shared buffer: loads go through the staging one
            assert consumer.load("warm", num_chunks=1, into=into).transport == "shm"
            staging = consumer._core.shm._staging
            os.kill(producer.proc.pid, signal.SIGSTOP)
            cut = consumer.load(
                "cut", num_chunks=1, into=into, timeout=Timeout(10, first_chunk_s=0.3)
            )
            os.kill(producer.proc.pid, signal.SIGCONT)
            if replacement_fails_once:  # out of descriptors for the new buffer, once
                made = kvpark_shm.SharedBuffer
                monkeypatch.setattr(kvpark_shm, "SharedBuffer", _fails(OSError(24, "EMFILE")))
                meanwhile = consumer.load("mid", num_chunks=1, into=into)
                assert meanwhile.ok and meanwhile.transport == "grpc", meanwhile
                monkeypatch.setattr(kvpark_shm, "SharedBuffer", made)
            after = consumer.load("next", num_chunks=1, into=into)
            assert consumer._core.shm._staging is not staging
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
        producer.proc.kill()
        producer.proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
    assert cut.reason is Reason.TIMEOUT, cut
    assert after.ok and after.transport == "shm" and bytes(into) == bytes([4]) * 65536, after


def _fails(exc: Exception) -> object:
    def make(*args: object, **kwargs: object) -> object:
        raise exc

    return make
