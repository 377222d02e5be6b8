"""Asyncio loads over shared memory into ordinary memory (through the client's staging buffer),
against real producers: a load that needs a bigger staging buffer keeps to its timeout when
the producer stopped answering.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import MiB, ProducerProcess
from consumer_support import park_sync

from kvpark import AsyncKVConsumer, Reason

# How far past its own timeout a load may return (its lends and settles included).
MARGIN_S = 1.0


@pytest.fixture
def shm_socket() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="kvpark-")  # Unix socket paths are short
    yield os.path.join(directory, "shm.sock")
    shutil.rmtree(directory, ignore_errors=True)


def chunks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, MiB, dtype=np.uint8) for _ in range(n)]


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
