"""`load` end to end against a real in-process grpc.aio producer on port 0, with the sync
client (driven from a worker thread, off the producer's loop) and the async client.

Where the path is the point, the test asserts it: the client's Fetch calls are recorded with an
interceptor (did it cancel?) and the producer's own state and counters are read."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import (
    FakeClock,
    MiB,
    park,
    park_requests,
    running_producer,
    state_of,
    stub_for,
    wait_for,
    wait_until,
)
from consumer_support import (
    AioRecorder,
    SyncRecorder,
    cancelled_by_client,
    in_thread,
    joined,
    payload,
)

from kvpark.client import (
    AsyncKVConsumer,
    AuthError,
    BufferTooSmallError,
    ClientClosedError,
    KVConsumer,
    LoadPath,
    Reason,
    RequestRejectedError,
    State,
    Timeout,
    TimeoutConfigWarning,
    TransportError,
)
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc

PARK_TOKEN = "park-token-for-consumer-tests"
FETCH_TOKEN = "fetch-token-for-consumer-tests"


def late_fetches(server) -> int:  # type: ignore[no-untyped-def]
    return int(server.lot.statistics().late_fetch_rejections_total)


# ------------------------------------------------------------------------- bytes land right


async def test_async_load_lands_bytes_in_callers_numpy_array() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(5, 300_000)
        await park(stub, "req-a", chunks, total=5)
        into = np.full(2 * MiB, 0xEE, dtype=np.uint8)
        async with AsyncKVConsumer(server.target) as client:
            result = await client.load(
                "req-a", num_chunks=5, into=into, expected_epoch=server.epoch
            )
        assert result.ok and result.reason is None and result.path is LoadPath.REMOTE
        expected = joined(chunks)
        assert (result.chunks_loaded, result.bytes) == (5, len(expected))
        assert bytes(into[: len(expected)]) == expected
        assert (into[len(expected) :] == 0xEE).all(), "nothing written past the payload"
        assert np.shares_memory(result.data, into) and result.data.size == len(expected)
        assert result.chunk_sizes == tuple(len(chunks[i]) for i in range(5))
        assert result.chunk_offsets[3] == sum(len(chunks[i]) for i in range(3))
        assert result.producer_epoch == server.epoch and result.elapsed_s > 0
        state = (await stub.Lookup(pb.LookupRequest(kv_request_ids=["req-a"]))).states[0]
        assert (state.state, state.reason) == (pb.STATE_TOMBSTONED, pb.REASON_ALREADY_CONSUMED)


async def test_sync_load_lands_bytes_in_callers_numpy_array() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(4, 1 * MiB, seed=1)
        await park(stub, "req-s", chunks, total=4)
        into = np.zeros((4, MiB + 8), dtype=np.uint8)  # 2-D: viewed as raw bytes

        def load() -> object:
            with KVConsumer(server.target) as client:
                return client.load("req-s", num_chunks=4, into=into)

        result = await in_thread(load)
        assert result.ok  # type: ignore[attr-defined]
        assert into.reshape(-1)[: sum(map(len, chunks.values()))].tobytes() == joined(chunks)


async def test_load_in_requested_order_into_bytearray_and_without_into() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(4, 10_000, seed=2)
        await park(stub, "ordered", chunks, total=4)
        await park(stub, "owned", chunks, total=4)
        order = [2, 0, 3]
        buf = bytearray(50_000)
        async with AsyncKVConsumer(server.target) as client:
            r = await client.load("ordered", chunk_ids=order, into=buf)
            assert r.ok and r.chunk_ids == (2, 0, 3)
            assert bytes(buf[: r.bytes]) == joined(chunks, order)
            # No `into`, no count: all chunks, in a new array the result owns.
            owned = await client.load("owned")
            assert owned.ok and owned.chunk_ids is None and owned.chunks_loaded == 4
            assert owned.data.tobytes() == joined(chunks)


async def test_sync_and_async_share_one_channel_for_many_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every channel the clients open is counted where they look the factory up (`grpc` and
    `grpc.aio`): ten concurrent async loads and ten sync loads open one channel per client."""
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(2, 1000)
        ids = [f"many-{i}" for i in range(20)]
        for kid in ids:
            await park(stub, kid, chunks, total=2)
        opened: dict[str, list[str]] = {"sync": [], "async": []}

        def counting(flavour: str, open_channel: Callable[..., Any]) -> Callable[..., Any]:
            def counted(target: str, *args: Any, **kwargs: Any) -> Any:
                opened[flavour].append(target)
                return open_channel(target, *args, **kwargs)

            return counted

        monkeypatch.setattr(grpc, "insecure_channel", counting("sync", grpc.insecure_channel))
        monkeypatch.setattr(
            grpc.aio, "insecure_channel", counting("async", grpc.aio.insecure_channel)
        )
        async with AsyncKVConsumer(server.target) as client:
            import asyncio

            results = await asyncio.gather(*(client.load(k, num_chunks=2) for k in ids[:10]))
            assert all(r.ok for r in results)
        assert opened == {"sync": [], "async": [server.target]}

        def sync_loads() -> list[bool]:
            with KVConsumer(server.target) as client:
                return [client.load(k, num_chunks=2).ok for k in ids[10:]]

        assert all(await in_thread(sync_loads))
        assert opened == {"sync": [server.target], "async": [server.target]}


