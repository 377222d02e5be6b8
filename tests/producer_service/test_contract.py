"""The contract's guarantees, shown against a real producer (docs/protocol.md):

- a Park batch is visible only through a commit that matches what arrived, wherever the
  stream is cut off;
- a delivery is kept until its consumer confirms it, so a consumer that dies or rejects a chunk
  after the last byte was sent loads the same bytes again within the grace;
- waits bound stalls, not totals;
- the handlers are registered with the shapes the generated servicer declares.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from conftest import (
    MiB,
    ProducerProcess,
    channel_options,
    fetch_all,
    park,
    park_requests,
    running_producer,
    state_of,
    stub_for,
    wait_for,
    wait_until,
)

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.servicer import SERVICE_NAME, method_handlers


def chunks_of(n: int, size: int) -> dict[int, bytes]:
    return {i: os.urandom(size) for i in range(n)}


def assert_nothing_left(server: Any, kid: str) -> None:
    pool = server.pool.statistics()
    assert (pool.used_bytes, pool.reservations_open) == (0, 0), pool
    assert server.lot.lookup([kid])[0].state == pb.STATE_UNKNOWN
    server.lot.check_invariants()


# ==================================================================================== commit
CUTS = [
    "before-header",
    "mid-chunks",
    "after-last-chunk",
    "ended-without-commit",
    "cancel-after-end",
]


@pytest.mark.parametrize("cut", CUTS)
async def test_a_park_cut_off_at_any_point_is_never_visible_and_frees_everything(cut: str) -> None:
    """Wherever a Park stream stops short of its commit — before the header, between chunks,
    after the last chunk, by ending the stream, or by a cancel that lands after the stream
    ended — nothing of it becomes visible and every page (the reservation included) is back."""
    async with running_producer() as server, stub_for(server) as stub:
        chunks = chunks_of(4, 300_000)
        messages = park_requests("cut", chunks, total=4, batch_bytes=4 * 300_000, commit=False)
        send = {
            "before-header": [],
            "mid-chunks": messages[:3],
            "after-last-chunk": messages,
            "ended-without-commit": messages,
            "cancel-after-end": messages,
        }[cut]
        ends = cut in ("ended-without-commit", "cancel-after-end")
        hold = asyncio.Event()

        async def upload() -> AsyncIterator[pb.ParkRequest]:
            for message in send:
                yield message
            if not ends:
                await hold.wait()  # the client stays silent until it is cut off

        call = stub.Park(upload())
        if cut in ("mid-chunks", "after-last-chunk"):
            await wait_until(
                lambda: server.pool.statistics().used_bytes > 0, what="the batch to arrive"
            )
        else:
            await asyncio.sleep(0)  # the call is open (and, for the ends, already ended)
        if cut == "ended-without-commit":
            reply = await call
            assert (reply.status, reply.reason) == (pb.STATUS_FAILED, pb.REASON_NOT_COMMITTED)
        else:
            call.cancel()
            with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
                await call
        hold.set()
        await wait_until(
            lambda: server.pool.statistics().used_bytes == 0, what="the batch to be undone"
        )
        assert_nothing_left(server, "cut")
        assert server.lot.statistics().open_batches == 0


async def test_a_commit_whose_counts_do_not_match_is_refused_and_nothing_is_visible() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = chunks_of(3, 100_000)
        messages = park_requests("m", chunks, total=3, commit=False)
        for chunks_named, bytes_named in ((2, 300_000), (3, 299_999), (4, 300_000)):
            commit = pb.ParkCommit(chunks=chunks_named, bytes=bytes_named)
            reply = await stub.Park(iter([*messages, pb.ParkRequest(commit=commit)]))
            assert (reply.status, reply.reason) == (pb.STATUS_FAILED, pb.REASON_COMMIT_MISMATCH)
            assert "the batch sent 3 chunks and 300000 bytes" in reply.detail
            assert_nothing_left(server, "m")
        # The same batch with the right commit is kept, all at once.
        reply = await park(stub, "m", chunks, total=3)
        assert (reply.status, reply.chunks_parked, reply.bytes_parked) == (pb.STATUS_OK, 3, 300_000)


async def test_messages_after_the_commit_are_not_read_and_change_nothing() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = chunks_of(2, 1000)
        messages = park_requests("after", chunks, total=3)
        extra = pb.ParkRequest(chunk=pb.Chunk(chunk_id=2, data=b"late"))
        reply = await stub.Park(iter([*messages, extra]))
        assert reply.status == pb.STATUS_OK and reply.chunks_parked == 2
        assert server.lot.lookup(["after"])[0].chunks_parked == 2


async def test_a_batch_larger_than_its_share_of_the_pool_is_too_large() -> None:
    async with running_producer(pool_bytes=16 * MiB, max_batch_share=0.25) as server:
        async with stub_for(server) as stub:
            declared = await park(stub, "d", {}, batch_bytes=4 * MiB + 1)
            assert (declared.status, declared.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE)
            assert "max_batch_bytes 4194304" in declared.detail
            streamed = await park(stub, "s", chunks_of(5, MiB), total=5)  # 5 MiB, undeclared
            assert (streamed.status, streamed.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE)
            assert_nothing_left(server, "s")
            fits = await park(stub, "f", chunks_of(4, MiB), total=4)
            assert fits.status == pb.STATUS_OK
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.max_batch_bytes == 4 * MiB


async def test_a_share_between_two_page_counts_is_whole_pages_for_every_check() -> None:
    """A quarter of 10 pages is 2.5: the limit is 2 pages, in ServerInfo, for a declared batch
    and for what an undeclared one stores (chunks take whole pages), so a batch of 3 pages is
    TOO_LARGE whether it was declared or not."""
    page = 256 * 1024
    three = {i: bytes([i]) * page for i in range(3)}
    async with running_producer(
        pool_bytes=10 * page, max_chunk_bytes=page, max_batch_share=0.25
    ) as server:
        async with stub_for(server) as stub:
            info = await stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.max_batch_bytes == 2 * page
            streamed = await park(stub, "s", three)
            assert (streamed.status, streamed.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE)
            assert_nothing_left(server, "s")
            declared = await park(stub, "d", three, batch_bytes=3 * page)
            assert (declared.status, declared.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE)
            fits = await park(stub, "f", {0: three[0], 1: three[1]}, batch_bytes=2 * page)
            assert fits.status == pb.STATUS_OK


async def test_shutdown_answers_an_idle_park_stream_in_band() -> None:
    """A Park handler waiting for its client's next message learns of the shutdown at once and
    answers SHUTTING_DOWN in-band, rather than the call ending UNAVAILABLE."""
    async with running_producer() as server, stub_for(server) as stub:
        hold = asyncio.Event()

        async def upload() -> AsyncIterator[pb.ParkRequest]:
            for message in park_requests("idle", {0: b"x" * 1000}, total=2, commit=False):
                yield message
            await hold.wait()

        call = stub.Park(upload())
        await wait_until(lambda: server.lot.statistics().open_batches == 1, what="batch open")
        server.lot.begin_shutdown()
        reply = await asyncio.wait_for(call, 5)
        hold.set()
        assert (reply.status, reply.reason) == (pb.STATUS_FAILED, pb.REASON_SHUTTING_DOWN)
        assert_nothing_left(server, "idle")


# ================================================================================= delivery
async def test_a_delivery_is_kept_for_a_repeat_fetch_and_freed_by_the_grace() -> None:
    async with running_producer(delivery_grace_s=1.0) as server, stub_for(server) as stub:
        chunks = chunks_of(3, 50_000)
        await park(stub, "d", chunks, total=3)
        first = await fetch_all(stub, "d")
        again = await fetch_all(stub, "d")  # the consumer never confirmed: sent again
        assert [m.chunk.data for m in again[:-1]] == [chunks[i] for i in range(3)]
        assert again[-1].done.delivery_id not in (0, first[-1].done.delivery_id)
        stats = server.lot.statistics()
        assert (stats.delivered_total, stats.redelivered_total) == (2, 1)
        # The first delivery's id confirms nothing any more; the grace then frees the bytes.
        stale = await stub.Release(
            pb.ReleaseRequest(kv_request_id="d", delivery_id=first[-1].done.delivery_id)
        )
        assert stale.reason == pb.REASON_UNKNOWN_ID
        await wait_until(
            lambda: server.lot.lookup(["d"])[0].state == pb.STATE_TOMBSTONED,
            what="the delivery grace to pass",
        )
        assert server.lot.lookup(["d"])[0].reason == pb.REASON_ALREADY_CONSUMED
        assert server.pool.statistics().used_bytes == 0


_DYING_CONSUMER = textwrap.dedent(
    """
    import os, signal, sys
    from kvpark import KVConsumer

    def on_chunk(index, chunk_id, landed):
        if index == int(sys.argv[3]) - 1:  # the last chunk is verified and placed: die now
            os.kill(os.getpid(), signal.SIGKILL)

    with KVConsumer(sys.argv[1]) as consumer:
        consumer.load(sys.argv[2], num_chunks=int(sys.argv[3]), on_chunk=on_chunk)
    """
)


def test_a_consumer_killed_before_confirming_leaves_the_bytes_for_the_next_one(
    producer_process: Any,
) -> None:
    """Delivery is at least once within the grace: a consumer SIGKILLed after the last chunk,
    before its confirmation, does not lose the KV; a new consumer loads the same bytes. After
    the grace the id ends ALREADY_CONSUMED and the pool is free."""
    from kvpark import KVConsumer, KVParker, Reason

    producer: ProducerProcess = producer_process(delivery_grace_s=3)
    chunks = chunks_of(4, 200_000)
    with KVParker(producer.target) as parker:
        assert parker.park("k", chunks).ok
    dying = subprocess.run(
        [sys.executable, "-c", _DYING_CONSUMER, producer.target, "k", "4"],
        capture_output=True,
        timeout=60,
    )
    assert dying.returncode == -signal.SIGKILL, dying.stderr
    with KVConsumer(producer.target, confirm=False) as consumer:
        assert consumer.lookup(["k"])[0].state == "DELIVERED"
        again = consumer.load("k", num_chunks=4)
        assert again.ok and again.data is not None
        assert again.data.tobytes() == b"".join(chunks[i] for i in range(4))
        # Not confirmed (confirm=False): after the grace the producer frees it by itself.
        started = time.monotonic()
        wait_for(lambda: consumer.lookup(["k"])[0].state == "TOMBSTONED", timeout=15)
        assert time.monotonic() - started < 10
        late = consumer.load("k", num_chunks=4)
        assert late.reason is Reason.ALREADY_CONSUMED
        info = consumer.server_info(refresh=True)
        assert info.pool_free_bytes == info.pool_bytes


class _CorruptLastChunk(grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Flips one payload byte of the last chunk of the first Fetch: a corruption the client
    can only see by its CRC check."""

    def __init__(self, chunks: int) -> None:
        self._chunks = chunks
        self.armed = True

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        call = continuation(details, request)
        if not details.method.endswith("/Fetch") or not self.armed:
            return call
        self.armed = False
        return _Corrupting(call, self._chunks)


