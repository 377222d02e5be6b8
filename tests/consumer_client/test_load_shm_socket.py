"""A consumer whose `shm_socket` is another producer's (a second producer on the host, here a
real one) never lends to it, its first load included: a load that would copy through a lent
staging buffer over "shm" reads the producer's epoch first, and one over "auto" does not stage
before it knows that epoch; the socket's epoch does not match it. The load goes over another
path, and the other process never sees a connection or a lend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer
from consumer_support import in_thread

from kvpark import AsyncKVConsumer, KVConsumer, KVParker


@pytest.mark.parametrize("transport", ["auto", "shm"])
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_first_staged_load_never_lends_to_another_producers_socket(
    flavour: str, transport: str, shm_socket: str
) -> None:
    other = shm_socket + ".other"
    data = np.arange(2 * MiB, dtype=np.uint8)
    async with (
        running_producer(shm_socket=shm_socket) as server,
        running_producer(shm_socket=other) as stranger,
    ):

        def park() -> None:
            with KVParker(server.target, transport="grpc") as parker:
                assert parker.park("kv", [data[:MiB], data[MiB:]]).ok

        await in_thread(park)
        into = np.zeros_like(data)
        lending = stranger.shm
        assert lending is not None

        def untouched() -> bool:
            return (lending.connection_count, lending.lend_count) == (0, 0)

        if flavour == "sync":

            def load() -> tuple[Any, bool]:
                with KVConsumer(server.target, shm_socket=other, transport=transport) as consumer:
                    # Seen while the client is open: closing it would end what it made.
                    return consumer.load("kv", num_chunks=2, into=into, timeout=10), untouched()

            result, stranger_untouched = await in_thread(load)
        else:
            async with AsyncKVConsumer(server.target, shm_socket=other, transport=transport) as c:
                result = await c.load("kv", num_chunks=2, into=into, timeout=10)
                stranger_untouched = untouched()
        assert stranger_untouched
        server.lot.check_invariants()
    assert result.ok and result.transport != "shm", result
    assert np.array_equal(into, data)
