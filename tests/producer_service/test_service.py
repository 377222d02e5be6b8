"""End to end over a real grpc.aio producer on port 0, driven with the ordinary generated stubs
(so the hand-built data path is proven byte-compatible with any language's client)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import grpc
import pytest
from conftest import (
    FakeClock,
    MiB,
    channel_options,
    fetch_all,
    park,
    park_requests,
    running_producer,
    state_of,
    stub_for,
    wait_until,
)

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc


def chunks_of(n: int, size: int = 64 * 1024) -> dict[int, bytes]:
    return {i: os.urandom(size + i) for i in range(n)}


def late_fetches(server) -> int:  # type: ignore[no-untyped-def]
    return server.lot.statistics().late_fetch_rejections_total


async def test_happy_path_bytes_identical_in_requested_order_and_pool_freed() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        data = chunks_of(5, 300_000)
        reply = await park(stub, "req-1", data, total=5)
        assert reply.status == pb.STATUS_OK and reply.chunks_parked == 5
        assert reply.producer_epoch == server.epoch and reply.lease_remaining_s > 50
        order = [3, 0, 4, 1, 2]
        msgs = await fetch_all(stub, "req-1", chunk_ids=order, expected_epoch=server.epoch)
        assert [m.chunk.chunk_id for m in msgs[:-1]] == order
        assert [m.chunk.data for m in msgs[:-1]] == [data[i] for i in order]
        assert all(m.chunk.crc32c == crc32c_of(data[m.chunk.chunk_id]) for m in msgs[:-1])
        done = msgs[-1].done
        assert done.status == pb.STATUS_OK and done.delivery_id != 0
        assert done.chunks_sent == 5 and done.bytes_sent == sum(map(len, data.values()))
        assert done.producer_epoch == server.epoch
        # Delivered, not yet confirmed: the bytes stay for a retry until the consumer says so.
        assert (await state_of(stub, "req-1")).state == pb.STATE_DELIVERED
        assert server.pool.statistics().stored_bytes == sum(map(len, data.values()))
        confirmed = await stub.Release(
            pb.ReleaseRequest(kv_request_id="req-1", delivery_id=done.delivery_id)
        )
        assert confirmed.status == pb.STATUS_OK
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()
        state = await state_of(stub, "req-1")
        assert (state.state, state.reason) == (pb.STATE_TOMBSTONED, pb.REASON_ALREADY_CONSUMED)


async def test_fetch_all_chunks_when_chunk_ids_empty() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        data = chunks_of(3)
        await park(stub, "all", data, total=3)
        msgs = await fetch_all(stub, "all")
        assert [m.chunk.data for m in msgs[:-1]] == [data[0], data[1], data[2]]
        assert msgs[-1].done.status == pb.STATUS_OK


async def test_reference_scenario_late_fetch_after_reap_answered_at_once() -> None:
    """park -> lease runs out -> reaped -> late Fetch: one TransferDone{FAILED, REAPED}."""
    clock = FakeClock()
    async with running_producer(clock=clock, unbound_store_timeout_s=5) as server:
        async with stub_for(server) as stub:
            await park(stub, "late", chunks_of(2), total=2)
            clock.advance(5.01)
            await wait_until(
                lambda: server.lot.statistics().reaped_total == 1, what="the reaper pass"
            )
            assert server.pool.statistics().used_bytes == 0
            before = late_fetches(server)
            # A Park between the reap and the late fetch is refused at once, nothing stored.
            refused = await park(stub, "late", chunks_of(1), total=2)
            assert (refused.status, refused.reason) == (pb.STATUS_FAILED, pb.REASON_REAPED)
            assert server.pool.statistics().used_bytes == 0

            started = time.monotonic()
            call = stub.Fetch(pb.FetchRequest(kv_request_id="late"))
            msgs = [m async for m in call]
            elapsed = time.monotonic() - started
            # The path, not only the result: the producer ended the stream itself with one
            # TransferDone, the client never cancelled, the call finished OK.
            assert len(msgs) == 1 and msgs[0].WhichOneof("kind") == "done"
            assert (msgs[0].done.status, msgs[0].done.reason) == (
                pb.STATUS_FAILED,
                pb.REASON_REAPED,
            )
            assert await call.code() == grpc.StatusCode.OK
            assert not call.cancelled()
            assert late_fetches(server) == before + 1
            assert elapsed < 0.5, f"late fetch took {elapsed:.3f}s"  # load timeout is 30 s
            state = await state_of(stub, "late")
            assert state.state == pb.STATE_TOMBSTONED  # the late fetch did not bind the id


async def test_tombstones_pruned_after_retention_and_at_cap() -> None:
    clock = FakeClock()
    async with (
        running_producer(
            clock=clock,
            unbound_store_timeout_s=1,
            tombstone_retention_s=40,
            consumer_load_timeout_s=30,
            max_tombstones=3,
        ) as server,
        stub_for(server) as stub,
    ):
        for i in range(5):
            await park(stub, f"t{i}", chunks_of(1), total=1)
        clock.advance(1.5)
        await wait_until(lambda: server.lot.statistics().reaped_total == 5)
        assert server.lot.statistics().tombstones == 3  # the cap drops the oldest
        assert (await state_of(stub, "t0")).state == pb.STATE_UNKNOWN
        assert (await state_of(stub, "t4")).state == pb.STATE_TOMBSTONED
        clock.advance(41)  # past retention, and nothing is parked any more
        await wait_until(lambda: server.lot.statistics().tombstones == 0)
        assert (await state_of(stub, "t4")).state == pb.STATE_UNKNOWN


async def test_fetch_before_park_streams_chunks_as_they_arrive() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        data = chunks_of(3)
        call = stub.Fetch(pb.FetchRequest(kv_request_id="early", wait_timeout_s=10))
        received: list[pb.FetchResponse] = []

        async def consume() -> None:
            async for m in call:
                received.append(m)

        consumer = asyncio.create_task(consume())
        await wait_until(lambda: server.lot.bound_count == 1, what="the fetch to bind")
        assert (await state_of(stub, "early")).state == pb.STATE_BOUND
        await park(stub, "early", {0: data[0]}, total=3)
        await wait_until(lambda: len(received) == 1, what="chunk 0 streamed before the rest")
        await park(stub, "early", {1: data[1], 2: data[2]})
        await asyncio.wait_for(consumer, 10)
        assert [m.chunk.data for m in received[:-1]] == [data[0], data[1], data[2]]
        assert received[-1].done.status == pb.STATUS_OK
        server.lot.check_invariants()


async def test_fetch_wait_timeout_when_chunks_never_come() -> None:
    async with running_producer(max_fetch_wait_s=0.3) as server, stub_for(server) as stub:
        await park(stub, "partial", {0: b"x" * 1000}, total=2)
        started = time.monotonic()
        msgs = await fetch_all(stub, "partial", wait_timeout_s=60)  # capped by max_fetch_wait_s
        assert time.monotonic() - started < 5
        assert msgs[0].chunk.chunk_id == 0
        assert (msgs[-1].done.status, msgs[-1].done.reason) == (
            pb.STATUS_FAILED,
            pb.REASON_WAIT_TIMEOUT,
        )
        assert msgs[-1].done.chunks_sent == 1
        assert (await state_of(stub, "partial")).state == pb.STATE_PARKED


async def test_second_fetch_already_bound_and_cancel_returns_to_parked_with_old_lease() -> None:
    clock = FakeClock()
    async with running_producer(clock=clock, unbound_store_timeout_s=10) as server:
        async with stub_for(server) as stub:
            await park(stub, "b", {0: b"a" * 100}, total=2)  # chunk 1 missing: fetch waits
            lease_before = (await state_of(stub, "b")).lease_remaining_s
            call = stub.Fetch(pb.FetchRequest(kv_request_id="b", wait_timeout_s=30))
            first = await call.read()
            assert first.chunk.chunk_id == 0
            assert (await state_of(stub, "b")).state == pb.STATE_BOUND
            second = await fetch_all(stub, "b")
            assert second[-1].done.reason == pb.REASON_ALREADY_BOUND and len(second) == 1
            call.cancel()
            await wait_until(
                lambda: server.lot.bound_count == 0, what="the cancel to reach the producer"
            )
            state = await state_of(stub, "b")
            assert state.state == pb.STATE_PARKED
            assert state.lease_remaining_s == pytest.approx(lease_before)  # the old deadline
            # A retry within the lease works once the rest is parked.
            await park(stub, "b", {1: b"b" * 100})
            msgs = await fetch_all(stub, "b")
            assert msgs[-1].done.status == pb.STATUS_OK and len(msgs) == 3
            # And a cancel after the lease ran out leaves the id to the next reaper pass.
            await park(stub, "c", {0: b"c"}, total=2)
            call = stub.Fetch(pb.FetchRequest(kv_request_id="c", wait_timeout_s=30))
            await call.read()
            clock.advance(11)
            call.cancel()
            await wait_until(lambda: server.lot.bound_count == 0)
            await wait_until(lambda: server.lot.statistics().reaped_total == 1)
            assert (await state_of(stub, "c")).reason == pb.REASON_REAPED


async def test_keepalive_extends_past_unbound_timeout_but_never_beyond_max_lease() -> None:
    clock = FakeClock()
    async with running_producer(clock=clock, unbound_store_timeout_s=10, max_lease_s=30) as server:
        async with stub_for(server) as stub:
            await park(stub, "k", {0: b"k" * 10}, total=1)
            clock.advance(8)
            reply = await stub.KeepAlive(pb.KeepAliveRequest(kv_request_ids=["k"], extend_s=10))
            assert reply.states[0].state == pb.STATE_PARKED
            assert reply.states[0].lease_remaining_s == pytest.approx(10)
            clock.advance(9)  # 17 s after the first chunk: past unbound_store_timeout_s
            assert server.lot.reap() == []  # a pass right now reaps nothing
            assert (await state_of(stub, "k")).state == pb.STATE_PARKED
            reply = await stub.KeepAlive(pb.KeepAliveRequest(kv_request_ids=["k"], extend_s=600))
            assert reply.states[0].lease_remaining_s == pytest.approx(30 - 17)  # capped
            clock.advance(13.01)
            await wait_until(lambda: server.lot.statistics().reaped_total == 1)
            assert (await state_of(stub, "k")).reason == pb.REASON_REAPED


async def test_keepalive_before_park_records_intent() -> None:
    clock = FakeClock()
    async with running_producer(clock=clock, unbound_store_timeout_s=10) as server:
        async with stub_for(server) as stub:
            reply = await stub.KeepAlive(pb.KeepAliveRequest(kv_request_ids=["i"], extend_s=50))
            assert reply.states[0].state == pb.STATE_UNKNOWN
            assert reply.states[0].lease_remaining_s == pytest.approx(50)
            clock.advance(5)
            await park(stub, "i", {0: b"i"}, total=1)
            assert (await state_of(stub, "i")).lease_remaining_s == pytest.approx(45)


async def test_release() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "r", chunks_of(2), total=2)
        reply = await stub.Release(pb.ReleaseRequest(kv_request_id="r"))
        assert reply.status == pb.STATUS_OK
        assert server.pool.statistics().used_bytes == 0
        again = await stub.Release(pb.ReleaseRequest(kv_request_id="r"))
        assert (again.status, again.reason) == (pb.STATUS_FAILED, pb.REASON_RELEASED)
        unknown = await stub.Release(pb.ReleaseRequest(kv_request_id="nope"))
        assert unknown.reason == pb.REASON_UNKNOWN_ID
        msgs = await fetch_all(stub, "r")
        assert msgs[-1].done.reason == pb.REASON_RELEASED


async def test_pool_full_with_retry_after_and_too_large() -> None:
    # The whole pool may go to one batch here (max_batch_share 1), to fill it in two parks.
    async with running_producer(
        pool_bytes=8 * MiB, max_chunk_bytes=4 * MiB, max_batch_share=1
    ) as server:
        async with stub_for(server) as stub:
            big = await park(stub, "huge", {}, batch_bytes=9 * MiB)
            assert (big.status, big.reason) == (pb.STATUS_FAILED, pb.REASON_TOO_LARGE)
            await park(stub, "a", {0: b"a" * (3 * MiB), 1: b"b" * (3 * MiB)}, total=2)
            declared = await park(stub, "b", {}, batch_bytes=3 * MiB)
            assert (declared.status, declared.reason) == (pb.STATUS_FAILED, pb.REASON_POOL_FULL)
            assert declared.retry_after_s > 0
            # Undeclared batch that runs out of pool: all-or-nothing.
            before = server.pool.statistics().used_bytes
            undeclared = await park(stub, "c", {0: b"c" * MiB, 1: b"d" * (2 * MiB)}, total=2)
            assert (undeclared.status, undeclared.reason) == (pb.STATUS_FAILED, pb.REASON_POOL_FULL)
            assert undeclared.retry_after_s > 0
            assert server.pool.statistics().used_bytes == before
            assert (await state_of(stub, "c")).state == pb.STATE_UNKNOWN
            server.lot.check_invariants()
            # Memory frees -> parks succeed again: "a" is delivered, and a delivered id is the
            # first thing freed under pool pressure (EVICTED), without waiting for its grace.
            await fetch_all(stub, "a")
            ok = await park(stub, "c", {0: b"c" * MiB, 1: b"d" * (2 * MiB)}, total=2)
            assert ok.status == pb.STATUS_OK
            evicted = await state_of(stub, "a")
            assert (evicted.state, evicted.reason) == (pb.STATE_TOMBSTONED, pb.REASON_EVICTED)


async def test_a_declared_batch_sent_again_needs_no_room_for_what_the_id_holds() -> None:
    """The answer to a Park is lost and the client sends the same batch again, header and
    all: its chunks are committed already, so on a full pool it is accepted, and the delivered
    id whose pages it would have reserved is not evicted for it."""
    async with running_producer(pool_bytes=4 * MiB, max_chunk_bytes=MiB) as server:
        async with stub_for(server) as stub:
            a = {0: b"\x01" * MiB, 1: b"\x02" * MiB}
            first = await park(stub, "a", a, total=2, batch_bytes=2 * MiB)
            assert first.status == pb.STATUS_OK
            await park(stub, "c", {0: b"\x03" * MiB, 1: b"\x04" * MiB}, total=2)
            assert (await fetch_all(stub, "c"))[-1].done.status == pb.STATUS_OK
            assert server.pool.statistics().free_bytes == 0
            again = await park(stub, "a", a, total=2, batch_bytes=2 * MiB)
            assert (again.status, again.chunks_parked, again.bytes_parked) == (
                pb.STATUS_OK,
                2,
                2 * MiB,
            ), again
            assert (await state_of(stub, "c")).state == pb.STATE_DELIVERED
            assert server.lot.statistics().evicted_total == 0
            server.lot.check_invariants()
            # A new id's declared batch still reserves all it declares, evicting for it.
            fresh = await park(stub, "b", {}, batch_bytes=2 * MiB)
            assert fresh.status == pb.STATUS_OK
            evicted = await state_of(stub, "c")
            assert (evicted.state, evicted.reason) == (pb.STATE_TOMBSTONED, pb.REASON_EVICTED)
            # Now a and nothing else that could go: the same re-send is still accepted.
            await park(stub, "d", {0: b"\x05" * MiB, 1: b"\x06" * MiB}, total=2)
            assert server.pool.statistics().free_bytes == 0
            third = await park(stub, "a", a, total=2, batch_bytes=2 * MiB)
            assert third.status == pb.STATUS_OK, third
            assert (await state_of(stub, "d")).state == pb.STATE_PARKED
            server.lot.check_invariants()


@pytest.mark.parametrize("cut", ["cancel", "deadline"])
async def test_park_cut_off_mid_batch_is_undone_not_committed(cut: str) -> None:
    """A prefill that goes away mid-batch (cancel, deadline, crash) leaves nothing behind: the
    batch is all-or-nothing, so its two stored chunks are freed and the id stays unknown —
    not PARKED half-filled, holding memory for a lease and refusing a retry's other bytes."""
    async with running_producer() as server, stub_for(server) as stub:
        hold = asyncio.Event()

        async def upload() -> Any:
            for message in park_requests("cut", chunks_of(2, 256 * 1024), total=4, commit=False):
                yield message
            await hold.wait()  # chunks 2 and 3 never come

        call = stub.Park(upload(), timeout=1.0 if cut == "deadline" else None)
        await wait_until(
            lambda: server.lot.statistics().pending_bytes == 2 * 256 * 1024 + 1,
            what="two chunks stored",
        )
        if cut == "cancel":
            call.cancel()
        with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
            await call
        await wait_until(
            lambda: server.pool.statistics().used_bytes == 0, what="the cut-off batch undone"
        )
        assert (await state_of(stub, "cut")).state == pb.STATE_UNKNOWN
        hold.set()
        server.lot.check_invariants()