class _Corrupting:
    def __init__(self, call: Any, last: int) -> None:
        self._call, self._seen, self._last = call, 0, last

    def __iter__(self) -> _Corrupting:
        return self

    def __next__(self) -> bytes:
        raw: bytes = next(self._call)
        self._seen += 1
        if self._seen == self._last:
            raw = raw[:-1] + bytes([raw[-1] ^ 0xFF])
        return raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


async def test_a_chunk_the_client_rejects_is_loaded_again_by_a_retry() -> None:
    """The last chunk arrives corrupted: the client refuses it (CHECKSUM_MISMATCH), does not
    confirm, and a retry within the grace gets the bytes again."""
    from kvpark import KVConsumer, Reason

    async with running_producer() as server, stub_for(server) as stub:
        chunks = chunks_of(3, 100_000)
        await park(stub, "c", chunks, total=3)
        corrupt = _CorruptLastChunk(3)

        def load_twice() -> tuple[Any, Any]:
            with KVConsumer(server.target, interceptors=[corrupt]) as consumer:
                return consumer.load("c", num_chunks=3), consumer.load("c", num_chunks=3)

        bad, good = await asyncio.to_thread(load_twice)
        assert bad.reason is Reason.CHECKSUM_MISMATCH and bad.chunks_loaded == 2
        assert good.ok and good.data.tobytes() == b"".join(chunks[i] for i in range(3))
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="confirmed")


