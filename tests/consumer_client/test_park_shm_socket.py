"""A parker whose `shm_socket` is another producer's (a second producer on the host, here a
real one) never lends to it: it checks the socket's epoch against its producer's before its
first lend, a staging lend included, and before it uses a connection or a lend made while it
did not know that epoch yet. Its parks go over the gRPC stream in one call each, and the
other process is left with no connection and no lend. A parker that parks by `batch()` alone
gets shared memory again after its producer restarted on the same socket path: the batches'
answers name the new process, so its socket is not judged another producer's for ever."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import MiB, ProducerProcess, free_port, running_producer, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, KVParker, ParkResult
from kvpark.client import _shm


def blocks(n: int) -> list[np.ndarray]:
    return [np.full(MiB, i, np.uint8) for i in range(n)]


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_staged_park_never_lends_to_another_producers_socket(
    flavour: str, shm_socket: str
) -> None:
    other = shm_socket + ".other"
    async with (
        running_producer(shm_socket=shm_socket) as server,
        running_producer(shm_socket=other) as stranger,
    ):
        if flavour == "sync":

            def run() -> list[Any]:
                with KVParker(server.target, shm_socket=other, timeout=10) as parker:
                    return [parker.park(f"p{i}", blocks(2)) for i in range(3)]

            results = await in_thread(run)
        else:
            async with AsyncKVParker(server.target, shm_socket=other, timeout=10) as parker:
                results = [await parker.park(f"p{i}", blocks(2)) for i in range(3)]
        assert stranger.shm is not None
        await wait_until(lambda: stranger.shm.connection_count == 0, what="no connection left")
        assert stranger.shm.lend_count == 0
        server.lot.check_invariants()
    for result in results:
        assert result.ok and result.transport == "grpc", result
        assert result.attempts == 1, result  # no Park naming the other process's lend


async def test_a_lend_made_before_the_epoch_was_known_is_not_used_once_it_is(
    shm_socket: str,
) -> None:
    """A connection and a lend made while the producer's epoch was unknown (as a consumer's
    first load makes them) are checked once it is known: the connection is closed, ending
    the lend, and the park goes over the gRPC stream in one call."""
    other = shm_socket + ".other"
    async with (
        running_producer(shm_socket=shm_socket) as server,
        running_producer(shm_socket=other) as stranger,
    ):

        def run() -> tuple[Any, Any]:
            with KVParker(server.target, shm_socket=other, timeout=10) as parker:
                kv = parker.shared_buffer(2 * MiB)
                kv[:] = 5
                assert parker.info is None
                assert parker._core.shm.lend_of(kv) is not None  # lent, unchecked
                parker.server_info()
                result = parker.park("shared", [kv[:MiB], kv[MiB:]])
                return result, parker._core.shm.lend_of(kv)

        result, lent_after = await in_thread(run)
        assert stranger.shm is not None
        await wait_until(lambda: stranger.shm.connection_count == 0, what="no connection left")
        assert stranger.shm.lend_count == 0
        server.lot.check_invariants()
    assert result.ok and result.transport == "grpc", result
    assert result.attempts == 1, result
    assert lent_after is None  # shared memory is left out for a while, not tried again


async def park_batch(flavour: str, parker: Any, kid: str, kv: np.ndarray) -> ParkResult:
    """One streaming batch of two chunks, both in the parker's shared buffer `kv`."""
    half = kv.size // 2
    if flavour == "sync":

        def run() -> ParkResult:
            with parker.batch(kid, total_chunks=2) as batch:
                batch.put(0, kv[:half])
                batch.put(1, kv[half:])
            assert batch.result is not None
            return batch.result

        result: ParkResult = await in_thread(run)
        return result
    async with parker.batch(kid, total_chunks=2) as batch:
        await batch.put(0, kv[:half])
        await batch.put(1, kv[half:])
    assert batch.result is not None
    return batch.result


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_batches_alone_get_shared_memory_again_after_the_producer_restarted(
    flavour: str,
    shm_socket: str,
    producer_process: Callable[..., ProducerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer is killed (SIGKILL) and a new process serves the same address and shm
    socket path. A parker that only streams batches learns the new epoch from their answers
    and reads ServerInfo again, so the new socket is lent to within a few batches instead of
    being refused as another producer's, every batch over the gRPC stream, for ever. A batch
    that meets the new socket before the parker knows the new epoch may pause shared memory
    for RETRY_AFTER_S: the clock of the parker's shared memory is stepped past that pause
    before each batch instead of waited on."""
    ahead = [0.0]
    monotonic = time.monotonic
    clock = type("Clock", (), {"monotonic": lambda: monotonic() + ahead[0]})
    monkeypatch.setattr(_shm, "time", clock)
    settings = {"listen": f"127.0.0.1:{free_port()}", "shm_socket": shm_socket}
    producer = producer_process(**settings)
    parker: Any = (KVParker if flavour == "sync" else AsyncKVParker)(producer.target, timeout=10)
    try:
        kv = parker.shared_buffer(2 * MiB)
        kv[:] = 7
        before = await park_batch(flavour, parker, "before", kv)
        assert before.ok and before.transport == "shm", before
        producer.proc.send_signal(signal.SIGKILL)
        producer.proc.wait(timeout=10)
        producer_process(**settings)
        after: list[ParkResult] = []
        for i in range(4):
            ahead[0] += _shm.RETRY_AFTER_S
            after.append(await park_batch(flavour, parker, f"after{i}", kv))
            if after[-1].transport == "shm":
                break
        info = parker.info
    finally:
        await parker.aclose() if flavour == "async" else parker.close()
    assert all(r.ok for r in after), after
    assert all(r.producer_epoch != before.producer_epoch for r in after), after
    assert after[-1].transport == "shm", [r.transport for r in after]
    assert info is not None and info.producer_epoch == after[-1].producer_epoch, info
