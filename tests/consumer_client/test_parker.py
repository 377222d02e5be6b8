"""`KVParker` / `AsyncKVParker` against a real producer, sync and async: a list park and a
streaming batch committed on exit; an exception inside a batch leaves nothing parked;
POOL_FULL retried until room frees within the timeout, or a typed result past it; a park or
batch that finds the producer gone forgets its ServerInfo; the CRC32C computed by the library
and carried on the wire; gather lists and id pairs."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import (
    FakeClock,
    MiB,
    fetch_all,
    running_producer,
    stub_for,
    wait_for,
    wait_until,
)

from kvpark import AsyncKVParker, KVParker, ParkResult, Reason, UsageError, wire
from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb


def blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


async def fetched(stub: Any, kid: str) -> list[bytes]:
    messages = await fetch_all(stub, kid)
    assert messages[-1].done.status == pb.STATUS_OK, messages[-1].done
    return [m.chunk.data for m in messages[:-1]]


# ================================================================================ list park
async def test_sync_list_park_and_streaming_batch_are_committed() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        data = blocks(4, 100_000)

        def run() -> tuple[ParkResult, ParkResult | None]:
            with KVParker(server.target) as parker:
                listed = parker.park("listed", data)
                with parker.batch("streamed", total_chunks=4) as batch:
                    for cid, block in enumerate(data):
                        assert batch.put(cid, block)
                return listed, batch.result

        listed, streamed = await asyncio.to_thread(run)
        assert listed.ok and (listed.chunks_parked, listed.bytes_parked) == (4, 400_000)
        assert listed.total_chunks == 4 and listed.producer_epoch == server.epoch
        assert streamed is not None and streamed.ok and streamed.total_chunks == 4
        for kid in ("listed", "streamed"):
            assert await fetched(stub, kid) == [b.tobytes() for b in data]


async def test_async_list_park_and_streaming_batch_are_committed() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        data = blocks(3, 50_000, seed=1)
        async with AsyncKVParker(server.target) as parker:
            listed = await parker.park("listed", {2: data[2], 0: data[0], 1: data[1]})
            async with parker.batch("streamed", total_chunks=3) as batch:
                for cid, block in enumerate(data):
                    assert await batch.put(cid, block)
        assert listed.ok and listed.chunks_parked == 3
        assert batch.result is not None and batch.result.ok
        for kid in ("listed", "streamed"):
            assert await fetched(stub, kid) == [b.tobytes() for b in data]


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_an_exception_inside_a_batch_leaves_nothing_parked(flavour: str) -> None:
    async with running_producer() as server:
        data = blocks(3, 200_000)
        if flavour == "sync":

            def run() -> None:
                with KVParker(server.target) as parker, parker.batch("b", total_chunks=3) as batch:
                    batch.put(0, data[0])
                    batch.put(1, data[1])
                    raise RuntimeError("the engine failed mid-prefill")

            with pytest.raises(RuntimeError):
                await asyncio.to_thread(run)
        else:
            with pytest.raises(RuntimeError):
                async with AsyncKVParker(server.target) as parker:
                    async with parker.batch("b", total_chunks=3) as batch:
                        await batch.put(0, data[0])
                        await batch.put(1, data[1])
                        raise RuntimeError("the engine failed mid-prefill")
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="undone")
        assert server.lot.lookup(["b"])[0].state == pb.STATE_UNKNOWN
        server.lot.check_invariants()


# ================================================================================ POOL_FULL
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_pool_full_is_retried_until_room_frees_within_the_timeout(flavour: str) -> None:
    async with (
        running_producer(pool_bytes=8 * MiB, max_batch_share=1, reap_interval_s=0.05) as server,
        stub_for(server) as stub,
    ):
        async with AsyncKVParker(server.target) as filler:
            assert (await filler.park("filler", blocks(6, MiB))).ok  # 6 of 8 MiB
        wanted = blocks(3, MiB, seed=2)  # needs 3 MiB: refused until the filler goes

        async def free_room_soon() -> None:
            await wait_until(
                lambda: server.metrics.registry.get_sample_value(
                    "kvpark_park_total", {"status": "failed", "reason": "pool_full"}
                ),
                what="a POOL_FULL refusal",
            )
            await stub.Release(pb.ReleaseRequest(kv_request_id="filler"))

        freeing = asyncio.ensure_future(free_room_soon())
        if flavour == "sync":

            def run() -> ParkResult:
                with KVParker(server.target, timeout=10) as parker:
                    return parker.park("wanted", wanted)

            result = await asyncio.to_thread(run)
        else:
            async with AsyncKVParker(server.target, timeout=10) as parker:
                result = await parker.park("wanted", wanted)
        await freeing
        assert result.ok and result.attempts >= 2, result
        assert await fetched(stub, "wanted") == [b.tobytes() for b in wanted]


async def test_pool_full_past_the_timeout_is_a_typed_result() -> None:
    async with running_producer(pool_bytes=8 * MiB, max_batch_share=1) as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("filler", blocks(6, MiB))).ok
            started = time.monotonic()
            result = await parker.park("wanted", blocks(3, MiB), timeout=0.8)
            elapsed = time.monotonic() - started
        assert not result.ok and result.reason is Reason.POOL_FULL, result
        assert result.retry_after_s > 0 and result.attempts >= 1
        assert elapsed < 0.8 + 0.6, elapsed  # never a retry that would outlast the timeout
        with pytest.raises(dataclasses_frozen_error()):
            result.ok = True  # type: ignore[misc]


async def test_parking_an_id_again_on_a_full_pool_needs_no_room_for_what_it_holds() -> None:
    """`park` declares its bytes on every attempt, so a caller that parks again what it parked
    already (its first answer was lost) sends a header asking for room the id holds: accepted
    at once, not POOL_FULL until the timeout."""
    async with running_producer(pool_bytes=8 * MiB, max_batch_share=1) as server:
        async with AsyncKVParker(server.target, timeout=2) as parker:
            mine = blocks(2, MiB, seed=3)
            assert (await parker.park("mine", mine)).ok
            assert (await parker.park("filler", blocks(6, MiB))).ok
            assert server.pool.statistics().free_bytes == 0
            again = await parker.park("mine", mine)
        assert again.ok and again.attempts == 1, again
        assert (again.chunks_parked, again.bytes_parked) == (2, 2 * MiB)
        server.lot.check_invariants()


def test_a_pool_full_retry_is_not_started_without_time_for_its_call() -> None:
    """A retry that would start with only moments left would end DEADLINE_EXCEEDED and hide
    the answer that matters (the pool stayed full): the parker stops and keeps POOL_FULL."""
    from kvpark.client._park import FIRST_RETRY_WAIT_S, RETRY_CALL_BUDGET_S, ParkOutcome

    clock = FakeClock()
    outcome = ParkOutcome("x", 1.0, clock)
    full = outcome.answered(
        pb.ParkResponse(status=pb.STATUS_FAILED, reason=pb.REASON_POOL_FULL, retry_after_s=5)
    )
    assert outcome.retry_wait_s(full) == FIRST_RETRY_WAIT_S  # plenty of time: retry soon
    clock.advance(1.0 - FIRST_RETRY_WAIT_S - RETRY_CALL_BUDGET_S / 2)
    assert outcome.retry_wait_s(full) is None  # the wait would leave the call too little


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


async def test_a_refused_batch_says_so_at_put_and_in_its_result() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await stub.Release(pb.ReleaseRequest(kv_request_id="gone"))  # nothing: UNKNOWN_ID
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("gone", [b"x"])).ok
            await stub.Release(pb.ReleaseRequest(kv_request_id="gone"))  # tombstoned RELEASED
            async with parker.batch("gone", total_chunks=1) as batch:
                await wait_until(lambda: batch.done, what="the refusal")
                assert not await batch.put(0, b"x")
        assert batch.result is not None and batch.result.reason is Reason.RELEASED


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("how", ["park", "batch"])
async def test_a_park_that_finds_the_producer_gone_forgets_its_server_info(
    flavour: str, how: str
) -> None:
    """UNAVAILABLE may mean a new producer process is coming: a `park()` or a `batch()` that
    ends so makes the parker forget the ServerInfo it read, as a load does, so that its next
    lend is checked against the epoch of whatever process answers next."""
    data = blocks(2, 1000)
    async with running_producer() as server:
        if flavour == "sync":
            parker: Any = KVParker(server.target, timeout=5)
            await asyncio.to_thread(parker.server_info)
        else:
            parker = AsyncKVParker(server.target, timeout=5)
            await parker.server_info()
        assert parker.info is not None
    try:
        if flavour == "sync":

            def run() -> ParkResult | None:
                if how == "park":
                    return parker.park("gone", data)
                with parker.batch("gone", total_chunks=2) as batch:
                    for cid, block in enumerate(data):
                        batch.put(cid, block)
                return batch.result

            result = await asyncio.to_thread(run)
        elif how == "park":
            result = await parker.park("gone", data)
        else:
            async with parker.batch("gone", total_chunks=2) as batch:
                for cid, block in enumerate(data):
                    await batch.put(cid, block)
            result = batch.result
        info = parker.info
    finally:
        await parker.aclose() if flavour == "async" else parker.close()
    assert result is not None and result.grpc_code is grpc.StatusCode.UNAVAILABLE, result
    assert info is None


# ==================================================================================== wire
class _Recorder(grpc.StreamUnaryClientInterceptor):  # type: ignore[misc]
    """Keeps every raw Park frame the parker sends."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self._lock = threading.Lock()

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        def recorded() -> Any:
            for frame in requests:
                with self._lock:
                    self.frames.append(frame)
                yield frame

        return continuation(details, recorded())