# ===================================================================================== waits
async def test_steady_progress_outlives_the_wait_bound() -> None:
    """A fetch before park whose chunks are committed one every 0.6 x max_fetch_wait_s
    completes: the wait bounds a stall, not the whole transfer (which takes 3x the bound)."""
    wait_s = 0.5
    async with running_producer(max_fetch_wait_s=wait_s) as server, stub_for(server) as stub:
        chunks = chunks_of(5, 10_000)
        started = time.monotonic()
        fetching = asyncio.ensure_future(fetch_all(stub, "slow"))
        for cid in range(5):
            await asyncio.sleep(0.6 * wait_s)
            reply = await park(stub, "slow", {cid: chunks[cid]}, total=5)
            assert reply.status == pb.STATUS_OK
        messages = await fetching
        assert messages[-1].done.status == pb.STATUS_OK, messages[-1].done
        assert [m.chunk.data for m in messages[:-1]] == [chunks[i] for i in range(5)]
        assert time.monotonic() - started > 2 * wait_s


async def test_a_stall_longer_than_the_wait_bound_ends_wait_timeout() -> None:
    async with running_producer(max_fetch_wait_s=0.3) as server, stub_for(server) as stub:
        await park(stub, "gap", {0: b"a"}, total=2)
        started = time.monotonic()
        messages = await fetch_all(stub, "gap")
        done = messages[-1].done
        assert done.reason == pb.REASON_WAIT_TIMEOUT and done.chunks_sent == 1
        assert time.monotonic() - started < 3
        assert (await state_of(stub, "gap")).state == pb.STATE_PARKED


