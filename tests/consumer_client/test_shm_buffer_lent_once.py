"""The bundled clients lend a shared buffer once, as the producer asks (it maps each memfd
once and refuses a second lend of one it maps): loads that lend one buffer at the same moment
share one lend, and a buffer another client lent already (a consumer loading into a parker's
buffer) is loaded through the staging buffer, shared memory still on. Real producer process."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from conftest import MiB, ProducerProcess

from kvpark import KVConsumer, KVParker

THREADS = 8


def chunk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, MiB, dtype=np.uint8)


def test_loads_lending_one_buffer_at_once_share_its_lend(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    with KVParker(producer.target, transport="grpc") as parker:
        for i in range(THREADS):
            assert parker.park(f"kv{i}", [chunk(i)]).ok
    with KVConsumer(producer.target, transport="shm", shm_socket=shm_socket) as consumer:
        into = consumer.shared_buffer(THREADS * MiB)
        start = threading.Barrier(THREADS)
        transports: list[str] = []

        def load(i: int) -> None:
            start.wait()
            result = consumer.load(f"kv{i}", num_chunks=1, into=into[i * MiB : (i + 1) * MiB])
            assert result.ok, result
            transports.append(result.transport)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert transports == ["shm"] * THREADS
    for i in range(THREADS):
        assert np.array_equal(into[i * MiB : (i + 1) * MiB], chunk(i))


def test_a_buffer_another_client_lent_is_loaded_into_through_the_staging_buffer(
    producer_process: Callable[..., ProducerProcess], shm_socket: str
) -> None:
    producer = producer_process(shm_socket=shm_socket)
    with (
        KVParker(producer.target, transport="shm", shm_socket=shm_socket) as parker,
        KVConsumer(producer.target, transport="shm", shm_socket=shm_socket) as consumer,
    ):
        kv = parker.shared_buffer(3 * MiB)
        kv[:MiB] = chunk(1)
        for kid in ("first", "second"):
            parked = parker.park(kid, [kv[:MiB]])
            assert parked.ok and parked.transport == "shm", parked
        # The parker's buffer is lent for Park; the consumer loads into the rest of it.
        for n, kid in enumerate(("first", "second"), start=1):
            into = kv[n * MiB : (n + 1) * MiB]
            loaded = consumer.load(kid, num_chunks=1, into=into)
            assert loaded.ok and loaded.transport == "shm", loaded
            assert np.array_equal(into, chunk(1))