async def test_the_library_computes_each_chunks_crc32c_and_sends_gather_lists_as_one() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        recorder = _Recorder()
        pieces = [np.full(1000, 7, np.uint8), np.full(500, 9, np.uint8)]

        def run() -> ParkResult:
            with KVParker(server.target, interceptors=[recorder]) as parker:
                return parker.park("g", [(0, pieces), (1, b"second")])

        assert (await asyncio.to_thread(run)).ok
        parsed = [wire.parse_park_request(f) for f in recorder.frames]
        chunks = [p for p in parsed if isinstance(p, wire.ChunkView)]
        assert [c.chunk_id for c in chunks] == [0, 1]
        joined = b"".join(p.tobytes() for p in pieces)
        assert bytes(chunks[0].data) == joined and chunks[0].crc32c == crc32c_of(joined)
        assert chunks[1].crc32c == crc32c_of(b"second")
        commit = parsed[-1]
        assert isinstance(commit, pb.ParkCommit)
        assert (commit.chunks, commit.bytes) == (2, len(joined) + 6)
        assert await fetched(stub, "g") == [joined, b"second"]


def test_misuse_is_refused_before_anything_is_sent() -> None:
    with KVParker("127.0.0.1:1") as parker:
        for chunks in ([], b"bytes", [b""], [(0, b"a"), (0, b"b")]):
            with pytest.raises(UsageError):
                parker.park("x", chunks)  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            parker.park("x", [b"a"], total_chunks=0)
        # Chunk ids stop at 2**32 - 2 (2**32 - 1 marks a data connection's end).
        with pytest.raises(UsageError, match="not a chunk id"):
            parker.park("x", {2**32 - 1: b"a"})
        # 2**32 - 2 passes the checks (and then finds no producer at this address).
        assert parker.park("x", {2**32 - 2: b"a"}, timeout=0.01).reason is not None
        with pytest.raises(UsageError):
            parker.park("bad\nid", [b"a"])