async def test_a_failing_reaper_pass_is_logged_and_reaping_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass that raises (a bug) must not end reaping for good: leases would never
    expire again and the pool would fill."""
    clock = FakeClock()
    async with (
        running_producer(clock=clock, unbound_store_timeout_s=5) as server,
        stub_for(server) as stub,
    ):
        real_reap = server.lot.reap
        failed: list[str] = []

        def reap_failing_once() -> list[str]:
            if not failed:
                failed.append("injected")
                raise RuntimeError("injected reaper failure")
            return real_reap()

        monkeypatch.setattr(server.lot, "reap", reap_failing_once)
        await wait_until(lambda: failed, what="the failing pass")
        await park(stub, "later", {0: b"l"}, total=1)
        clock.advance(6)
        await wait_until(lambda: server.lot.statistics().reaped_total == 1, what="a later reap")
        assert "reaper pass failed" in caplog.text


async def test_a_park_stream_that_goes_quiet_is_undone_after_the_idle_timeout() -> None:
    """A prefill client that stays connected but stops sending (stuck) would otherwise hold its
    reserved pages for ever: after park_idle_timeout_s of silence the batch is undone and the
    call answered in-band, without waiting for the client's next message."""
    async with running_producer(park_idle_timeout_s=0.5) as server, stub_for(server) as stub:
        hold = asyncio.Event()

        async def upload() -> Any:
            # A header that reserves 4 MiB and no chunk.
            for message in park_requests("quiet", {}, total=4, batch_bytes=4 * MiB, commit=False):
                yield message
            await hold.wait()  # connected, silent

        reply = await asyncio.wait_for(stub.Park(upload()), 10)
        hold.set()
        assert (reply.status, reply.reason) == (pb.STATUS_FAILED, pb.REASON_NOT_COMMITTED)
        assert "sent nothing for 0.5s" in reply.detail
        pool = server.pool.statistics()
        assert (pool.used_bytes, pool.reservations_open) == (0, 0)
        assert (await state_of(stub, "quiet")).state == pb.STATE_UNKNOWN
        server.lot.check_invariants()


