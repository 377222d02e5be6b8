"""A data connection that ends after the producer accepted its ticket and before the first
frame, against a real producer: the load's limits still bound it.

The `0x01` answer is the first byte of the out-of-band path, so from then on the fallback rule
no longer applies (docs/protocol.md, Fallback): the load goes on waiting for the stream's
TransferDone, and its first-chunk limit, which nothing has met yet, still ends that wait.
Here a middlebox closes (or resets) the consumer's side right after the answer and reads
nothing more from the producer, which then holds the Fetch until its own stall bound; before,
such a load waited for that bound, far past its first-chunk limit."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_until

from kvpark import AsyncKVConsumer, KVConsumer, KVParker, Reason, Timeout
from kvpark.tcp_frames import TICKET_BYTES

CHUNKS = 8
CHUNK = 4 * MiB  # 32 MiB in all: more than loopback's socket buffers take unread
FIRST_CHUNK_S = 1.0
TOTAL_S = 30.0
# The producer cuts a Fetch whose consumer reads nothing off after this: well past the
# first-chunk limit, so a load that ends near the limit was ended by it.
STALL_S = 6.0
SETTINGS: dict[str, Any] = {
    "data_listen": "127.0.0.1:0",
    "max_chunk_bytes": CHUNK,
    "pool_bytes": 64 * MiB,
    "fetch_stall_timeout_s": STALL_S,
}
# What the load may take beyond its limit on a busy machine.
MARGIN_S = 1.5


@contextmanager
def closing_after_answer(upstream_port: int, *, reset: bool) -> Iterator[int]:
    """A port in front of the producer's data port, as a middlebox that breaks connections: it
    forwards the consumer's ticket and the producer's one-byte answer, then closes the
    consumer's side before any frame (with a reset when `reset`) and reads nothing more from
    the producer, whose connection it holds open until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def relay() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                consumer, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            producer = socket.create_connection(("127.0.0.1", upstream_port))
            held.append(producer)
            with consumer:
                consumer.settimeout(10)
                producer.settimeout(10)
                producer.sendall(consumer.recv(TICKET_BYTES, socket.MSG_WAITALL))
                consumer.sendall(producer.recv(1))
                if reset:
                    linger = struct.pack("ii", 1, 0)
                    consumer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(10)
        listener.close()
        for sock in held:
            sock.close()


def _park(target: str, kid: str) -> None:
    with KVParker(target) as parker:
        assert parker.park(kid, [np.ones(CHUNK, np.uint8)] * CHUNKS).ok


async def _load(flavour: str, target: str, kid: str, timeout: Timeout) -> Any:
    if flavour == "async":
        async with AsyncKVConsumer(target, transport="tcp", timeout=timeout) as consumer:
            return await consumer.load(kid, num_chunks=CHUNKS, confirm=False)

    def run() -> Any:
        with KVConsumer(target, transport="tcp", timeout=timeout) as consumer:
            return consumer.load(kid, num_chunks=CHUNKS, confirm=False)

    return await asyncio.to_thread(run)


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
async def test_a_data_connection_ended_before_its_first_frame_ends_by_the_first_chunk_limit(
    flavour: str, reset: bool
) -> None:
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None
        await asyncio.to_thread(_park, server.target, "k")
        with closing_after_answer(server.data.port, reset=reset) as port:
            server.servicer.offer(data=server.data, data_address=f"127.0.0.1:{port}", shm=None)
            timeout = Timeout(TOTAL_S, first_chunk_s=FIRST_CHUNK_S)
            result = await _load(flavour, server.target, "k", timeout)
            # The cancel gave the id back to the producer, which loads it again.
            await wait_until(lambda: server.lot.bound_count == 0, what="the Fetch to end")
        server.lot.check_invariants()
        assert result.elapsed_s < FIRST_CHUNK_S + MARGIN_S, result
        assert result.reason is Reason.TIMEOUT and result.chunks_loaded == 0, result
        assert result.detail.startswith("first chunk timeout"), result
        assert result.transport == "tcp", result
        server.servicer.offer(
            data=server.data, data_address=f"127.0.0.1:{server.data.port}", shm=None
        )
        again = await _load(flavour, server.target, "k", Timeout(TOTAL_S))
        assert again.ok and again.transport == "tcp", again


async def test_the_producer_cutting_a_fetch_off_is_not_reported_as_the_loads_own_timeout() -> None:
    """Without a first-chunk limit the producer's stall bound ends such a load: a timeout,
    but the producer's, long before the load's own 30 s, and the detail says so."""
    async with running_producer(**{**SETTINGS, "fetch_stall_timeout_s": 1.0}) as server:
        assert server.data is not None
        await asyncio.to_thread(_park, server.target, "s")
        with closing_after_answer(server.data.port, reset=False) as port:
            server.servicer.offer(data=server.data, data_address=f"127.0.0.1:{port}", shm=None)
            result = await _load("async", server.target, "s", Timeout(TOTAL_S))
            await wait_until(lambda: server.lot.bound_count == 0, what="the Fetch to end")
        server.lot.check_invariants()
    assert result.reason is Reason.TIMEOUT and result.chunks_loaded == 0, result
    assert result.detail.startswith("the producer cut the Fetch off after"), result
    assert "fetch_stall_timeout_s" in result.detail, result
    assert result.elapsed_s < TOTAL_S / 2, result
