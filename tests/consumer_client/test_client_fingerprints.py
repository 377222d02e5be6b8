"""Fingerprints through the clients: a prefill worker parks its KV with the fingerprint of what
it computed it from (`kvpark.fingerprint`), over the gRPC stream or shared memory, in one call
or a batch; a decode worker that loads with another gets FINGERPRINT_MISMATCH on every
transport, with nothing written into its buffer and the id kept, and `load_or_recompute`
recomputes everything; with the same one, or none, it loads. Real producer."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer

from kvpark import (
    AsyncKVConsumer,
    ConsumerPool,
    KVConsumer,
    KVParker,
    LoadPath,
    Reason,
    State,
    UsageError,
    fingerprint,
)

OURS = fingerprint("model-a", range(300))
THEIRS = fingerprint("model-a", range(301))
SETTINGS: dict[str, Any] = {"data_listen": "127.0.0.1:0", "advertise_address": ""}
DATA = [np.full(MiB, i + 1, np.uint8) for i in range(3)]


@pytest.fixture
def shm_socket() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="kvpark-")
    yield os.path.join(directory, "shm.sock")
    shutil.rmtree(directory, ignore_errors=True)


def into_for(consumer: KVConsumer, transport: str) -> Any:
    if transport == "shm":
        return consumer.shared_buffer(3 * MiB)
    return np.zeros(3 * MiB, np.uint8)


@pytest.mark.parametrize("parked_by", ["grpc", "shm", "batch"])
@pytest.mark.parametrize("transport", ["grpc", "tcp", "shm"])
async def test_a_load_with_another_fingerprint_gets_nothing_and_the_id_stays(
    transport: str, parked_by: str, shm_socket: str
) -> None:
    async with running_producer(**SETTINGS, shm_socket=shm_socket) as server:

        def run() -> tuple[Any, ...]:
            with (
                KVParker(server.target, transport="grpc" if parked_by == "grpc" else "auto") as p,
                KVConsumer(server.target, transport=transport) as consumer,
            ):
                if parked_by == "batch":
                    with p.batch("kv", fingerprint=OURS) as batch:
                        for i, chunk in enumerate(DATA):
                            batch.put(i, chunk)
                    parked = batch.result
                else:
                    parked = p.park("kv", DATA, fingerprint=OURS)
                assert parked.ok, parked
                into = into_for(consumer, transport)
                wrong = consumer.load("kv", num_chunks=3, into=into, fingerprint=THEIRS)
                untouched = not np.asarray(into).any()
                state = consumer.lookup(["kv"])[0].state
                recomputed: list[int] = []
                report = consumer.load_or_recompute(
                    "kv", num_chunks=3, into=into, fingerprint=THEIRS, recompute=recomputed.append
                )
                right = consumer.load("kv", num_chunks=3, into=into, fingerprint=OURS)
                landed = bytes(np.asarray(into)[: 3 * MiB])
                return wrong, untouched, state, recomputed, report, right, landed

        wrong, untouched, state, recomputed, report, right, landed = await asyncio.to_thread(run)
        server.lot.check_invariants()
    assert wrong.reason is Reason.FINGERPRINT_MISMATCH and not wrong.ok, wrong
    assert wrong.path is LoadPath.RECOMPUTE and wrong.chunks_loaded == 0
    assert "fingerprint mismatch" in wrong.detail
    assert untouched and state is State.PARKED
    assert recomputed == [0] and report.path is LoadPath.RECOMPUTE
    assert right.ok and right.transport == transport, right
    assert landed == b"".join(d.tobytes() for d in DATA)


async def test_async_and_pooled_loads_check_the_fingerprint_too() -> None:
    async with running_producer(**SETTINGS) as server:
        with KVParker(server.target) as parker:
            parked = await asyncio.to_thread(parker.park, "kv", DATA, fingerprint=OURS)
        async with AsyncKVConsumer(server.target) as consumer:
            wrong = await consumer.load("kv", num_chunks=3, fingerprint=THEIRS)
        assert wrong.reason is Reason.FINGERPRINT_MISMATCH, wrong

        def pooled() -> Any:
            with ConsumerPool() as pool:
                return pool.load(parked.handle, fingerprint=THEIRS), pool.load(
                    parked.handle, fingerprint=OURS
                )

        wrong, right = await asyncio.to_thread(pooled)
        server.lot.check_invariants()
    assert wrong.reason is Reason.FINGERPRINT_MISMATCH, wrong
    assert right.ok, right


@pytest.mark.parametrize("bad", ["text", b"x" * 65, 12])
async def test_a_fingerprint_that_is_not_at_most_64_bytes_is_misuse(bad: Any) -> None:
    async with running_producer() as server:

        def run() -> None:
            with KVParker(server.target) as parker, KVConsumer(server.target) as consumer:
                with pytest.raises(UsageError, match="fingerprint"):
                    parker.park("kv", DATA, fingerprint=bad)
                with pytest.raises(UsageError, match="fingerprint"):
                    parker.batch("kv", fingerprint=bad)
                with pytest.raises(UsageError, match="fingerprint"):
                    consumer.load("kv", num_chunks=1, fingerprint=bad)
                assert consumer.lookup(["kv"])[0].state is State.UNKNOWN

        await asyncio.to_thread(run)