async def test_chunk_conflict_idempotent_repark_and_checksum_mismatch() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "x", {0: b"same"}, total=3)
        again = await park(stub, "x", {0: b"same", 1: b"new"})
        assert again.status == pb.STATUS_OK and again.chunks_parked == 2
        conflict = await park(stub, "x", {2: b"fine", 0: b"diff"})
        assert (conflict.status, conflict.reason) == (pb.STATUS_FAILED, pb.REASON_CHUNK_CONFLICT)
        assert (await state_of(stub, "x")).chunks_parked == 2  # chunk 2 of that batch undone
        totals = await park(stub, "x", {}, total=4)
        assert totals.reason == pb.REASON_CHUNK_CONFLICT
        bad = park_requests("y", {0: b"payload"})
        bad[1].chunk.crc32c ^= 1
        reply = await stub.Park(iter(bad))
        assert (reply.status, reply.reason) == (pb.STATUS_FAILED, pb.REASON_CHECKSUM_MISMATCH)
        assert (await state_of(stub, "y")).state == pb.STATE_UNKNOWN
        server.lot.check_invariants()


async def test_an_empty_first_batch_reports_no_total_since_the_id_is_forgotten() -> None:
    """A header declaring a total and a commit of nothing leave the id unknown, its total
    forgotten with it: the answer agrees with Lookup, and the next header may declare another."""
    async with running_producer() as server, stub_for(server) as stub:
        empty = await park(stub, "e", {}, total=3)
        assert (empty.status, empty.chunks_parked, empty.total_chunks) == (pb.STATUS_OK, 0, 0)
        state = await state_of(stub, "e")
        assert (state.state, state.total_chunks) == (pb.STATE_UNKNOWN, 0)
        later = await park(stub, "e", {0: b"x"}, total=5)
        assert (later.status, later.total_chunks) == (pb.STATUS_OK, 5)
        server.lot.check_invariants()


