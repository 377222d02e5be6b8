"""A streaming batch whose caller is cancelled (asyncio) or interrupted (threads) while its
commit queues the last frames, against a real producer: the call is cancelled and the batch
undone, so the producer holds none of its pages and does not commit it after the caller saw
the cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, state_of, stub_for, wait_until
from consumer_support import in_thread

from kvpark import AsyncKVParker, KVParker
from kvpark.pb import kvpark_pb2 as pb


def source(parker: Any, shared: bool) -> np.ndarray:
    """Two chunks' worth of KV: in one of the parker's shared buffers (by reference) or not."""
    kv = parker.shared_buffer(2 * MiB) if shared else np.empty(2 * MiB, np.uint8)
    kv[:] = 7
    return kv


async def nothing_kept(server: Any, kid: str) -> None:
    await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="the batch undone")
    async with stub_for(server) as stub:
        assert (await state_of(stub, kid)).state == pb.STATE_UNKNOWN
    server.lot.check_invariants()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before-the-commit", "after-the-commit"])
@pytest.mark.parametrize("shared", [False, True], ids=["inline", "by-reference"])
async def test_an_async_batch_cancelled_while_it_queues_its_commit_is_undone(
    when: str, shared: bool, shm_socket: str
) -> None:
    """The cancel lands as the commit frame is about to be queued (nothing would end the
    call), or right after it was queued and before the writer ran (it would commit the
    batch)."""
    async with running_producer(shm_socket=shm_socket) as server:
        async with AsyncKVParker(server.target, shm_socket=shm_socket, timeout=30) as parker:
            kv = source(parker, shared)
            batches: list[Any] = []

            async def prefill() -> None:
                async with parker.batch("kv", total_chunks=2) as batch:
                    batches.append(batch)
                    assert await batch.put(0, kv[:MiB])
                    assert await batch.put(1, kv[MiB:])
                    real_send = batch._frames.send

                    async def send(frame: Any) -> None:
                        is_commit = frame == batch._route.frames.commit()
                        if is_commit and when == "before-the-commit":
                            await cancelled_here()
                        await real_send(frame)
                        if is_commit and when == "after-the-commit":
                            await cancelled_here()  # the writer may run before this returns

                    batch._frames.send = send

            async def cancelled_here() -> None:
                task.cancel()
                await asyncio.sleep(0)  # raises the cancel, in the commit's own sends

            task = asyncio.create_task(prefill())
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_until(batches[0]._call.done, what="the batch's call ended")
            assert batches[0].result is None
            await nothing_kept(server, "kv")


@pytest.mark.timeout(60)
async def test_a_batch_interrupted_while_it_queues_its_commit_ends_its_call(
    shm_socket: str,
) -> None:
    async with running_producer(shm_socket=shm_socket) as server:
        parker = KVParker(server.target, transport="grpc", timeout=30)
        try:

            def run() -> Any:
                kv = source(parker, False)
                with pytest.raises(KeyboardInterrupt):
                    with parker.batch("kv", total_chunks=2) as batch:
                        assert batch.put(0, kv[:MiB])
                        assert batch.put(1, kv[MiB:])
                        real_send = batch._frames.send

                        def send(frame: Any) -> None:
                            if frame == batch._route.frames.commit():
                                raise KeyboardInterrupt
                            real_send(frame)

                        batch._frames.send = send  # type: ignore[method-assign]
                return batch

            batch = await in_thread(run)
            # Before the parker closes, which would end the call anyway.
            await wait_until(batch._future.done, what="the batch's call ended")
        finally:
            await in_thread(parker.close)
        await nothing_kept(server, "kv")