# ------------------------------------------------------------------------- late fetch: REAPED


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_late_fetch_after_reap_answers_reaped_at_once_without_cancel(flavour: str) -> None:
    """The reference's test, asserting the path: the failure came from the producer's
    TransferDone(FAILED, REAPED), the client never cancelled, the producer counted a late
    fetch, and it all took far less than the 30 s load timeout."""
    clock = FakeClock()
    async with running_producer(clock=clock, unbound_store_timeout_s=5) as server:
        async with stub_for(server) as stub:
            await park(stub, "late", payload(3, 1000), total=3)
            clock.advance(6)
            await wait_until(
                lambda: _is_reaped(stub, "late"),
                what="the id to be tombstoned REAPED",
            )
        before = late_fetches(server)
        timeout = Timeout(30)
        if flavour == "async":
            recorder: AioRecorder | SyncRecorder = AioRecorder()
            async with AsyncKVConsumer(
                server.target, timeout=timeout, interceptors=[recorder]
            ) as client:
                result = await client.load("late", num_chunks=3)
                calls = await recorder.outcomes()  # type: ignore[misc]
        else:
            recorder = SyncRecorder()

            def load() -> object:
                with KVConsumer(server.target, timeout=timeout, interceptors=[recorder]) as c:
                    return c.load("late", num_chunks=3)

            result = await in_thread(load)
            calls = await in_thread(recorder.outcomes)  # type: ignore[arg-type]
        assert not result.ok and result.reason is Reason.REAPED  # type: ignore[attr-defined]
        assert result.elapsed_s < 1.0, "far less than the 30 s load timeout"  # type: ignore[attr-defined]
        assert result.chunks_loaded == 0 and result.path is LoadPath.RECOMPUTE  # type: ignore[attr-defined]
        assert result.grpc_code is None  # in-band answer, not a transport status  # type: ignore[attr-defined]
        fetches = [c for c in calls if c.method.endswith("/Fetch")]
        assert len(fetches) == 1
        assert fetches[0].outcome is not None and fetches[0].outcome[0] is grpc.StatusCode.OK
        assert not cancelled_by_client(fetches[0]), "the client must not cancel a done stream"
        assert late_fetches(server) == before + 1


async def _is_reaped(stub, kid: str) -> bool:  # type: ignore[no-untyped-def]
    s = await state_of(stub, kid)
    return bool(s.state == pb.STATE_TOMBSTONED and s.reason == pb.REASON_REAPED)


