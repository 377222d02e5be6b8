"""A client that cannot use shared memory makes no staging buffer. Over "auto", loads into and
parks of ordinary memory would copy through a lent staging buffer when the producer's shm
socket works; where the producer offers none, or the client's socket is not there, they go
over the gRPC stream without allocating (and keeping) a buffer the size of the load."""

from __future__ import annotations

import contextlib
import gc
import os

import numpy as np
import pytest
from conftest import MiB, running_producer
from consumer_support import in_thread

from kvpark import KVConsumer, KVParker

SIZE = 8 * MiB


def staging_buffers() -> int:
    """The staging buffers this process holds (their memfds' names)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sum("kvpark-staging" in name for name in names)


@pytest.mark.parametrize("socket", ["none offered", "not there"])
async def test_no_staging_buffer_where_shared_memory_cannot_be_used(
    socket: str, shm_socket: str
) -> None:
    client_socket = shm_socket if socket == "not there" else None
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    async with running_producer() as server:  # no shm socket of its own

        def park_and_load() -> None:
            # An earlier test's client, unreachable but not yet collected, may still hold a
            # staging buffer that would close mid-count.
            gc.collect()
            before = staging_buffers()
            with (
                KVParker(server.target, shm_socket=client_socket) as parker,
                KVConsumer(server.target, shm_socket=client_socket) as consumer,
            ):
                parked = parker.park("kv", [data[: SIZE // 2], data[SIZE // 2 :]])
                assert parked.ok and parked.transport == "grpc", parked
                into = np.zeros_like(data)
                loaded = consumer.load("kv", num_chunks=2, into=into)
                assert loaded.ok and loaded.transport == "grpc", loaded
                assert np.array_equal(into, data)
                assert staging_buffers() == before, "a staging buffer was made for nothing"

        await in_thread(park_and_load)
