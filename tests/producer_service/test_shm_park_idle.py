"""park_idle_timeout_s bounds the silence of a Park's client (docs/protocol.md, All or nothing),
also over shared memory, where the producer copies each ChunkRefs message's chunks out of the
lent buffer on a data thread. While the call waits for those copies it reads none of the
client's messages, so that time is not the client's silence: a batch whose header, references
and commit were sent back to back commits however long the copies take. A client that really
says nothing more is still undone NOT_COMMITTED.

Real producer, generated stubs, a real lend over the shm socket and a FakeClock for the lot. The
copy function is held on an Event so the copies outlast the idle bound on any machine, and
the reaper's passes are counted so the test waits for them, not for time to pass."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from conftest import FakeClock, fetch_all, running_producer, state_of, stub_for, wait_until
from shm_support import PAGE, lent

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.producer import shm_park
from kvpark.producer.server import ProducerServer
from kvpark.shm import SharedBuffer

IDLE_S = 1.0  # park_idle_timeout_s, on the lot's FakeClock


@asynccontextmanager
async def filled(shm_socket: str, pages: int) -> AsyncIterator[tuple[SharedBuffer, str]]:
    """A lent buffer of `pages` pages, each filled with its own byte."""
    async with lent(shm_socket, pages) as (buffer, lend_id):
        for c in range(pages):
            buffer.array[c * PAGE : (c + 1) * PAGE] = 65 + c
        yield buffer, lend_id


def refs_message(buffer: SharedBuffer, chunk_ids: range) -> pb.ParkRequest:
    refs = [
        pb.ChunkRef(
            chunk_id=c,
            crc32c=crc32c_of(buffer.array[c * PAGE : (c + 1) * PAGE]),
            offset=c * PAGE,
            nbytes=PAGE,
        )
        for c in chunk_ids
    ]
    return pb.ParkRequest(chunk_refs=pb.ChunkRefs(refs=refs))


def header(kid: str, lend_id: str, total: int) -> pb.ParkRequest:
    return pb.ParkRequest(
        header=pb.ParkHeader(kv_request_id=kid, total_chunks=total, shm_lend_id=lend_id)
    )


class HeldCopies:
    """The producer's copy function, with the first copy job held until `release()`; counts
    the reaper's passes and the handler's waits for its copy jobs."""

    def __init__(self, server: ProducerServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.copying = threading.Event()  # the held job runs on its data thread
        self._release = threading.Event()
        self._jobs = itertools.count()
        self.waits = 0
        self.passes = 0
        copy_group, wait, reap = shm_park.copy_group, shm_park.wait, server.lot.reap

        def held_copy(jobs: list[shm_park.Job]) -> list[tuple[int, bool]]:
            if next(self._jobs) == 0:
                self.copying.set()
                self._release.wait(30)  # bounded: a failing test must not keep a thread
            return copy_group(jobs)

        async def counted_wait(job: Any, **kw: Any) -> Any:
            self.waits += 1
            return await wait(job, **kw)

        def counted_reap() -> list[str]:
            reaped = reap()
            self.passes += 1
            return reaped

        monkeypatch.setattr(shm_park, "copy_group", held_copy)
        monkeypatch.setattr(shm_park, "wait", counted_wait)
        monkeypatch.setattr(server.lot, "reap", counted_reap)

    def release(self) -> None:
        self._release.set()

    async def reaper_passes(self, n: int) -> None:
        """Waits for `n` more complete reaper passes (each reads the clock as it is now)."""
        target = self.passes + n
        await wait_until(lambda: self.passes >= target, what=f"{n} reaper passes")


def settings(shm_socket: str) -> dict[str, Any]:
    return {
        "pool_bytes": 16 * PAGE,
        "max_chunk_bytes": PAGE,
        "max_batch_share": 1.0,
        "shm_socket": shm_socket,
        "park_idle_timeout_s": IDLE_S,
    }


# One ChunkRefs message: the call waits for the held copy at the commit. One more than the
# copy groups a batch keeps in flight: it waits before reading the last ChunkRefs.
@pytest.mark.parametrize(
    "messages", [1, shm_park.MAX_GROUPS_IN_FLIGHT + 1], ids=["at the commit", "mid-batch"]
)
async def test_a_park_by_reference_commits_however_long_the_producer_copies(
    shm_socket: str, monkeypatch: pytest.MonkeyPatch, messages: int
) -> None:
    clock = FakeClock()
    async with (
        running_producer(clock, **settings(shm_socket)) as server,
        stub_for(server) as stub,
        filled(shm_socket, messages) as (buffer, lend_id),
    ):
        held = HeldCopies(server, monkeypatch)
        requests = [
            header("kv", lend_id, messages),
            *(refs_message(buffer, range(c, c + 1)) for c in range(messages)),
            pb.ParkRequest(commit=pb.ParkCommit(chunks=messages, bytes=messages * PAGE)),
        ]
        call = asyncio.ensure_future(stub.Park(iter(requests)))
        await wait_until(held.copying.is_set, what="the first copy job running")
        await wait_until(lambda: held.waits > 0, what="the call waiting for its copies")
        # Everything was sent; the producer is the busy one, for many idle bounds.
        clock.advance(5 * IDLE_S)
        await held.reaper_passes(3)
        assert not call.done()
        held.release()
        answer = await asyncio.wait_for(call, 10)
        assert answer.status == pb.STATUS_OK, answer
        assert (answer.chunks_parked, answer.bytes_parked) == (messages, messages * PAGE)
        assert server.lot.statistics().idle_batches_total == 0
        pool = server.pool.statistics()
        assert (pool.used_bytes, pool.reservations_open) == (messages * PAGE, 0)
        server.lot.check_invariants()
        fetched = await fetch_all(stub, "kv")
    assert fetched[-1].done.status == pb.STATUS_OK
    assert [m.chunk.data for m in fetched[:-1]] == [bytes([65 + c]) * PAGE for c in range(messages)]


async def test_a_park_by_reference_whose_client_falls_silent_is_still_undone(
    shm_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Header and references, then nothing: the copy ends long before, and once the client has
    been silent for park_idle_timeout_s the batch is undone and answered at once, every page
    given back."""
    clock = FakeClock()
    async with (
        running_producer(clock, **settings(shm_socket)) as server,
        stub_for(server) as stub,
        filled(shm_socket, 2) as (buffer, lend_id),
    ):
        held = HeldCopies(server, monkeypatch)
        held.release()  # copies run at once
        silent = asyncio.Event()

        async def requests() -> AsyncIterator[pb.ParkRequest]:
            yield header("quiet", lend_id, 2)
            yield refs_message(buffer, range(2))
            await silent.wait()  # connected, says nothing more

        call = asyncio.ensure_future(stub.Park(requests()))
        try:
            await wait_until(held.copying.is_set, what="the references read")
            await held.reaper_passes(2)
            assert not call.done()  # no time passed: not silent yet
            clock.advance(IDLE_S)
            answer = await asyncio.wait_for(call, 10)
        finally:
            silent.set()
        assert (answer.status, answer.reason) == (pb.STATUS_FAILED, pb.REASON_NOT_COMMITTED)
        assert f"sent nothing for {IDLE_S:g}s" in answer.detail
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="pages back")
        assert server.pool.statistics().reservations_open == 0
        assert server.lot.statistics().idle_batches_total == 1
        assert (await state_of(stub, "quiet")).state == pb.STATE_UNKNOWN
        server.lot.check_invariants()
