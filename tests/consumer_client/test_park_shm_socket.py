"""A parker whose `shm_socket` is another producer's (a second producer on the host, here a
real one) never lends to it: it checks the socket's epoch against its producer's before its
first lend, a staging lend included, and before it uses a connection or a lend made while it
did not know that epoch yet. Its parks go over the gRPC stream in one call each, and the
other process is left with no connection and no lend."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, KVParker


def blocks(n: int) -> list[np.ndarray]:
    return [np.full(MiB, i, np.uint8) for i in range(n)]


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_staged_park_never_lends_to_another_producers_socket(
    flavour: str, shm_socket: str
) -> None:
    other = shm_socket + ".other"
    async with (
        running_producer(shm_socket=shm_socket) as server,
        running_producer(shm_socket=other) as stranger,
    ):
        if flavour == "sync":

            def run() -> list[Any]:
                with KVParker(server.target, shm_socket=other, timeout=10) as parker:
                    return [parker.park(f"p{i}", blocks(2)) for i in range(3)]

            results = await in_thread(run)
        else:
            async with AsyncKVParker(server.target, shm_socket=other, timeout=10) as parker:
                results = [await parker.park(f"p{i}", blocks(2)) for i in range(3)]
        assert stranger.shm is not None
        await wait_until(lambda: stranger.shm.connection_count == 0, what="no connection left")
        assert stranger.shm.lend_count == 0
        server.lot.check_invariants()
    for result in results:
        assert result.ok and result.transport == "grpc", result
        assert result.attempts == 1, result  # no Park naming the other process's lend


async def test_a_lend_made_before_the_epoch_was_known_is_not_used_once_it_is(
    shm_socket: str,
) -> None:
    """A connection and a lend made while the producer's epoch was unknown (as a consumer's
    first load makes them) are checked once it is known: the connection is closed, ending
    the lend, and the park goes over the gRPC stream in one call."""
    other = shm_socket + ".other"
    async with (
        running_producer(shm_socket=shm_socket) as server,
        running_producer(shm_socket=other) as stranger,
    ):

        def run() -> tuple[Any, Any]:
            with KVParker(server.target, shm_socket=other, timeout=10) as parker:
                kv = parker.shared_buffer(2 * MiB)
                kv[:] = 5
                assert parker.info is None
                assert parker._core.shm.lend_of(kv) is not None  # lent, unchecked
                parker.server_info()
                result = parker.park("shared", [kv[:MiB], kv[MiB:]])
                return result, parker._core.shm.lend_of(kv)

        result, lent_after = await in_thread(run)
        assert stranger.shm is not None
        await wait_until(lambda: stranger.shm.connection_count == 0, what="no connection left")
        assert stranger.shm.lend_count == 0
        server.lot.check_invariants()
    assert result.ok and result.transport == "grpc", result
    assert result.attempts == 1, result
    assert lent_after is None  # shared memory is left out for a while, not tried again