async def test_epoch_mismatch_answered_at_once() -> None:
    """A Fetch for another producer epoch is refused before it binds: nothing streamed and no
    waiting, however long the consumer offered to wait."""
    async with running_producer() as server, stub_for(server) as stub:
        # Chunk 1 missing: a producer that bound first and checked the epoch later would have
        # something to wait for (and chunk 0 to send), so "at once" is observable.
        await park(stub, "e", {0: b"e"}, total=2)
        started = time.monotonic()
        msgs = await fetch_all(stub, "e", expected_epoch=server.epoch ^ 1, wait_timeout_s=30)
        elapsed = time.monotonic() - started
        assert len(msgs) == 1 and msgs[0].done.reason == pb.REASON_EPOCH_MISMATCH
        # max_fetch_wait_s is 10 s in the test settings: an answer that waited would take it.
        assert elapsed < 2, f"epoch mismatch answered after {elapsed:.3f}s"
        assert (await state_of(stub, "e")).state == pb.STATE_PARKED


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([], "empty Park stream"),
        ([pb.ParkRequest(chunk=pb.Chunk(chunk_id=0, data=b"x"))], "first Park message"),
        ([pb.ParkRequest(header=pb.ParkHeader(kv_request_id=""))], "empty"),
        ([pb.ParkRequest(header=pb.ParkHeader(kv_request_id="a\nb"))], "control character"),
        ([pb.ParkRequest(header=pb.ParkHeader(kv_request_id="x" * 257))], "257 bytes"),
        ([pb.ParkRequest()], "neither header nor chunk"),
        (
            [
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h")),
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h")),
            ],
            "ParkHeader repeated",
        ),
        (
            [
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h", total_chunks=2)),
                pb.ParkRequest(chunk=pb.Chunk(chunk_id=2, data=b"x")),
            ],
            "out of range",
        ),
        (
            # With no total declared, the highest chunk id is 2**32 - 2: the total its commit
            # fixes must fit the uint32 field, and 2**32 - 1 marks a data connection's end.
            [
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h")),
                pb.ParkRequest(chunk=pb.Chunk(chunk_id=2**32 - 1, data=b"x")),
            ],
            "out of range",
        ),
        (
            [
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h")),
                pb.ParkRequest(chunk=pb.Chunk(chunk_id=0, data=b"")),
            ],
            "no data",
        ),
        (
            [
                pb.ParkRequest(header=pb.ParkHeader(kv_request_id="h")),
                pb.ParkRequest(chunk=pb.Chunk(chunk_id=0, data=b"x" * (4 * MiB + 1))),
            ],
            "max_chunk_bytes",
        ),
    ],
)
async def test_malformed_park_is_invalid_argument_and_stores_nothing(requests, message) -> None:  # type: ignore[no-untyped-def]
    async with running_producer() as server, stub_for(server) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Park(iter(requests))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


