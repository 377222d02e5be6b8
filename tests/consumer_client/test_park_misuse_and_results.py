"""What a parker says about its own misuse and its own attempts, against a real producer:
a batch with no chunk put is refused as `park()` with no chunk is (UsageError, nothing kept,
sync and async); a chunk that is not a buffer is refused in words that fit a park, which
reads its chunks (bytes will do); a park or batch that went over shared memory and timed out
says so in its result's `transport`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, state_of, stub_for, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, KVConsumer, KVParker, Reason, UsageError
from kvpark.pb import kvpark_pb2 as pb


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_batch_with_no_chunk_put_is_refused_as_a_park_of_no_chunks(flavour: str) -> None:
    async with running_producer() as server, stub_for(server) as stub:
        if flavour == "sync":

            def run() -> None:
                with KVParker(server.target, timeout=10) as parker:
                    with pytest.raises(UsageError, match="chunks: empty"):
                        parker.park("empty", [])
                    with pytest.raises(UsageError, match="no chunk put"):
                        with parker.batch("empty", batch_bytes=MiB):
                            pass

            await in_thread(run)
        else:
            async with AsyncKVParker(server.target, timeout=10) as parker:
                with pytest.raises(UsageError, match="chunks: empty"):
                    await parker.park("empty", [])
                with pytest.raises(UsageError, match="no chunk put"):
                    async with parker.batch("empty", batch_bytes=MiB):
                        pass
        assert (await state_of(stub, "empty")).state == pb.STATE_UNKNOWN
        # The pool reserved for the batch's header is free again: the call was undone.
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="undone")
        server.lot.check_invariants()


def test_a_chunk_that_is_not_a_buffer_is_refused_in_words_that_fit_a_park() -> None:
    with KVParker("127.0.0.1:1") as parker:  # refused before anything is sent
        for chunk in ("text", 7, [1, 2, 3]):
            with pytest.raises(UsageError, match=r"expected a buffer \(.*bytes") as refused:
                parker.park("x", [chunk])
            assert "writable" not in str(refused.value)
    with KVConsumer("127.0.0.1:1") as consumer:  # a load writes into its buffer
        with pytest.raises(UsageError, match="expected a writable buffer"):
            consumer.load("x", into="text")


@pytest.mark.parametrize("how", ["staged park", "batch by reference"])
async def test_a_park_over_shared_memory_that_timed_out_names_it_as_its_transport(
    how: str, shm_socket: str
) -> None:
    data = [np.full(MiB, i, np.uint8) for i in range(2)]
    async with running_producer(shm_socket=shm_socket) as server:
        parker = KVParker(server.target, shm_socket=shm_socket, timeout=10)
        kv = parker.shared_buffer(2 * MiB)

        def batch(kid: str, timeout: float) -> Any:
            with parker.batch(kid, total_chunks=2, timeout=timeout) as streamed:
                streamed.put(0, kv[:MiB])
                streamed.put(1, kv[MiB:])
            return streamed.result

        def attempt(kid: str, timeout: float) -> Any:
            if how == "staged park":
                return parker.park(kid, data, timeout=timeout)
            return batch(kid, timeout)

        try:
            # Lends the buffer (staging, or the shared one): no shm socket request after this.
            warm = await in_thread(attempt, "warm", 10)
            assert warm.ok and warm.transport == "shm", warm
            # Made on the event loop that runs the in-process producer, so it cannot answer.
            late = attempt("late", 0.3)
        finally:
            parker.close()
    assert late.reason is Reason.TIMEOUT, late
    assert late.transport == "shm", late
