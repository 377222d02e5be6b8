"""`keep_alive`: while a request waits in the decode queue its lease is renewed, so it stays
fetchable past `unbound_store_timeout_s`; ended ids drop out; the loop stops cleanly."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from conftest import park, running_producer, state_of, stub_for, wait_until
from consumer_support import in_thread, payload

from kvpark.client import (
    AsyncKVConsumer,
    ClientClosedError,
    KVConsumer,
    Reason,
    State,
    UsageError,
)
from kvpark.client import _sync as sync_client
from kvpark.client.keepalive import KeepAlive
from kvpark.pb import kvpark_pb2 as pb

LEASE_S = 1.0


async def _reaped(stub, kid: str) -> bool:  # type: ignore[no-untyped-def]
    s = await state_of(stub, kid)
    return bool(s.state == pb.STATE_TOMBSTONED and s.reason == pb.REASON_REAPED)


async def _older_than(stub, kid: str, age_s: float) -> bool:  # type: ignore[no-untyped-def]
    s = await state_of(stub, kid)
    return bool(s.state == pb.STATE_PARKED and s.age_s > age_s)


async def test_async_keep_alive_keeps_an_id_fetchable_past_its_lease() -> None:
    async with running_producer(unbound_store_timeout_s=LEASE_S) as server:
        async with stub_for(server) as stub:
            chunks = payload(2, 1000)
            await park(stub, "queued", chunks, total=2)
            await park(stub, "forgotten", chunks, total=2)
            async with AsyncKVConsumer(server.target) as client:
                async with client.keep_alive(["queued"], interval_s=0.2) as ka:
                    # The control id, not kept alive, is reaped after one lease...
                    await wait_until(lambda: _reaped(stub, "forgotten"), what="control reaped")
                    # ...while the kept one outlives two leases.
                    await wait_until(
                        lambda: _older_than(stub, "queued", 2 * LEASE_S), what="2 leases"
                    )
                    assert ka.statistics().rounds >= 5 and ka.last_error is None
                    assert ka.last_states["queued"].state is State.PARKED
                assert not ka.running  # leaving the block stopped the task
                result = await client.load("queued", num_chunks=2)
                assert result.ok


async def test_sync_keep_alive_with_default_interval_and_ended_ids_drop_out() -> None:
    async with running_producer(unbound_store_timeout_s=LEASE_S) as server:
        async with stub_for(server) as stub:
            chunks = payload(1, 100)
            await park(stub, "kept", chunks, total=1)
            await park(stub, "released", chunks, total=1)
            client = KVConsumer(server.target)
            ka = client.keep_alive(["kept", "released"])  # interval: a third of the lease
            assert ka.running  # running when returned: there is no unstarted state
            try:
                await in_thread(client.release, "released")
                await wait_until(lambda: "released" in ka.ended, what="the ended id to drop")
                assert ka.ended["released"] is Reason.RELEASED and ka.ids == ["kept"]
                await wait_until(lambda: _older_than(stub, "kept", 2 * LEASE_S), what="2 leases")
                ka.add("late-arrival")
                await wait_until(lambda: "late-arrival" in ka.last_states, what="new id")
                # Not parked yet: the producer records the intent.
                assert ka.last_states["late-arrival"].state is State.UNKNOWN
                assert ka.last_states["late-arrival"].lease_remaining_s > 0
                ka.discard("late-arrival")
            finally:
                await in_thread(ka.stop)
            assert not ka.running
            assert not any(t.name == "kvpark-keepalive" for t in threading.enumerate())
            result = await in_thread(client.load, "kept", num_chunks=1)
            assert result.ok
            client.close()


async def test_keep_alive_survives_an_unreachable_producer_and_stops_on_close() -> None:
    from conftest import free_port

    client = AsyncKVConsumer(f"127.0.0.1:{free_port()}")
    ka = client.keep_alive(["x"], interval_s=0.05)  # no block: only the close stops it
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "kvpark-keepalive"]
    try:
        await wait_until(lambda: ka.statistics().errors >= 2, what="failed rounds")
        assert ka.last_error is not None  # kept, logged, never raised
        assert ka.running  # failed rounds do not end the loop
        # Closed between rounds: the poll that saw the second error comes before the loop's
        # 0.05 s wait ends, so its next round meets the closed client and returns.
        await client.aclose()
        await wait_until(lambda: not ka.running, what="the loop to stop on close")
        assert not task.cancelled() and task.exception() is None  # returned, did not crash
    finally:
        await ka.stop()
        await client.aclose()
    with pytest.raises(ClientClosedError):
        client.keep_alive(["x"])
    with pytest.raises(UsageError):
        AsyncKVConsumer("h:1").keep_alive(["bad\nid"])
    with pytest.raises(UsageError):
        AsyncKVConsumer("h:1").keep_alive(["x"], interval_s=0)


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_closing_the_client_ends_its_keep_alives_at_once(flavour: str) -> None:
    """A keep-alive started with no ids yet (the decode queue still empty) and a long
    interval makes no call that could find its client closed: the close itself ends it, well
    before its next round (an hour away)."""
    async with running_producer() as server:
        if flavour == "sync":

            def run() -> tuple[bool, bool]:
                client = KVConsumer(server.target)
                ka = client.keep_alive(interval_s=3600)
                threads = [t for t in threading.enumerate() if t.name == "kvpark-keepalive"]
                client.close()
                threads[0].join(timeout=10)
                return ka.running, threads[0].is_alive()

            running, alive = await in_thread(run)
            assert not running and not alive
        else:
            client = AsyncKVConsumer(server.target)
            ka = client.keep_alive(interval_s=3600)
            (task,) = [t for t in asyncio.all_tasks() if t.get_name() == "kvpark-keepalive"]
            await client.aclose()
            await asyncio.wait_for(task, timeout=10)
            assert not ka.running and task.exception() is None


def test_a_close_while_a_keep_alive_starts_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() on another thread between keep_alive()'s check that the client is open and its
    record of the new keep-alive: the keep-alive is stopped and keep_alive() raises, rather
    than leaving a thread that runs for good."""
    started: list[KeepAlive] = []

    class ClosedWhileStarting(KeepAlive):
        def __init__(self, client: KVConsumer, *args: Any, **kwargs: Any) -> None:
            super().__init__(client, *args, **kwargs)
            started.append(self)
            client.close()  # the close that lands in the window

    monkeypatch.setattr(sync_client, "KeepAlive", ClosedWhileStarting)
    client = KVConsumer("127.0.0.1:1")
    with pytest.raises(ClientClosedError):
        client.keep_alive(interval_s=3600)
    assert not started[0].running


async def test_an_async_load_after_aclose_raises_client_closed_as_every_call_does() -> None:
    async with running_producer() as server:
        client = AsyncKVConsumer(server.target)
        await client.aclose()
        with pytest.raises(ClientClosedError):
            await client.load("x", num_chunks=1)
        with pytest.raises(ClientClosedError):
            await client.load_or_recompute("x", num_chunks=1, recompute=lambda first: None)