async def test_malformed_fetch_keepalive_lookup_release_are_invalid_argument() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "m", {0: b"m"}, total=1)
        cases = [
            (stub.Fetch, pb.FetchRequest(kv_request_id=""), "empty"),
            (stub.Fetch, pb.FetchRequest(kv_request_id="m", chunk_ids=[0, 0]), "repeats"),
            (stub.Fetch, pb.FetchRequest(kv_request_id="m", chunk_ids=[1]), "out of range"),
            # An id nobody parked yet: no total, so only the id space bounds the request.
            (stub.Fetch, pb.FetchRequest(kv_request_id="n", chunk_ids=[2**32 - 1]), "range"),
            (stub.Fetch, pb.FetchRequest(kv_request_id="m", wait_timeout_s=-1), "wait_timeout_s"),
            (stub.Fetch, pb.FetchRequest(kv_request_id="m", wait_timeout_s=float("nan")), "wait"),
            (stub.KeepAlive, pb.KeepAliveRequest(), "empty"),
            (stub.KeepAlive, pb.KeepAliveRequest(kv_request_ids=["m"], extend_s=-2), "extend_s"),
            (stub.KeepAlive, pb.KeepAliveRequest(kv_request_ids=["\x00"]), "control"),
            (stub.Lookup, pb.LookupRequest(kv_request_ids=["ok"] * 10_001), "at most"),
            # More chunk ids than the pool has pages (64 MiB / 256 KiB): can never be served.
            (stub.Fetch, pb.FetchRequest(kv_request_id="n", chunk_ids=range(257)), "can hold"),
            (stub.Release, pb.ReleaseRequest(kv_request_id="\x7f"), "control"),
        ]
        for method, request, message in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                result = method(request)
                if hasattr(result, "__aiter__"):
                    [m async for m in result]
                else:
                    await result
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert message in (err.value.details() or ""), (request, err.value.details())
        assert (await state_of(stub, "m")).state == pb.STATE_PARKED


