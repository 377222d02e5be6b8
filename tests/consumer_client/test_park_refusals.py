"""A shared-memory park that the producer refuses, against a real producer, while another
batch still copies from the same lent buffer (so the producer would answer a release of that
lend only once the other batch is done):

- refused for what it sends (a chunk over max_chunk_bytes): that refusal is the answer, at
  once; the lend stays, and the next park goes over shared memory again;
- refused for its lend (the producer no longer holds it, as after a restart): the chunks go
  inline at once, within the park's timeout; nothing waits for the old lend's release.

Sync and async, `park()` and the streaming batch."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_for, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, KVParker, Reason, RequestRejectedError
from kvpark.shm import PARK_ROLE

# The park's own timeout: the other batch holds the lend for longer than that.
TIMEOUT_S = 1.0
OVERSIZE = slice(2 * MiB, 7 * MiB)  # 5 MiB: over the producer's max_chunk_bytes (4 MiB)


def producers_lend(server: Any, parker: Any, kv: np.ndarray) -> Any:
    """The producer's side of the lend the parker made of `kv`."""
    found = parker._core.shm.lend_of(kv)  # the lend the client counts on, made already
    assert found is not None and server.shm is not None
    lent = server.shm.get(found[0], PARK_ROLE)
    assert lent is not None
    return lent


def batch_holding(server: Any, parker: KVParker, kv: np.ndarray) -> tuple[Any, Any]:
    """A batch of two chunks from `kv`, its first put, holding the producer's lend of `kv`
    (its header did: the producer copies the chunks from that mapping until the commit), and
    that lend."""
    assert parker.park("warm", [kv[7 * MiB :]]).ok  # lends `kv`
    lent = producers_lend(server, parker, kv)
    # A new lend is held while the producer maps its pages: once that is over, only the
    # batch below holds it.
    wait_for(lambda: not lent.held, what="the new lend mapped")
    holder = parker.batch("held", total_chunks=2)
    assert holder.put(0, kv[:MiB])
    wait_for(lambda: lent.held, what="the other batch holding the lend")
    return holder, lent


def pieces(kv: np.ndarray, first: int, count: int) -> list[np.ndarray]:
    return [kv[(first + i) * MiB : (first + i + 1) * MiB] for i in range(count)]


async def test_a_park_refused_for_its_chunks_gets_that_refusal_at_once(shm_socket: str) -> None:
    async with running_producer(shm_socket=shm_socket) as server:

        def run() -> tuple[float, Any, Any]:
            with KVParker(server.target, shm_socket=shm_socket, timeout=10) as parker:
                kv = parker.shared_buffer(8 * MiB)
                kv[:] = 7
                holder, _ = batch_holding(server, parker, kv)
                started = time.monotonic()
                with pytest.raises(RequestRejectedError, match="max_chunk_bytes"):
                    parker.park("oversize", [kv[OVERSIZE]], timeout=TIMEOUT_S)
                elapsed = time.monotonic() - started
                assert holder.put(1, kv[MiB : 2 * MiB])
                held = holder.commit()
                after = parker.park("after", [np.full(MiB, 3, np.uint8)], timeout=TIMEOUT_S)
                return elapsed, held, after

        elapsed, held, after = await in_thread(run)
        server.lot.check_invariants()
    assert elapsed < TIMEOUT_S, f"{elapsed:.2f}s"
    assert held.ok and held.transport == "shm", held
    # Nothing owed on the shm connection: the next park lends and goes over shared memory.
    assert after.ok and after.transport == "shm", after


