"""A batch sent again by reference (shared memory) after a broken call is judged as the same
batch sent inline (docs/protocol.md, Park): chunks the id already holds with the same bytes are
accepted and stored once, taking no pages, so such a re-send neither evicts a delivered id for
room it does not need nor counts against max_batch_bytes; other bytes under a held chunk id
are a CHUNK_CONFLICT that keeps the id as it was. What a ChunkRef costs the producer is
bounded: a batch compares at most the id's bytes plus a batch's worth (beyond: TOO_LARGE), and
a ChunkRefs message names at most 256 chunks (beyond: INVALID_ARGUMENT, before it is walked).
Real producer, generated stubs, a real lend over the shm socket."""

from __future__ import annotations

import grpc
import pytest
from conftest import fetch_all, park, running_producer, state_of, stub_for
from shm_support import PAGE, lent

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import SharedBuffer
from kvpark.wire import MAX_CHUNK_REFS_BYTES, MAX_REFS_PER_MESSAGE


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


def four_page_batches(shm_socket: str) -> dict[str, object]:
    """Producer settings: a pool of 16 pages, one page per chunk, at most 4 pages a batch."""
    return {
        "pool_bytes": 16 * PAGE,
        "max_chunk_bytes": PAGE,
        "max_batch_share": 0.25,
        "shm_socket": shm_socket,
    }


async def test_a_whole_id_resent_is_not_counted_against_max_batch_bytes(shm_socket: str) -> None:
    """Parked as 4 + 1 pages under a 4-page batch limit; all 5 sent again in one batch."""
    chunks = {c: bytes([65 + c]) * PAGE for c in range(5)}
    async with (
        running_producer(**four_page_batches(shm_socket)) as server,
        stub_for(server) as stub,
    ):
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


def naming(kid: str, lend_id: str, refs: list[pb.ChunkRef]) -> list[pb.ParkRequest]:
    """One batch of one ChunkRefs message holding `refs` as given, repeats included."""
    commit = pb.ParkCommit(chunks=len(refs), bytes=sum(r.nbytes for r in refs))
    return [
        pb.ParkRequest(header=pb.ParkHeader(kv_request_id=kid, shm_lend_id=lend_id)),
        pb.ParkRequest(chunk_refs=pb.ChunkRefs(refs=refs)),
        pb.ParkRequest(commit=commit),
    ]


async def test_a_held_chunk_named_over_and_over_is_compared_only_within_a_bound(
    shm_socket: str,
) -> None:
    """Each reference to a chunk the id holds costs a full comparison on a data thread; a
    batch of a few bytes per reference may not buy more than one re-send of everything."""
    chunk = bytes(range(256)) * (PAGE // 256)
    async with (
        running_producer(**four_page_batches(shm_socket)) as server,
        stub_for(server) as stub,
    ):
        assert server.lot.max_batch_bytes == 4 * PAGE
        assert (await park(stub, "kv", {0: chunk}, total=1)).status == pb.STATUS_OK
        again = pb.ChunkRef(chunk_id=0, crc32c=crc32c_of(chunk), offset=0, nbytes=PAGE)
        async with lent(shm_socket, 1) as (buffer, lend_id):
            write(buffer, {0: chunk})
            # The id's one page plus a batch's four: five comparisons pass, the sixth does not.
            fits = await stub.Park(iter(naming("kv", lend_id, [again] * 5)))
            assert fits.status == pb.STATUS_OK, fits
            answer = await stub.Park(iter(naming("kv", lend_id, [again] * 6)))
        assert (answer.status, answer.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE), answer
        assert "compared" in answer.detail
        state = await state_of(stub, "kv")
        assert (state.state, state.chunks_parked) == (pb.STATE_PARKED, 1)
        server.lot.check_invariants()
        fetched = await fetch_all(stub, "kv")
    assert fetched[-1].done.status == pb.STATUS_OK
    assert fetched[0].chunk.data == chunk


# Over the count (257 references), or within it but over the bytes a ChunkRefs may take
# (256 references padded with an unknown field, ~20 KB).
@pytest.mark.parametrize(
    ("refs", "padding", "refusal"),
    [
        (MAX_REFS_PER_MESSAGE + 1, 0, f"names {MAX_REFS_PER_MESSAGE + 1} chunks"),
        (MAX_REFS_PER_MESSAGE, 64, f"of more than {MAX_CHUNK_REFS_BYTES} bytes"),
    ],
    ids=["count", "bytes"],
)
async def test_a_chunk_refs_message_names_at_most_256_chunks_in_16_kib(
    shm_socket: str, refs: int, padding: int, refusal: str
) -> None:
    """Refused whole, before the producer walks the references one by one on its event loop;
    the id keeps what it held."""
    chunk = b"k" * PAGE
    settings = {"pool_bytes": 16 * PAGE, "max_chunk_bytes": PAGE, "shm_socket": shm_socket}
    async with running_producer(**settings) as server, stub_for(server) as stub:
        assert (await park(stub, "kv", {0: chunk}, total=1)).status == pb.STATUS_OK
        again = pb.ChunkRef(chunk_id=0, crc32c=crc32c_of(chunk), offset=0, nbytes=PAGE)
        if padding:  # protobuf keeps an unknown field and serializes it again
            unknown = b"\x2a" + bytes([padding]) + b"p" * padding  # field 5, length-delimited
            again = pb.ChunkRef.FromString(again.SerializeToString() + unknown)
        async with lent(shm_socket, 1) as (buffer, lend_id):
            write(buffer, {0: chunk})
            with pytest.raises(grpc.RpcError) as refused:
                await stub.Park(iter(naming("kv", lend_id, [again] * refs)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refusal in (refused.value.details() or "")
        state = await state_of(stub, "kv")
        assert (state.state, state.chunks_parked) == (pb.STATE_PARKED, 1)
        assert server.lot.statistics().open_batches == 0
        server.lot.check_invariants()
