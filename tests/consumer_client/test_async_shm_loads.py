"""Asyncio loads over shared memory into ordinary memory (through the client's staging buffer),
against real producers: a load cancelled while it lends the staging buffer gives it back, a
load that needs a bigger staging buffer keeps to its timeout when the producer stopped
answering, the copies out of the staging buffer run off the event loop, and a load cancelled
twice, the second time while its cut-off call settles, ends only once the settle did, and a
staging buffer retired for a late copy is replaced by one of its size.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import MiB, ProducerProcess, park, running_producer, stub_for, wait_until
from consumer_support import park_sync

from kvpark import AsyncKVConsumer, AsyncKVParker, Reason

# How far past its own timeout a load may return (its lends and settles included).
MARGIN_S = 1.0


def chunks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(n)]


async def test_a_load_cancelled_while_it_lends_the_staging_buffer_gives_it_back(
    shm_socket: str,
) -> None:
    async with running_producer(shm_socket=shm_socket) as server:
        assert server.shm is not None
        async with AsyncKVParker(server.target, transport="grpc") as parker:
            assert (await parker.park("kv", chunks(2))).ok
        async with AsyncKVConsumer(server.target, transport="shm", confirm=False) as consumer:
            shared = consumer.shared_buffer(2 * MiB)
            assert (await consumer.load("kv", num_chunks=2, into=shared)).transport == "shm"
            assert server.shm.lend_count == 1

            async def over_shm_staged() -> bool:
                result = await consumer.load("kv", num_chunks=2, into=np.empty(2 * MiB, np.uint8))
                assert result.ok, result
                return result.transport == "shm"

            cancelled = asyncio.create_task(over_shm_staged())
            await asyncio.sleep(0)  # it hands its begin step to a load thread
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            # That step went on, took the staging buffer and lent it.
            await wait_until(lambda: server.shm.lend_count == 2, what="the staging buffer lent")
            # Once it is done, loads into ordinary memory are staged again.
            await wait_until(over_shm_staged, what="a load staged over shared memory")


async def test_a_load_that_grows_the_staging_buffer_keeps_its_timeout_when_the_producer_stops(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    """A first load leaves a 1 MiB staging buffer lent. The producer stops (SIGSTOP); a 4 MiB
    load needs a new staging buffer, and ending the old one's lend waits on the producer too:
    within the load's time, not a handshake timeout of its own."""
    producer = producer_process(shm_socket=shm_socket)
    park_sync(producer.target, "small", {0: bytes(MiB)})
    park_sync(producer.target, "big", {i: bytes(MiB) for i in range(4)})
    timeout = 0.5
    async with AsyncKVConsumer(producer.target, transport="shm", timeout=timeout) as consumer:
        first = await consumer.load("small", num_chunks=1, into=np.empty(MiB, np.uint8))
        assert first.ok and first.transport == "shm", first
        os.kill(producer.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            result = await consumer.load("big", num_chunks=4, into=np.empty(4 * MiB, np.uint8))
            elapsed = time.monotonic() - started
        finally:
            os.kill(producer.proc.pid, signal.SIGCONT)
    assert result.reason is Reason.TIMEOUT, result
    assert elapsed < timeout + MARGIN_S, f"a {timeout}s load returned after {elapsed:.2f}s"


async def test_chunks_are_copied_out_of_the_staging_buffer_off_the_event_loop(
    shm_socket: str,
) -> None:
    """`on_chunk` runs right after a chunk was verified and copied into `into`: where it runs,
    the copy ran."""
    data = chunks(8, seed=3)
    async with running_producer(shm_socket=shm_socket) as server:
        async with AsyncKVParker(server.target, transport="grpc") as parker:
            assert (await parker.park("kv", data)).ok
        copied_on: set[int] = set()
        async with AsyncKVConsumer(server.target, transport="shm") as consumer:
            into = np.empty(8 * MiB, np.uint8)
            result = await consumer.load(
                "kv",
                num_chunks=8,
                into=into,
                on_chunk=lambda *_: copied_on.add(threading.get_ident()),
            )
    assert result.ok and result.transport == "shm", result
    assert into.tobytes() == b"".join(c.tobytes() for c in data)
    assert copied_on and threading.get_ident() not in copied_on


@pytest.mark.timeout(60)
async def test_a_load_cancelled_again_while_it_settles_returns_once_the_settle_ended(
    shm_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged shm load waits for chunk 1 of 2; its caller cancels it, and cancels again
    while the cut-off call settles. The load still ends only once the settle did: until the
    producer said no copy of that call runs, one may land in the caller's memory."""
    async with running_producer(shm_socket=shm_socket) as server:
        async with stub_for(server) as stub:
            await park(stub, "half", {0: bytes(MiB)}, total=2)
        async with AsyncKVConsumer(server.target, transport="shm", confirm=False) as consumer:
            shm = consumer._core.shm
            settling, settle_may_run, settled = (threading.Event() for _ in range(3))
            real_settle = shm.settle

            def held_settle(*args: object) -> None:
                settling.set()
                settle_may_run.wait(30)
                real_settle(*args)  # type: ignore[arg-type]
                settled.set()

            monkeypatch.setattr(shm, "settle", held_settle)
            first_landed = asyncio.Event()
            loading = asyncio.create_task(
                consumer.load(
                    "half",
                    num_chunks=2,
                    into=np.empty(2 * MiB, np.uint8),
                    on_chunk=lambda *_: first_landed.set(),
                )
            )
            await asyncio.wait_for(first_landed.wait(), 10)
            loading.cancel()
            await wait_until(settling.is_set, what="the settle's thread started")
            loading.cancel()
            try:
                for _ in range(20):  # turns of the loop, for the second cancel to land
                    await asyncio.sleep(0)
                assert not loading.done(), "the load ended before its settle did"
            finally:
                settle_may_run.set()
            with pytest.raises(asyncio.CancelledError):
                await loading
            assert settled.is_set()


@pytest.mark.timeout(60)
async def test_a_staging_buffer_retired_for_a_late_copy_is_replaced_by_one_of_its_size(
    shm_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut-off load whose settle could not hear from the producer leaves the staging buffer
    retired; the next load stages through a new one, no bigger than the loads need."""
    async with running_producer(shm_socket=shm_socket) as server:
        async with stub_for(server) as stub:
            await park(stub, "half", {0: bytes(MiB)}, total=2)
            await park(stub, "full", {0: bytes(MiB), 1: bytes(MiB)}, total=2)
        async with AsyncKVConsumer(server.target, transport="shm", confirm=False) as consumer:
            shm = consumer._core.shm
            into = np.empty(2 * MiB, np.uint8)
            assert (await consumer.load("full", num_chunks=2, into=into)).transport == "shm"
            size = shm._staging.nbytes
            # The settle runs out of time: a late copy may still land in the staging buffer.
            monkeypatch.setattr(shm, "settle", lambda *_: None)
            for _ in range(3):
                first_landed = asyncio.Event()
                loading = asyncio.create_task(
                    consumer.load(
                        "half", num_chunks=2, into=into, on_chunk=lambda *_, e=first_landed: e.set()
                    )
                )
                await asyncio.wait_for(first_landed.wait(), 10)
                loading.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await loading
                assert shm._staging_tainted
                staging = shm._staging
                result = await consumer.load("full", num_chunks=2, into=into)
                assert result.ok and result.transport == "shm", result
                assert shm._staging is not staging, "a retired staging buffer was used again"
                assert shm._staging.nbytes == size