# ------------------------------------------------------------------------- load timeouts


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_load_timeout_while_producer_stalls_cancels_and_id_is_parked_again(
    flavour: str,
) -> None:
    """Chunk 0 is parked, chunk 1 never comes: the producer streams chunk 0 then waits (up to
    max_fetch_wait_s = 30 s). The client's 1 s load timeout fires, the RPC is cancelled (the
    producer's abort signal), and the id is PARKED again, so a retry can still load it."""
    async with running_producer(max_fetch_wait_s=30) as server, stub_for(server) as stub:
        chunks = payload(2, 50_000)
        await park(stub, "stall", {0: chunks[0]}, total=2)
        limit = 1.0
        into = np.zeros(200_000, np.uint8)
        if flavour == "async":
            recorder: AioRecorder | SyncRecorder = AioRecorder()
            client_a = AsyncKVConsumer(server.target, interceptors=[recorder])
            started = time.monotonic()
            result = await client_a.load("stall", num_chunks=2, into=into, timeout=limit)
            took = time.monotonic() - started
            calls = await recorder.outcomes()  # type: ignore[misc]
            await client_a.aclose()
        else:
            recorder = SyncRecorder()
            client_s = KVConsumer(server.target, interceptors=[recorder])
            started = time.monotonic()
            result = await in_thread(client_s.load, "stall", num_chunks=2, into=into, timeout=limit)
            took = time.monotonic() - started
            calls = await in_thread(recorder.outcomes)  # type: ignore[arg-type]
            client_s.close()
        assert result.reason is Reason.TIMEOUT and not result.ok
        assert limit <= result.elapsed_s < limit + 0.5 and took < limit + 0.5
        assert result.chunks_loaded == 1 and bytes(into[: len(chunks[0])]) == chunks[0]
        assert result.grpc_code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert result.first_missing_chunk == 1 and result.path is LoadPath.PARTIAL
        # The call ended by the deadline: the client's transport reset the stream.
        (fetch,) = calls
        assert fetch.outcome is not None
        assert fetch.outcome[0] is grpc.StatusCode.DEADLINE_EXCEEDED
        # The producer saw the abort: PARKED again with its lease, nothing bound.
        parked = await wait_until(
            lambda: _state_is(stub, "stall", pb.STATE_PARKED), what="PARKED again"
        )
        assert parked.chunks_parked == 1 and parked.lease_remaining_s > 0
        assert server.lot.bound_count == 0
        # The retry within the lease works.
        await park(stub, "stall", {1: chunks[1]})
        async with AsyncKVConsumer(server.target) as client:
            again = await client.load("stall", num_chunks=2, into=into)
        assert again.ok and bytes(into[: again.bytes]) == joined(chunks)


async def _state_is(stub, kid: str, state: int) -> object:  # type: ignore[no-untyped-def]
    s = await state_of(stub, kid)
    return s if s.state == state else None


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_first_chunk_timeout_cancels_a_fetch_that_waits_for_nothing(flavour: str) -> None:
    """Fetch before any Park binds the id as a demand and waits; the first-chunk watchdog
    gives up early (0.3 s of a 20 s total) and cancels: the demand is dropped."""
    async with running_producer(max_fetch_wait_s=30) as server, stub_for(server) as stub:
        timeout = Timeout(20, first_chunk_s=0.3)
        if flavour == "async":
            recorder: AioRecorder | SyncRecorder = AioRecorder()
            async with AsyncKVConsumer(server.target, interceptors=[recorder]) as client:
                result = await client.load("never", num_chunks=2, timeout=timeout)
                calls = await recorder.outcomes()  # type: ignore[misc]
        else:
            recorder = SyncRecorder()

            def load() -> object:
                with KVConsumer(server.target, interceptors=[recorder]) as c:
                    return c.load("never", num_chunks=2, timeout=timeout)

            result = await in_thread(load)
            calls = await in_thread(recorder.outcomes)  # type: ignore[arg-type]
        assert result.reason is Reason.TIMEOUT  # type: ignore[attr-defined]
        assert 0.3 <= result.elapsed_s < 0.8  # type: ignore[attr-defined]
        assert "first chunk" in result.detail  # type: ignore[attr-defined]
        assert cancelled_by_client(calls[0])
        await wait_until(lambda: server.lot.bound_count == 0, what="the demand to be dropped")
        assert (await state_of(stub, "never")).state == pb.STATE_UNKNOWN


async def test_size_scaled_budget_shortens_the_load_timeout() -> None:
    async with running_producer(max_fetch_wait_s=30) as server, stub_for(server) as stub:
        await park(stub, "scaled", {0: b"x" * 1000}, total=2)
        into = np.zeros(2**20, np.uint8)  # 1 MiB: budget 0.2 + 0.1/1024 s
        timeout = Timeout(total_s=20, base_s=0.2, per_gib_s=0.1)
        async with AsyncKVConsumer(server.target) as client:
            result = await client.load("scaled", num_chunks=2, into=into, timeout=timeout)
        assert result.reason is Reason.TIMEOUT and 0.2 <= result.elapsed_s < 0.7


