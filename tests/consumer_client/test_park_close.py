"""A parker closed while one of its streaming batches is open, against a real producer: the
batch ends as a `park()` does when its parker closes, with ClientClosedError at the commit
(the `with` block's exit), not with a result that reads like the producer's answer; and the
async batch never with a bare CancelledError, which made a prefill task look cancelled
though nobody cancelled it. The producer keeps nothing of the batch either way."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, state_of, stub_for, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, ClientClosedError, KVParker
from kvpark.pb import kvpark_pb2 as pb


def source(parker: Any, shared: bool) -> np.ndarray:
    """Two chunks' worth of KV: in one of the parker's shared buffers (by reference) or not."""
    kv = parker.shared_buffer(2 * MiB) if shared else np.empty(2 * MiB, np.uint8)
    kv[:] = 9
    return kv


async def nothing_kept(server: Any, kid: str) -> None:
    async with stub_for(server) as stub:
        assert (await state_of(stub, kid)).state == pb.STATE_UNKNOWN
    await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="undone")
    server.lot.check_invariants()


@pytest.mark.parametrize("shared", [False, True], ids=["inline", "by-reference"])
async def test_a_batch_whose_parker_closed_raises_client_closed_at_its_commit(
    shared: bool, shm_socket: str
) -> None:
    async with running_producer(shm_socket=shm_socket) as server:

        def run() -> Any:
            parker = KVParker(server.target, shm_socket=shm_socket, timeout=10)
            kv = source(parker, shared)
            with pytest.raises(ClientClosedError):
                with parker.batch("closed", total_chunks=2) as batch:
                    assert batch.put(0, kv[:MiB])
                    parker.close()
                    assert not batch.put(1, kv[MiB:])  # the call ended with the channel
            return batch.result

        assert await in_thread(run) is None
        await nothing_kept(server, "closed")


@pytest.mark.parametrize("shared", [False, True], ids=["inline", "by-reference"])
async def test_an_async_batch_whose_parker_closed_raises_client_closed_not_cancelled(
    shared: bool, shm_socket: str
) -> None:
    async with running_producer(shm_socket=shm_socket) as server:
        parker = AsyncKVParker(server.target, shm_socket=shm_socket, timeout=10)
        kv = source(parker, shared)
        first_put, closed = asyncio.Event(), asyncio.Event()

        async def prefill() -> Any:
            async with parker.batch("closed", total_chunks=2) as batch:
                assert await batch.put(0, kv[:MiB])
                first_put.set()
                await closed.wait()  # the engine computes the next layer; the worker stops
                assert not await batch.put(1, kv[MiB:])
            return batch.result

        task = asyncio.create_task(prefill())
        await first_put.wait()
        await parker.aclose()
        closed.set()
        with pytest.raises(ClientClosedError):
            await task
        assert not task.cancelled()
        await nothing_kept(server, "closed")


async def test_an_empty_batch_of_a_closed_parker_raises_client_closed() -> None:
    """A batch nothing was put in is a UsageError, unless its parker closed meanwhile: then,
    as every call of a closed client, ClientClosedError."""
    async with running_producer() as server:

        def run() -> None:
            parker = KVParker(server.target, transport="grpc")
            with pytest.raises(ClientClosedError), parker.batch("empty", total_chunks=1):
                parker.close()

        await in_thread(run)
        parker = AsyncKVParker(server.target, transport="grpc")
        with pytest.raises(ClientClosedError):
            async with parker.batch("empty", total_chunks=1):
                await parker.aclose()
        await nothing_kept(server, "empty")
