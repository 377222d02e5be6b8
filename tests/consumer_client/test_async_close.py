"""Closing an asyncio client while it works, against real producers: a load reading its data
connection from a producer that stopped answering ends CANCELLED at once (the connection is
the client's own, so closing the channel alone would leave it to the load's timeout); an
aclose cancelled while it waits for confirmations still closes the client; and loads racing
aclose end as loads or calls of a closed client do, with a LoadResult or ClientClosedError.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, ProducerProcess, running_producer, wait_until
from consumer_support import park_sync

from kvpark import AsyncKVConsumer, AsyncKVParker, ClientClosedError, LoadResult, Reason

# Far longer than any bound below: a load that ends sooner ended for the reason under test.
LOAD_TIMEOUT_S = 60.0
# A generous bound on what should happen at once.
PROMPTLY_S = 10.0


@pytest.mark.parametrize("timeout", [LOAD_TIMEOUT_S, None], ids=["bounded", "unbounded"])
@pytest.mark.filterwarnings("ignore::kvpark.client.TimeoutConfigWarning")
async def test_aclose_ends_a_load_reading_a_silent_data_connection_at_once(
    producer_process: Callable[..., ProducerProcess], timeout: float | None
) -> None:
    """Chunk 0 of 2 is parked: the load reads it over TCP and waits on its data connection
    for chunk 1. The producer then stops (SIGSTOP: its sockets stay open, nothing answers),
    and aclose must end the load CANCELLED, not leave it reading until its timeout."""
    producer = producer_process(data_listen="127.0.0.1:0")
    park_sync(producer.target, "half", {0: bytes(MiB)}, total=2)
    consumer = AsyncKVConsumer(producer.target, transport="tcp", timeout=timeout)
    first_landed = threading.Event()
    loading = asyncio.create_task(
        consumer.load("half", num_chunks=2, on_chunk=lambda *_: first_landed.set())
    )
    await wait_until(first_landed.is_set, what="chunk 0 over the data connection")
    os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        await consumer.aclose()
        result = await asyncio.wait_for(loading, PROMPTLY_S)
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
    assert result.reason is Reason.CANCELLED, result
    assert result.transport == "tcp" and result.chunks_loaded == 1, result


class _HeldReleases(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Holds every Release call (a delivery's confirmation) until it is cancelled."""

    def __init__(self) -> None:
        self.held = 0

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.endswith("/Release"):
            self.held += 1
            await asyncio.Event().wait()
        return await continuation(details, request)


async def test_an_aclose_cancelled_while_confirmations_are_flushed_still_closes() -> None:
    held = _HeldReleases()
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("kept", [np.ones(1024, np.uint8)])).ok
            assert (await parker.park("leased", [np.ones(1024, np.uint8)])).ok
        consumer = AsyncKVConsumer(server.target, interceptors=[held])
        keep_alive = consumer.keep_alive(["leased"], interval_s=0.1)
        assert (await consumer.load("kept", num_chunks=1)).ok
        await wait_until(lambda: held.held == 1, what="the confirmation to be under way")
        closing = asyncio.create_task(consumer.aclose())
        await asyncio.sleep(0)  # aclose runs up to its wait for the held confirmation
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert consumer.closed
        assert not keep_alive.running
        with pytest.raises(ClientClosedError):
            await consumer.lookup(["leased"])


def _outlived(round_: int, transport: str, shared: bool, pending: set[Any]) -> str:
    """What to know about loads that outlived aclose: the round, and where each one waits."""
    stacks = []
    for task in pending:
        awaiting, frames = task.get_coro(), []
        while awaiting is not None:  # the chain of awaits, outermost first
            frame = getattr(awaiting, "cr_frame", None)
            if frame is not None:
                frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
            awaiting = getattr(awaiting, "cr_await", None)
        stacks.append(" -> ".join(frames) or repr(task))
    where = "\n  ".join(stacks)
    return f"round {round_} ({transport}, shared buffer {shared}): outlived aclose at\n  {where}"


async def test_loads_racing_aclose_end_as_loads_or_calls_of_a_closed_client(
    shm_socket: str,
) -> None:
    """Clients of every transport close while eight loads each are at every stage (starting,
    lending, on their data connections, falling back). Each load returns a LoadResult or
    raises ClientClosedError; nothing else, and none outlives the close."""
    chunk = np.random.default_rng(7).integers(0, 256, MiB, dtype=np.uint8)
    async with running_producer(
        data_listen="127.0.0.1:0", shm_socket=shm_socket, pool_bytes=64 * MiB
    ) as server:
        async with AsyncKVParker(server.target, transport="grpc") as parker:
            for i in range(8):
                assert (await parker.park(f"k{i}", [chunk] * 4)).ok
        outcomes: list[object] = []
        for round_ in range(48):
            transport = ("grpc", "tcp", "shm", "auto")[round_ % 4]
            consumer = AsyncKVConsumer(
                server.target, transport=transport, confirm=False, shm_socket=shm_socket
            )
            shared = consumer.shared_buffer(32 * MiB) if round_ % 8 >= 4 else None

            async def load(i: int, consumer: Any = consumer, shared: Any = shared) -> Any:
                part = slice(i * 4 * MiB, (i + 1) * 4 * MiB)
                into = np.empty(4 * MiB, np.uint8) if shared is None else shared[part]
                return await consumer.load(f"k{i}", num_chunks=4, into=into)

            loads = [asyncio.create_task(load(i)) for i in range(8)]
            for _ in range(round_ * 8):  # a later point of the loads each round
                await asyncio.sleep(0)
            await consumer.aclose()
            _, pending = await asyncio.wait(loads, timeout=PROMPTLY_S)
            assert not pending, _outlived(round_, transport, shared is not None, pending)
            outcomes += [t.exception() or t.result() for t in loads]
    unexpected = [o for o in outcomes if not isinstance(o, LoadResult | ClientClosedError)]
    assert not unexpected, unexpected
