"""A batch sent again by reference (shared memory) after a broken call is judged as the same
batch sent inline (docs/protocol.md, Park): chunks the id already holds with the same bytes are
accepted and stored once, taking no pages, so such a re-send neither evicts a delivered id for
room it does not need nor counts against max_batch_bytes; other bytes under a held chunk id
are a CHUNK_CONFLICT that keeps the id as it was. Real producer, generated stubs, a real lend
over the shm socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from conftest import fetch_all, park, running_producer, state_of, stub_for

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import PARK_ROLE, SharedBuffer, ShmLender

PAGE = 256 * 1024


def by_reference(kid: str, lend_id: str, chunks: dict[int, bytes]) -> list[pb.ParkRequest]:
    """One batch naming `chunks` in the lent buffer, chunk c at c pages in."""
    refs = [
        pb.ChunkRef(chunk_id=c, crc32c=crc32c_of(data), offset=c * PAGE, nbytes=len(data))
        for c, data in chunks.items()
    ]
    commit = pb.ParkCommit(chunks=len(chunks), bytes=sum(map(len, chunks.values())))
    return [
        pb.ParkRequest(header=pb.ParkHeader(kv_request_id=kid, shm_lend_id=lend_id)),
        pb.ParkRequest(chunk_refs=pb.ChunkRefs(refs=refs)),
        pb.ParkRequest(commit=commit),
    ]


@asynccontextmanager
async def lent(shm_socket: str, pages: int) -> AsyncIterator[tuple[SharedBuffer, str]]:
    """A shared buffer of `pages` pages lent to the producer for Park."""
    buffer = SharedBuffer(pages * PAGE)
    lender = ShmLender(shm_socket, None, 5.0)
    try:
        await asyncio.to_thread(lender.connect)
        yield buffer, await asyncio.to_thread(lender.lend, buffer, PARK_ROLE)
    finally:
        lender.close()
        buffer.close()


def write(buffer: SharedBuffer, chunks: dict[int, bytes]) -> None:
    for c, data in chunks.items():
        buffer.array[c * PAGE : c * PAGE + len(data)] = memoryview(data)


async def test_a_resent_batch_takes_no_room_and_evicts_nothing(shm_socket: str) -> None:
    first = {c: bytes([65 + c]) * PAGE for c in range(4)}
    other = {c: bytes([97 + c]) * PAGE for c in range(4)}
    settings = {"pool_bytes": 8 * PAGE, "max_chunk_bytes": PAGE, "shm_socket": shm_socket}
    async with running_producer(**settings) as server, stub_for(server) as stub:
        assert (await park(stub, "first", first)).status == pb.STATUS_OK
        assert (await park(stub, "other", other)).status == pb.STATUS_OK
        assert (await fetch_all(stub, "other"))[-1].done.status == pb.STATUS_OK
        assert server.pool.free_bytes == 0  # "other" is DELIVERED: room a Park may take
        async with lent(shm_socket, 4) as (buffer, lend_id):
            write(buffer, first)
            answer = await stub.Park(iter(by_reference("first", lend_id, first)))
            assert answer.status == pb.STATUS_OK, answer
            assert (await state_of(stub, "other")).state == pb.STATE_DELIVERED
            server.lot.check_invariants()

            changed = {**first, 2: b"x" * PAGE}
            write(buffer, changed)
            answer = await stub.Park(iter(by_reference("first", lend_id, changed)))
            assert (answer.status, answer.reason) == (pb.STATUS_FAILED, pb.REASON_CHUNK_CONFLICT)
            assert "chunk 2 was parked with other bytes" in answer.detail

            shorter = {1: bytes([66]) * (PAGE // 2)}
            write(buffer, shorter)
            answer = await stub.Park(iter(by_reference("first", lend_id, shorter)))
            assert (answer.status, answer.reason) == (pb.STATUS_FAILED, pb.REASON_CHUNK_CONFLICT)
        assert (await state_of(stub, "other")).state == pb.STATE_DELIVERED
        fetched = await fetch_all(stub, "first")
        server.lot.check_invariants()
    assert fetched[-1].done.status == pb.STATUS_OK
    assert b"".join(m.chunk.data for m in fetched[:-1]) == b"".join(first.values())


async def test_a_whole_id_resent_is_not_counted_against_max_batch_bytes(shm_socket: str) -> None:
    """Parked as 4 + 1 pages under a 4-page batch limit; all 5 sent again in one batch."""
    chunks = {c: bytes([65 + c]) * PAGE for c in range(5)}
    settings = {
        "pool_bytes": 16 * PAGE,
        "max_chunk_bytes": PAGE,
        "max_batch_share": 0.25,
        "shm_socket": shm_socket,
    }
    async with running_producer(**settings) as server, stub_for(server) as stub:
        assert server.lot.max_batch_bytes == 4 * PAGE
        head = {c: chunks[c] for c in range(4)}
        assert (await park(stub, "kv", head, total=5)).status == pb.STATUS_OK
        assert (await park(stub, "kv", {4: chunks[4]}, total=5)).status == pb.STATUS_OK
        free = server.pool.free_bytes
        async with lent(shm_socket, 5) as (buffer, lend_id):
            write(buffer, chunks)
            answer = await stub.Park(iter(by_reference("kv", lend_id, chunks)))
        assert answer.status == pb.STATUS_OK, answer
        assert server.pool.free_bytes == free
        server.lot.check_invariants()