# ------------------------------------------------------------------------- corrupted chunk


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_corrupted_chunk_gives_checksum_mismatch_and_never_counts(flavour: str) -> None:
    """A byte of chunk 1 flips in the producer's pool after it was parked with a correct
    CRC32C. The client verifies before it copies: chunk 1 never lands in `into`."""
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(3, 64 * 1024, seed=3)
        # total=4 with chunk 3 never parked keeps the stream open, so the client's cancel
        # deterministically reaches the producer before the id could count as consumed.
        await park(stub, "bitrot", chunks, total=4)
        # Reach into the real pool: the slot holding chunk 1 (a test-only peek at the lot).
        handle = server.lot._entries["bitrot"].chunks[1].handle
        server.pool.views(handle)[0][1234] ^= 0x01
        into = np.full(300_000, 0xAA, np.uint8)
        if flavour == "async":
            async with AsyncKVConsumer(server.target) as client:
                result = await client.load("bitrot", num_chunks=4, into=into)
        else:

            def load() -> object:
                with KVConsumer(server.target) as c:
                    return c.load("bitrot", num_chunks=4, into=into)

            result = await in_thread(load)
        assert result.reason is Reason.CHECKSUM_MISMATCH  # type: ignore[attr-defined]
        assert result.chunks_loaded == 1 and result.bytes == len(chunks[0])  # type: ignore[attr-defined]
        assert result.first_missing_chunk == 1  # type: ignore[attr-defined]
        assert "chunk 1" in result.detail  # type: ignore[attr-defined]
        n0 = len(chunks[0])
        assert bytes(into[:n0]) == chunks[0]
        assert (into[n0:] == 0xAA).all(), "the corrupt chunk must never land"
        # The client abandoned the stream with a cancel: the producer holds the id PARKED.
        await wait_until(lambda: _state_is(stub, "bitrot", pb.STATE_PARKED), what="PARKED")
        assert server.lot.bound_count == 0


# ------------------------------------------------------------------------- other outcomes


async def test_buffer_too_small_raises_after_cancelling_the_fetch() -> None:
    async with running_producer(max_fetch_wait_s=30) as server, stub_for(server) as stub:
        chunks = payload(3, 10_000)
        # Chunk 2 is not parked yet, so the stream is still open when chunk 1 overflows: the
        # cancel reaches the producer before the id is delivered, so it goes back to PARKED.
        await park(stub, "big", {0: chunks[0], 1: chunks[1]}, total=3)
        recorder = AioRecorder()
        async with AsyncKVConsumer(server.target, interceptors=[recorder]) as client:
            small = np.zeros(15_000, np.uint8)
            with pytest.raises(BufferTooSmallError) as err:
                await client.load("big", num_chunks=3, into=small)
            e = err.value
            assert (e.chunks_loaded, e.bytes_loaded, e.needed, e.available) == (
                1, 10_000, 20_001, 15_000,
            )  # fmt: skip
            assert bytes(small[:10_000]) == chunks[0]
            assert cancelled_by_client((await recorder.outcomes())[0])
            await wait_until(lambda: _state_is(stub, "big", pb.STATE_PARKED), what="PARKED")
            await park(stub, "big", {2: chunks[2]})
            ok = await client.load("big", num_chunks=3, into=np.zeros(40_000, np.uint8))
            assert ok.ok and ok.data.tobytes() == joined(chunks)


async def test_epoch_mismatch_and_unknown_epoch() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "e", payload(1, 100), total=1)
        async with AsyncKVConsumer(server.target) as client:
            r = await client.load("e", num_chunks=1, expected_epoch=server.epoch ^ 1)
            # The answer names the epoch of the producer that gave it.
            assert r.reason is Reason.EPOCH_MISMATCH and r.producer_epoch == server.epoch
            assert r.elapsed_s < 1.0
            r = await client.load("e", num_chunks=1, expected_epoch=server.epoch)
            assert r.ok
            # What the client knows of the producer is (re)read in the background, never on a
            # load's path.
            await wait_until(
                lambda: client.info is not None and client.info.producer_epoch == server.epoch,
                what="ServerInfo read in the background",
            )


async def test_malformed_request_raises_instead_of_recomputing() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        await park(stub, "two", payload(2, 100), total=2)
        async with AsyncKVConsumer(server.target) as client:
            with pytest.raises(RequestRejectedError) as err:
                await client.load("two", chunk_ids=[0, 7])
            assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
            assert "out of range" in err.value.details


