"""Closing an asyncio client while it works, against real producers: an aclose cancelled
while it waits for confirmations still closes the client.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import running_producer, wait_until

from kvpark import AsyncKVConsumer, AsyncKVParker, ClientClosedError


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