def test_chunk_refs_go_in_messages_of_at_most_64_chunks_and_16_mib() -> None:
    """Park by reference groups its ChunkRefs as docs/protocol.md says: a group is flushed
    before a chunk would take it past 16 MiB, and after 64 chunks."""
    from kvpark.client._park import (
        REFS_MESSAGE_BYTES,
        ParkFrames,
        ShmPlan,
        batch_frames,
        prepare_all,
    )

    big, small = np.zeros(12 * MiB, np.uint8), np.zeros(4096, np.uint8)
    chunks = prepare_all([big, big, big] + [small] * 100)
    plan = ShmPlan("lend", [0] * len(chunks), staged=False)
    frames = ParkFrames("k", 0, 0, "lend")
    messages = list(batch_frames(frames, chunks, plan))[1:-1]
    groups = [pb.ParkRequest.FromString(m).chunk_refs.refs for m in messages]
    assert [len(g) for g in groups] == [1, 1, 64, 37]
    assert all(sum(r.nbytes for r in g) <= REFS_MESSAGE_BYTES for g in groups)
    assert [r.chunk_id for g in groups for r in g] == list(range(103))
    assert (frames.chunks, frames.nbytes) == (103, 3 * 12 * MiB + 100 * 4096)


# ========================================================================= frames of a call
def test_frames_for_a_call_that_ended_never_block_the_sender() -> None:
    """A sender blocked on a full queue (the transport behind) is released when the call
    ends, and every later frame is dropped instead of waiting for a reader that is gone."""
    from kvpark.client.parker import _CallFrames

    frames = _CallFrames()
    sent = threading.Event()

    def send_many() -> None:
        for n in range(6):
            frames.send(bytes([n]))
        sent.set()

    sender = threading.Thread(target=send_many, daemon=True)
    sender.start()
    wait_for(lambda: frames._queue.full(), what="the queue full: nobody reads")
    assert not sent.is_set()  # the sender waits for room
    frames.close()  # the call ended
    assert sent.wait(10), "a send still waits after the call ended"
    sender.join(10)


async def test_async_frames_for_a_call_that_ended_never_block_the_sender() -> None:
    from kvpark.client.parker import _AsyncCallFrames

    frames = _AsyncCallFrames()

    async def send_many() -> None:
        for n in range(6):
            await frames.send(bytes([n]))

    sending = asyncio.ensure_future(send_many())
    await wait_until(lambda: frames._queue.full(), what="the queue full: nobody reads")
    assert not sending.done()  # the sender waits for room
    frames.close()
    await asyncio.wait_for(sending, 10)