async def test_unreachable_producer_is_a_fast_unavailable_result() -> None:
    from conftest import free_port

    target = f"127.0.0.1:{free_port()}"
    async with AsyncKVConsumer(target) as client:
        r = await client.load("x", num_chunks=1)
        assert r.reason is Reason.UNAVAILABLE and r.elapsed_s < 5
        assert r.grpc_code is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TransportError) as err:
            await client.lookup(["x"])
        assert err.value.code is grpc.StatusCode.UNAVAILABLE

    def sync() -> object:
        with KVConsumer(target) as c:
            return c.load("x")

    assert (await in_thread(sync)).reason is Reason.UNAVAILABLE  # type: ignore[attr-defined]


async def test_closing_the_client_mid_load_ends_it_cancelled() -> None:
    import asyncio

    async with running_producer(max_fetch_wait_s=30) as server:
        client = AsyncKVConsumer(server.target)
        task = asyncio.create_task(client.load("pending", num_chunks=1))
        await wait_until(lambda: server.lot.bound_count == 1, what="the fetch to bind")
        await client.aclose()
        result = await task
        assert result.reason is Reason.CANCELLED
        await wait_until(lambda: server.lot.bound_count == 0, what="the demand to be dropped")


@pytest.mark.parametrize("end", ["client closed", "caller cancelled"])
async def test_a_unary_call_cut_short_is_closed_or_cancelled_never_confused(end: str) -> None:
    """A Lookup in flight when the client closes raises ClientClosedError, not a CancelledError
    in a task nobody cancelled (grpc.aio cancels a closing channel's calls); cancelling the
    caller's own task still propagates as a cancellation."""
    import asyncio
    import select
    import socket

    # A peer that takes the connection and never speaks HTTP/2: the call stays in flight.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        client = AsyncKVConsumer(f"127.0.0.1:{silent.getsockname()[1]}")
        try:
            task = asyncio.create_task(client.lookup(["x"], timeout=30))
            await wait_until(
                lambda: select.select([silent], [], [], 0)[0], what="the client to connect"
            )
            if end == "client closed":
                await client.aclose()
                with pytest.raises(ClientClosedError):
                    await task
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        finally:
            await client.aclose()


def test_sync_unary_call_cut_short_by_close_raises_client_closed() -> None:
    import select
    import socket
    import threading

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        client = KVConsumer(f"127.0.0.1:{silent.getsockname()[1]}")
        outcome: list[BaseException] = []

        def lookup() -> None:
            try:
                client.lookup(["x"], timeout=30)
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=lookup)
        caller.start()
        wait_for(lambda: select.select([silent], [], [], 0)[0], what="the client to connect")
        client.close()
        caller.join(10)
        assert not caller.is_alive()
        assert [type(e) for e in outcome] == [ClientClosedError], outcome


def test_a_call_started_just_after_close_raises_client_closed() -> None:
    """The window between a call taking its stub and starting: close() from another thread
    shuts the channel there, grpc raises a bare ValueError, the caller sees ClientClosedError."""
    client = KVConsumer("127.0.0.1:1")
    stub, fetch = client._stubs()  # what a call holds just before it starts
    client.close()
    for call, request in ((stub.Lookup, pb.LookupRequest()), (fetch, b"")):
        with pytest.raises(ClientClosedError):
            client._core.start_call(call, request, timeout=1)


async def test_cancelling_the_callers_task_cancels_the_fetch() -> None:
    import asyncio

    async with running_producer(max_fetch_wait_s=30) as server:
        async with AsyncKVConsumer(server.target) as client:
            task = asyncio.create_task(client.load("pending", num_chunks=1))
            await wait_until(lambda: server.lot.bound_count == 1, what="the fetch to bind")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(lambda: server.lot.bound_count == 0, what="the fetch to go")


# ------------------------------------------------------------------ ServerInfo, limits, auth


async def test_first_contact_reads_server_info_and_warns_once_about_timeouts() -> None:
    async with running_producer(tombstone_retention_s=40) as server:
        async with AsyncKVConsumer(server.target, timeout=Timeout(10)) as client:
            with warnings.catch_warnings():
                warnings.simplefilter("error", TimeoutConfigWarning)
                info = await client.server_info()
            assert info.producer_epoch == server.epoch and info.tombstone_retention_s == 40
            assert info.max_chunk_bytes == server.config.max_chunk_bytes
        # A load timeout not below the producer's tombstone retention: one warning.
        async with AsyncKVConsumer(server.target, timeout=Timeout(40)) as client:
            with pytest.warns(TimeoutConfigWarning, match="tombstone_retention_s"):
                await client.load("a", num_chunks=1, timeout=0.2)
                # The load's first contact reads ServerInfo in the background, and the load
                # may end first: this returns once it is read, either way.
                await client.server_info()
            with warnings.catch_warnings():
                warnings.simplefilter("error", TimeoutConfigWarning)
                await client.load("b", num_chunks=1, timeout=0.2)  # warned once already