async def test_chunk_ids_that_repeat_are_invalid_argument_whatever_the_ids_state() -> None:
    """A malformed request is refused as such, not answered in-band by a refusal that only
    applies to valid ones: a tombstoned id, another epoch, a producer shutting down."""
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "gone", {0: b"g"}, total=1)
        released = await stub.Release(pb.ReleaseRequest(kv_request_id="gone"))
        assert released.status == pb.STATUS_OK
        cases: list[dict[str, Any]] = [
            {"kid": "gone", "chunk_ids": [0, 0]},
            {"kid": "n", "chunk_ids": [1, 0, 1], "expected_epoch": server.epoch + 1},
            {"kid": "n", "chunk_ids": [2, 2], "shutting_down": True},
        ]
        for case in cases:
            if case.pop("shutting_down", False):
                server.lot.begin_shutdown()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fetch_all(stub, case.pop("kid"), **case)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
            assert "repeats" in (err.value.details() or ""), err.value.details()
        assert late_fetches(server) == 0


async def test_server_info_health_and_reflection() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with running_producer(unbound_store_timeout_s=7) as server, stub_for(server) as stub:
        info = await stub.GetServerInfo(pb.GetServerInfoRequest())
        assert info.producer_epoch == server.epoch != 0
        assert info.unbound_store_timeout_s == 7 and info.tombstone_retention_s == 60
        assert info.consumer_load_timeout_s == 30 and info.pool_bytes == 64 * MiB
        assert info.pool_free_bytes == 64 * MiB and info.version
        async with grpc.aio.insecure_channel(server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(
                health_pb2.HealthCheckRequest(service="kvpark.v1.KVProducer")
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            replies = [r async for r in refl.ServerReflectionInfo(iter([req]))]
            names = {s.name for s in replies[0].list_services_response.service}
            assert "kvpark.v1.KVProducer" in names


async def test_shutdown_drains_bound_fetch_then_fails_the_rest() -> None:
    """Shutdown: a bound Fetch that can finish is served to its end — the producer waits for
    it, not for the whole grace — and only then is what remains (an id parked but never
    fetched, and the drained one, delivered but not confirmed) failed SHUTTING_DOWN."""
    grace = 30.0
    async with running_producer(shutdown_grace_s=grace) as server:
        # Without BDP probing the fetch's HTTP/2 window stays at 64 KiB, so the producer cannot
        # push the 8 MiB into the client's buffers (finishing the fetch on its own) while this
        # test holds the stream: the fetch is still bound when the shutdown begins.
        options = [*channel_options(), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            data = chunks_of(8, MiB)
            await park(stub, "drain", data, total=8)
            await park(stub, "parked", {0: b"p"}, total=1)  # never fetched: "the rest"
            call = stub.Fetch(pb.FetchRequest(kv_request_id="drain"))
            assert (await call.read()).chunk.data == data[0]  # bound, streaming
            started = time.monotonic()
            shutdown = asyncio.create_task(server.shutdown())
            await wait_until(
                lambda: server.lot.statistics().shutting_down and server.lot.bound_count == 1,
                what="the shutdown to begin with the fetch still bound",
            )
            refused = await park(stub, "newcomer", {0: b"n"}, total=1)
            assert refused.reason == pb.REASON_SHUTTING_DOWN
            rest = []
            while (message := await call.read()) is not grpc.aio.EOF:
                rest.append(message)
            assert [m.chunk.data for m in rest[:-1]] == [data[c] for c in range(1, 8)]
            done = rest[-1].done
            assert done.status == pb.STATUS_OK
            assert (done.chunks_sent, done.bytes_sent) == (8, sum(map(len, data.values())))
            assert await call.code() == grpc.StatusCode.OK
            await asyncio.wait_for(shutdown, grace)
            elapsed = time.monotonic() - started
            # Stopped once the drain finished; a shutdown that sat out the grace takes 30 s.
            assert elapsed < grace / 3, f"shutdown took {elapsed:.3f}s of a {grace}s grace"
        drained, rest_failed = server.lot.lookup(["drain", "parked"])
        assert (drained.state, drained.reason) == (
            pb.STATE_TOMBSTONED,
            pb.REASON_SHUTTING_DOWN,
        )
        assert (rest_failed.state, rest_failed.reason) == (
            pb.STATE_TOMBSTONED,
            pb.REASON_SHUTTING_DOWN,
        )
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


async def test_shutdown_ends_a_fetch_waiting_for_a_chunk_at_once() -> None:
    """Shutdown (docs/protocol.md): a bound Fetch waiting for a chunk (its chunk 1 is never
    parked, and no Park is taken any more) gets TransferDone{FAILED, SHUTTING_DOWN} at once,
    with what was committed sent, and does not hold the drain for the grace."""
    grace = 30.0
    async with running_producer(shutdown_grace_s=grace) as server, stub_for(server) as stub:
        await park(stub, "stuck", {0: b"s" * 100}, total=2)
        call = stub.Fetch(pb.FetchRequest(kv_request_id="stuck", wait_timeout_s=60))
        assert (await call.read()).chunk.chunk_id == 0
        started = time.monotonic()
        shutdown = asyncio.create_task(server.shutdown())
        last = await call.read()
        assert (last.done.status, last.done.reason) == (pb.STATUS_FAILED, pb.REASON_SHUTTING_DOWN)
        assert last.done.chunks_sent == 1
        assert await call.read() is grpc.aio.EOF
        await asyncio.wait_for(shutdown, grace)
        elapsed = time.monotonic() - started
        assert elapsed < grace / 3, f"shutdown took {elapsed:.3f}s of a {grace}s grace"
        (stuck,) = server.lot.lookup(["stuck"])
        assert (stuck.state, stuck.reason) == (pb.STATE_TOMBSTONED, pb.REASON_SHUTTING_DOWN)
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


async def test_shutdown_fails_a_bound_fetch_that_outlasts_the_grace() -> None:
    """A Fetch that could finish but does not within the grace (its consumer reads nothing)
    holds the drain for the whole grace, then its id is ended SHUTTING_DOWN and freed."""
    grace = 0.5
    async with running_producer(shutdown_grace_s=grace) as server:
        # As in the drain test: a 64 KiB window keeps the 8 MiB in the producer.
        options = [*channel_options(), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            await park(stub, "slow", chunks_of(8, MiB), total=8)
            call = stub.Fetch(pb.FetchRequest(kv_request_id="slow"))
            assert (await call.read()).chunk.chunk_id == 0  # bound; then nothing is read
            started = time.monotonic()
            await server.shutdown()
            elapsed = time.monotonic() - started
            # The grace deadline starts after `started`: a drain that waited cannot end sooner.
            assert elapsed >= grace, f"shutdown took {elapsed:.3f}s of a {grace}s grace"
            call.cancel()
        (slow,) = server.lot.lookup(["slow"])
        assert (slow.state, slow.reason) == (pb.STATE_TOMBSTONED, pb.REASON_SHUTTING_DOWN)
        assert server.pool.statistics().used_bytes == 0
        server.lot.check_invariants()


async def test_the_highest_chunk_id_parks_and_its_total_fits() -> None:
    """Chunk 2**32 - 2 alone, no total declared: the commit fixes the total to 2**32 - 1, the
    largest a uint32 holds, and every answer carries it."""
    async with running_producer() as server, stub_for(server) as stub:
        top = 2**32 - 2
        answer = await park(stub, "top", {top: b"t"})
        assert answer.status == pb.STATUS_OK and answer.total_chunks == top + 1, answer
        assert (await state_of(stub, "top")).total_chunks == top + 1
        messages = await fetch_all(stub, "top", chunk_ids=[top])
        assert messages[0].chunk.chunk_id == top and messages[0].chunk.data == b"t"
        assert messages[-1].done.status == pb.STATUS_OK
        server.lot.check_invariants()