async def test_fetch_all_of_an_id_parked_without_a_total_ends_at_its_commit() -> None:
    """No batch declared total_chunks: the commit fixes it, so "all chunks" is defined and the
    fetch ends OK rather than waiting for a chunk that will never come."""
    async with running_producer(max_fetch_wait_s=30) as server, stub_for(server) as stub:
        reply = await park(stub, "nototal", {0: b"a", 1: b"b"})
        assert reply.total_chunks == 2
        started = time.monotonic()
        messages = await fetch_all(stub, "nototal")
        assert messages[-1].done.status == pb.STATUS_OK and len(messages) == 3
        assert time.monotonic() - started < 5


@contextlib.asynccontextmanager
async def cut_off_fetch(server: Any, kid: str) -> AsyncIterator[Any]:
    """A Fetch of `kid` whose reader reads nothing (its HTTP/2 window stays shut), yielded
    once the producer has cut it off for stalling."""
    async with grpc.aio.insecure_channel(
        server.target, options=[*channel_options(), ("grpc.http2.bdp_probe", 0)]
    ) as reader:
        stalled = pb_grpc.KVProducerStub(reader).Fetch(pb.FetchRequest(kv_request_id=kid))
        await wait_until(
            lambda: server.lot.statistics().stalled_fetches_total == 1,
            what="the stalled fetch to be cut off",
        )
        yield stalled


async def test_a_consumer_that_reads_nothing_is_cut_off_and_the_id_kept() -> None:
    """A reader whose flow-control window stays shut loses its id after fetch_stall_timeout_s:
    the id goes back to PARKED with a fresh lease, and another consumer loads every byte."""
    async with running_producer(
        fetch_stall_timeout_s=0.5, unbound_store_timeout_s=5, max_chunk_bytes=4 * MiB
    ) as server:
        async with stub_for(server) as stub:
            chunks = chunks_of(8, 4 * MiB)
            await park(stub, "z", chunks, total=8)
            async with cut_off_fetch(server, "z") as stalled:
                state = await state_of(stub, "z")
                assert state.state == pb.STATE_PARKED and state.lease_remaining_s > 4
                messages = await fetch_all(stub, "z")
                assert [m.chunk.data for m in messages[:-1]] == [chunks[i] for i in range(8)]
                stalled.cancel()


async def test_a_consumer_cut_off_mid_batch_gets_no_later_chunk_of_it() -> None:
    """A stall cut off while the first of a batch's chunks waits gives the id back, so its
    pages may be freed and parked into before the consumer reads again. When it does, it
    gets the chunk whose write was waiting and then the call's end: never a chunk read from
    those pages afterwards (here the next id's bytes)."""
    async with running_producer(
        fetch_stall_timeout_s=0.5, unbound_store_timeout_s=30, max_chunk_bytes=MiB
    ) as server:
        async with stub_for(server) as stub:
            # 1 MiB chunks: the first batch (4 MiB) holds four of them.
            await park(stub, "x", {i: b"\x11" * MiB for i in range(8)}, total=8)
            async with cut_off_fetch(server, "x") as stalled:
                released = await stub.Release(pb.ReleaseRequest(kv_request_id="x"))
                assert released.status == pb.STATUS_OK
                await park(stub, "y", {i: b"\xee" * MiB for i in range(8)}, total=8)
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    async for message in stalled:
                        received.append(message.chunk)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert [(c.chunk_id, c.data) for c in received] == [(0, b"\x11" * MiB)]
        server.lot.check_invariants()


# ============================================================================= registration
def test_handlers_have_the_shapes_the_contract_declares() -> None:
    """Every method is registered with the streaming shape of the .proto (Fetch a server
    stream, Park a client stream), so no handler relies on undocumented grpc behaviour."""
    service = pb.DESCRIPTOR.services_by_name["KVProducer"]

    class Details:
        def __init__(self, method: str) -> None:
            self.method = f"/{SERVICE_NAME}/{method}"
            self.invocation_metadata = ()

    async def behaviour(request: Any, context: Any) -> None:
        return None

    servicer = SimpleNamespace(**{m.name: behaviour for m in service.methods})
    handlers = method_handlers(servicer)  # type: ignore[arg-type]
    for method in service.methods:
        handler = handlers.service(Details(method.name))
        assert handler is not None, method.name
        shape = (handler.request_streaming, handler.response_streaming)
        assert shape == (method.client_streaming, method.server_streaming), method.name