async def test_channel_receive_limit_follows_the_producers_max_chunk_bytes() -> None:
    """The client starts with the spec's 16 MiB default limit; a producer that accepts 24 MiB
    chunks makes first contact rebuild the (still idle) channel with a larger limit."""
    async with running_producer(max_chunk_bytes=24 * MiB) as server, stub_for(server) as stub:
        big = {0: np.random.default_rng(5).bytes(20 * MiB)}
        await park(stub, "huge", big, total=1)
        async with AsyncKVConsumer(server.target) as client:
            r = await client.load("huge", num_chunks=1)
        assert r.ok and r.data.tobytes() == big[0]


async def test_token_is_sent_as_bearer_metadata_and_auth_errors_raise() -> None:
    async with running_producer(park_token=PARK_TOKEN, fetch_token=FETCH_TOKEN) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            reply = await pb_grpc.KVProducerStub(channel).Park(
                iter(park_requests("tok", {0: b"secret"}, total=1)),
                metadata=(("authorization", f"Bearer {PARK_TOKEN}"),),
            )
            assert reply.status == pb.STATUS_OK
        async with AsyncKVConsumer(server.target, token=PARK_TOKEN) as prefill:
            with pytest.raises(AuthError) as denied:
                await prefill.load("tok", num_chunks=1)  # the other role's token
            assert denied.value.code is grpc.StatusCode.PERMISSION_DENIED
        async with AsyncKVConsumer(server.target) as anonymous:
            with pytest.raises(AuthError) as unauth:
                await anonymous.lookup(["tok"])
            assert unauth.value.code is grpc.StatusCode.UNAUTHENTICATED
        async with AsyncKVConsumer(server.target, token=FETCH_TOKEN) as decode:
            states = await decode.lookup(["tok"])
            assert states[0].state is State.PARKED
            r = await decode.load("tok", num_chunks=1)
            assert r.ok and r.data.tobytes() == b"secret"

        def sync() -> object:
            with KVConsumer(server.target, token=FETCH_TOKEN) as c:
                return c.lookup(["tok"])[0].state

        # Loaded, then confirmed with the fetch token (the decode role may confirm what was
        # delivered to it).
        assert await in_thread(sync) is State.TOMBSTONED


async def test_tls_credentials(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tls_certs import make_certs

    certs = make_certs(tmp_path)
    async with running_producer(
        tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)
    ) as server:
        creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
        async with AsyncKVConsumer(f"localhost:{server.port}", credentials=creds) as client:
            assert (await client.server_info()).producer_epoch == server.epoch

        def sync() -> int:
            with KVConsumer(f"localhost:{server.port}", credentials=creds) as c:
                return c.server_info().producer_epoch

        assert await in_thread(sync) == server.epoch


@pytest.mark.parametrize(
    ("timeout", "limit"),
    [(Timeout(1.0), 1.0), (Timeout(total_s=None, first_chunk_s=0.5), 0.5)],
)
async def test_unresponsive_producer_times_out_at_the_load_timeout(
    timeout: Timeout, limit: float
) -> None:
    """A peer that accepts TCP and never answers (a paused container, a hung host): first
    contact is bounded by the load's own limits, so the load ends TIMEOUT on time."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # the kernel completes handshakes; nobody ever reads
        target = f"127.0.0.1:{listener.getsockname()[1]}"
        async with AsyncKVConsumer(target) as client:
            result = await client.load("x", num_chunks=1, timeout=timeout)
        assert result.reason is Reason.TIMEOUT
        assert limit <= result.elapsed_s < limit + 0.5

        def sync() -> object:
            with KVConsumer(target) as c:
                return c.load("x", num_chunks=1, timeout=timeout)

        result = await in_thread(sync)
        assert result.reason is Reason.TIMEOUT  # type: ignore[attr-defined]
        assert limit <= result.elapsed_s < limit + 0.5  # type: ignore[attr-defined]
