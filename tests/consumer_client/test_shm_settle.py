"""A load over shared memory that is cut off while another load copies into the same shared
buffer, against a real producer: the cut-off load settles its own call only. It returns within
its own timeout, sure that no producer copy can still land in its part of the buffer, while
the other load keeps the lend, completes over shared memory, and later loads still use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_for, wait_until

from kvpark import AsyncKVConsumer, KVConsumer, KVParker, Reason

CHUNK = MiB
SETTINGS: dict[str, Any] = {"max_chunk_bytes": 4 * MiB, "pool_bytes": 64 * MiB}
CUT_OFF_TIMEOUT_S = 0.5
# How far past its own timeout a load may return (as in test_deadlines.py).
MARGIN_S = 0.6


@pytest.fixture
def shm_socket() -> Iterator[str]:
    # Unix socket paths are short (107 bytes): pytest's tmp_path can be too long.
    directory = tempfile.mkdtemp(prefix="kvpark-")
    yield os.path.join(directory, "shm.sock")
    shutil.rmtree(directory, ignore_errors=True)


def chunks(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(n)]


def unsettled(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Client warnings: a settle that could not tell whether a copy may still land."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "kvpark.client" and r.levelno >= logging.WARNING
    ]


async def test_a_cut_off_load_settles_alone_while_a_load_into_the_same_buffer_waits(
    shm_socket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two loads into the two halves of one shared buffer, both waiting for chunks not yet
    parked. The second one's timeout fires: it returns within that timeout, with no producer
    call left that could copy into its half. The first goes on over shared memory under the
    same lend and completes once its last chunk is parked; a later load into the cut-off
    half uses shared memory too, still under that lend."""
    caplog.set_level(logging.INFO, logger="kvpark.client")
    data = chunks(4, seed=21)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        shm = server.shm
        assert shm is not None

        def run() -> tuple[Any, float, Any, Any, bytes]:
            with (
                KVParker(server.target) as parker,
                KVConsumer(server.target, transport="shm", shm_socket=shm_socket) as c,
                ThreadPoolExecutor(1) as pool,
            ):
                into = c.shared_buffer(4 * CHUNK)
                waiting_half, cut_half = into[: 2 * CHUNK], into[2 * CHUNK :]
                assert parker.park("waits", {0: data[0]}, total_chunks=2).ok
                assert parker.park("cut", {0: data[2]}, total_chunks=2).ok
                first_landed = threading.Event()
                waiting = pool.submit(
                    c.load,
                    "waits",
                    num_chunks=2,
                    into=waiting_half,
                    timeout=30,
                    on_chunk=lambda *_: first_landed.set(),
                )
                wait_for(first_landed.is_set, what="the waiting load's first chunk")

                started = time.monotonic()
                cut = c.load("cut", num_chunks=2, into=cut_half, timeout=CUT_OFF_TIMEOUT_S)
                elapsed = time.monotonic() - started
                # The waiting load still holds the lend, which stays for both halves.
                assert not waiting.done()
                assert shm.lend_count == 1 and shm.held_lends == 1

                assert parker.park("waits", {1: data[1]}, total_chunks=2).ok
                completed = waiting.result(timeout=10)
                assert parker.park("cut", {1: data[3]}, total_chunks=2).ok
                later = c.load("cut", num_chunks=2, into=cut_half, timeout=10)
                assert shm.lend_count == 1, "the buffer was not lent anew"
                return cut, elapsed, completed, later, into.tobytes()

        cut, elapsed, completed, later, landed = await asyncio.to_thread(run)
        assert cut.reason is Reason.TIMEOUT and cut.transport == "shm" and cut.chunks_loaded == 1
        assert elapsed <= CUT_OFF_TIMEOUT_S + MARGIN_S, f"the cut-off load took {elapsed:.2f}s"
        assert completed.ok and completed.transport == "shm", completed
        assert later.ok and later.transport == "shm", later
        assert landed == b"".join(d.tobytes() for d in data)
        assert unsettled(caplog) == []
        await wait_until(lambda: shm.lend_count == 0, what="the lend ended with the client")
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="confirmed")
        server.lot.check_invariants()


async def test_an_async_cut_off_load_settles_alone_while_a_load_into_the_same_buffer_waits(
    shm_socket: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The async client settles a cut-off load the same way: within its own timeout, while a
    load into the other half of the buffer goes on over shared memory under the same lend."""
    caplog.set_level(logging.INFO, logger="kvpark.client")
    data = chunks(4, seed=22)
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:
        shm = server.shm
        assert shm is not None

        def park(kid: str, parts: dict[int, np.ndarray]) -> None:
            with KVParker(server.target) as parker:
                assert parker.park(kid, parts, total_chunks=2).ok

        await asyncio.to_thread(park, "waits", {0: data[0]})
        await asyncio.to_thread(park, "cut", {0: data[2]})
        async with AsyncKVConsumer(server.target, transport="shm", shm_socket=shm_socket) as c:
            into = c.shared_buffer(4 * CHUNK)
            waiting_half, cut_half = into[: 2 * CHUNK], into[2 * CHUNK :]
            first_landed = asyncio.Event()
            waiting = asyncio.ensure_future(
                c.load(
                    "waits",
                    num_chunks=2,
                    into=waiting_half,
                    timeout=30,
                    on_chunk=lambda *_: first_landed.set(),
                )
            )
            await asyncio.wait_for(first_landed.wait(), 10)

            started = time.monotonic()
            cut = await c.load("cut", num_chunks=2, into=cut_half, timeout=CUT_OFF_TIMEOUT_S)
            elapsed = time.monotonic() - started
            assert cut.reason is Reason.TIMEOUT and cut.transport == "shm"
            assert elapsed <= CUT_OFF_TIMEOUT_S + MARGIN_S, f"the cut-off load took {elapsed:.2f}s"
            assert not waiting.done() and shm.lend_count == 1 and shm.held_lends == 1

            await asyncio.to_thread(park, "waits", {1: data[1]})
            completed = await asyncio.wait_for(waiting, 10)
            assert completed.ok and completed.transport == "shm", completed
            await asyncio.to_thread(park, "cut", {1: data[3]})
            later = await c.load("cut", num_chunks=2, into=cut_half, timeout=10)
            assert later.ok and later.transport == "shm", later
            assert shm.lend_count == 1, "the buffer was not lent anew"
            assert into.tobytes() == b"".join(d.tobytes() for d in data)
        assert unsettled(caplog) == []
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="confirmed")
        server.lot.check_invariants()