async def test_an_async_park_refused_for_its_chunks_gets_that_refusal_at_once(
    shm_socket: str,
) -> None:
    async with running_producer(shm_socket=shm_socket) as server:
        async with AsyncKVParker(server.target, shm_socket=shm_socket, timeout=10) as parker:
            kv = parker.shared_buffer(8 * MiB)
            kv[:] = 7
            assert (await parker.park("warm", [kv[7 * MiB :]])).ok  # lends `kv`
            lent = producers_lend(server, parker, kv)
            await wait_until(lambda: not lent.held, what="the new lend mapped")
            async with parker.batch("held", total_chunks=2) as holder:
                assert await holder.put(0, kv[:MiB])
                await wait_until(lambda: lent.held, what="the other batch holding the lend")
                started = time.monotonic()
                with pytest.raises(RequestRejectedError, match="max_chunk_bytes"):
                    await parker.park("oversize", [kv[OVERSIZE]], timeout=TIMEOUT_S)
                elapsed = time.monotonic() - started
                assert await holder.put(1, kv[MiB : 2 * MiB])
            after = await parker.park("after", [np.full(MiB, 3, np.uint8)], timeout=TIMEOUT_S)
        server.lot.check_invariants()
    assert elapsed < TIMEOUT_S, f"{elapsed:.2f}s"
    assert holder.result is not None and holder.result.ok, holder.result
    assert holder.result.transport == "shm", holder.result
    assert after.ok and after.transport == "shm", after


@pytest.mark.parametrize("how", ["park", "batch"])
async def test_a_refused_lend_goes_inline_at_once_while_another_batch_holds_it(
    how: str, shm_socket: str
) -> None:
    """The producer dropped the lend while another batch still copies from its mapping: a
    release of it would be answered only after that batch. The park (or a streaming batch)
    goes inline within its timeout all the same."""
    data = np.arange(8 * MiB, dtype=np.uint8)
    async with running_producer(shm_socket=shm_socket) as server:

        def run() -> tuple[float, Any, Any, Any]:
            with KVParker(server.target, shm_socket=shm_socket, timeout=10) as parker:
                kv = parker.shared_buffer(8 * MiB)
                kv[:] = data
                holder, lent = batch_holding(server, parker, kv)
                lent.end()  # as a restart would, but the other batch keeps its mapping
                started = time.monotonic()
                if how == "park":
                    refused = parker.park("refused", pieces(kv, 2, 2), timeout=TIMEOUT_S)
                else:
                    with parker.batch("refused", timeout=TIMEOUT_S) as batch:
                        for chunk_id, piece in enumerate(pieces(kv, 2, 2)):
                            batch.put(chunk_id, piece)
                    refused = batch.result
                elapsed = time.monotonic() - started
                assert holder.put(1, kv[MiB : 2 * MiB])
                held = holder.commit()
                again = parker.park("again", pieces(kv, 4, 2), timeout=TIMEOUT_S)
                return elapsed, refused, held, again

        elapsed, refused, held, again = await in_thread(run)
        server.lot.check_invariants()
    assert elapsed < TIMEOUT_S, f"{elapsed:.2f}s"
    assert refused.ok and refused.transport == "grpc", refused
    assert refused.bytes_parked == 2 * MiB, refused
    assert held.ok and held.transport == "shm", held
    # The refused lend was forgotten: the buffer is lent anew and used by reference again.
    assert again.ok and again.transport == "shm", again


async def test_a_chunk_changed_after_its_put_is_not_parked_when_the_batch_goes_inline(
    shm_socket: str,
) -> None:
    """A put by reference asks the caller to leave the chunk's bytes alone until the commit.
    One that changes them anyway, in a batch whose lend the producer then refuses, gets
    CHECKSUM_MISMATCH when the batch resends its chunks inline: they carry the CRC32C taken at
    `put`, never one taken over what the memory holds by then. (With two shared buffers the
    header goes out with the first put, so the refusal always comes after it.)"""
    async with running_producer(shm_socket=shm_socket) as server:

        def run() -> Any:
            with KVParker(server.target, shm_socket=shm_socket, timeout=10) as parker:
                kv = parker.shared_buffer(4 * MiB)
                parker.shared_buffer(MiB)  # a second one
                kv[:] = 5
                assert parker.park("warm", [kv[3 * MiB :]]).ok  # lends `kv`
                producers_lend(server, parker, kv).end()
                with parker.batch("changed", total_chunks=1) as batch:
                    assert batch.put(0, kv[:MiB])
                    kv[:MiB] = 6
                return batch.result

        result = await in_thread(run)
        server.lot.check_invariants()
    assert not result.ok and result.reason is Reason.CHECKSUM_MISMATCH, result
