"""`max_concurrent_rpcs` bounds the kvpark calls only: when legitimate calls hold every slot
(Fetches waiting for ids nobody parked yet), the health probe still answers SERVING, so a
liveness probe never restarts a busy producer, and the kvpark call beyond the limit is refused
RESOURCE_EXHAUSTED naming the key. A call gives its slot back however it ends."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from conftest import running_producer, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from h2_headers import HeadersOnlyClient

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer import healthcheck
from kvpark.producer.open_streams import OPEN_STREAMS
from kvpark.producer.server import ProducerServer

LIMIT = 3  # max_concurrent_rpcs
WAIT_S = 60.0  # how long the slot-holding Fetches would wait for their chunks
# Far more than max_concurrent_rpcs and the slots grpc keeps beyond it for health and
# reflection (open_streams.RESERVED_SLOTS, 48) together.
SILENT_CALLS = 100
FETCH_TOKEN = "fetch-secret-0d4e71"
PARK_TOKEN = "park-secret-b38a5c"
SETTINGS: dict[str, Any] = {"max_concurrent_rpcs": LIMIT, "max_fetch_wait_s": WAIT_S}
TOKENS: dict[str, Any] = {"park_token": PARK_TOKEN, "fetch_token": FETCH_TOKEN}


def probe_cli(target: str) -> subprocess.CompletedProcess[str]:
    """The liveness probe of deploy/kubernetes, as a container runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPARK_")}
    return subprocess.run(
        [sys.executable, "-m", "kvpark.producer.healthcheck", "--target", target],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


async def refused_code(call: Any) -> grpc.StatusCode:
    """The status a kvpark call beyond the limit ends with; its message must name the key."""
    try:
        if isinstance(call, grpc.aio.UnaryStreamCall):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "max_concurrent_rpcs" in (err.details() or ""), err.details()
        return err.code()
    return grpc.StatusCode.OK


@asynccontextmanager
async def every_slot_held(
    server: ProducerServer,
    stub: pb_grpc.KVProducerStub,
    metadata: tuple[tuple[str, str], ...] = (),
    **call: Any,
) -> AsyncIterator[list[Any]]:
    """LIMIT Fetches of ids nobody parked, each waiting for its chunks (bound by the lot), and
    none refused; `call` are the calls' own options (a deadline). Cancelled on the way out
    unless they ended."""
    fetches = [
        stub.Fetch(
            pb.FetchRequest(kv_request_id=f"waiting-{i}", wait_timeout_s=WAIT_S),
            metadata=metadata,
            **call,
        )
        for i in range(LIMIT)
    ]
    try:
        await wait_until(
            lambda: server.lot.bound_count == LIMIT or any(f.done() for f in fetches),
            what="every Fetch waiting for its id",
        )
        ended = [await refused_code(f) for f in fetches if f.done()]
        assert not ended, f"a Fetch holding a slot ended: {ended}"
        yield fetches
    finally:
        for f in fetches:
            f.cancel()


async def assert_busy_but_healthy(
    server: ProducerServer,
    stub: pb_grpc.KVProducerStub,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """With every kvpark slot held: the probe says SERVING, a kvpark call of each shape is
    refused RESOURCE_EXHAUSTED, and the waiting Fetches are untouched."""
    ok, message = await asyncio.to_thread(healthcheck.check, server.target, 10.0)
    assert ok, message
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=metadata, timeout=10)
    assert await refused_code(info) == grpc.StatusCode.RESOURCE_EXHAUSTED
    extra = stub.Fetch(pb.FetchRequest(kv_request_id="one-more"), metadata=metadata, timeout=10)
    assert await refused_code(extra) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert server.lot.bound_count == LIMIT


@pytest.mark.parametrize("tokens", [False, True], ids=["open", "tokens"])
async def test_waiting_fetches_on_every_slot_leave_the_health_probe_serving(tokens: bool) -> None:
    """The deployment's liveness probe (the health CLI) exits 0 while waiting Fetches hold
    every kvpark slot; the next kvpark call is refused; once the Fetches end, kvpark calls are
    served again, every slot of them."""
    metadata = (("authorization", f"Bearer {FETCH_TOKEN}"),) if tokens else ()
    async with running_producer(**SETTINGS, **(TOKENS if tokens else {})) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            async with every_slot_held(server, stub, metadata):
                result = await asyncio.to_thread(probe_cli, server.target)
                assert result.returncode == 0, result.stdout + result.stderr
                assert "SERVING" in result.stdout
                await assert_busy_but_healthy(server, stub, metadata)
            await wait_until(lambda: server.lot.bound_count == 0, what="the Fetches ended")
            async with every_slot_held(server, stub, metadata):
                await assert_busy_but_healthy(server, stub, metadata)


async def _cancelled(fetches: list[Any]) -> None:
    for f in fetches:
        f.cancel()


async def _past_their_deadline(fetches: list[Any]) -> None:
    for f in fetches:
        assert await refused_code(f) == grpc.StatusCode.DEADLINE_EXCEEDED


ENDINGS: dict[str, tuple[dict[str, Any], Callable[[list[Any]], Any]]] = {
    "cancel": ({}, _cancelled),
    # Long enough to see every slot held (the test waits for that, not for the deadline).
    "deadline": ({"timeout": 2.0}, _past_their_deadline),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_call_gives_its_slot_back_when_cancelled_or_past_its_deadline(
    ending: str,
) -> None:
    options, end = ENDINGS[ending]
    async with running_producer(**SETTINGS) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            for _ in range(2):  # the second round only has slots if the first gave them back
                async with every_slot_held(server, stub, **options) as fetches:
                    await assert_busy_but_healthy(server, stub)
                    await end(fetches)
                await wait_until(lambda: server.lot.bound_count == 0, what="the Fetches ended")
            async with every_slot_held(server, stub):
                await assert_busy_but_healthy(server, stub)


async def test_calls_that_end_in_an_error_or_normally_give_their_slot_back() -> None:
    """More calls than there are slots, one after another, ending INVALID_ARGUMENT, refused by
    the lot in-band, or served: each left its slot, so every slot can be held afterwards."""
    async with running_producer(**SETTINGS) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            for _ in range(LIMIT + 1):
                bad = stub.Lookup(pb.LookupRequest(kv_request_ids=[""]), timeout=10)
                assert await refused_code(bad) == grpc.StatusCode.INVALID_ARGUMENT
                bad_fetch = stub.Fetch(pb.FetchRequest(kv_request_id=""), timeout=10)
                assert await refused_code(bad_fetch) == grpc.StatusCode.INVALID_ARGUMENT
                short = stub.Fetch(
                    pb.FetchRequest(kv_request_id="gone", wait_timeout_s=0.01), timeout=10
                )
                [done] = [m async for m in short]
                assert done.done.status == pb.STATUS_FAILED
                await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            async with every_slot_held(server, stub):
                await assert_busy_but_healthy(server, stub)


async def test_calls_that_never_send_their_request_are_counted_and_leave_health_a_slot() -> None:
    """kvpark calls that send HEADERS and never their request hold a kvpark slot each (their
    handlers start at once), so beyond LIMIT they are refused at once rather than piling onto
    the slots health needs: the probe still answers SERVING."""
    async with running_producer(**SETTINGS) as server:
        host, port = server.target.rsplit(":", 1)
        raw = HeadersOnlyClient(host, int(port))
        try:
            streams = [
                raw.open_stream(
                    f"/kvpark.v1.KVProducer/{('Lookup', 'Fetch')[i % 2]}", server.target
                )
                for i in range(SILENT_CALLS)
            ]
            await wait_until(
                lambda: len(raw.ended & set(streams)) >= SILENT_CALLS - LIMIT or raw.closed,
                what="the silent calls beyond LIMIT refused",
            )
            assert not raw.closed
            ok, message = await asyncio.to_thread(healthcheck.check, server.target, 10.0)
            assert ok, message
        finally:
            raw.close()
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            # The closed connection's calls end as the server notices; then every slot is free.
            await wait_until(
                lambda: server.calls.running == 0, what="the silent calls' slots given back"
            )
            async with every_slot_held(server, stub):
                await assert_busy_but_healthy(server, stub)


async def test_open_streams_and_kvpark_calls_all_taken_leave_the_probe_a_slot() -> None:
    """Without tokens too, health Watch streams are bounded: with every kvpark slot held and
    more Watch streams asked for than may run, the ones beyond the bound are refused and a
    Check still answers SERVING."""
    async with running_producer(**SETTINGS) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.KVProducerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            async with every_slot_held(server, stub):
                watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(30)]
                try:
                    outcomes = []
                    for watch in watches:
                        try:
                            outcomes.append((await watch.read()).status)
                        except grpc.aio.AioRpcError as err:
                            outcomes.append(err.code())
                    serving = health_pb2.HealthCheckResponse.SERVING
                    assert outcomes.count(serving) == OPEN_STREAMS
                    refused = outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
                    assert refused == 30 - OPEN_STREAMS
                    await assert_busy_but_healthy(server, stub)
                finally:
                    for watch in watches:
                        watch.cancel()
