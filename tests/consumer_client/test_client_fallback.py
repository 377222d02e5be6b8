"""`load_or_recompute`: the engine recomputes exactly what is missing, and the report says which
path was taken and why (remote, partial, recompute), sync and async."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import park, running_producer, stub_for
from consumer_support import in_thread, joined, payload

from kvpark.client import (
    AsyncKVConsumer,
    KVConsumer,
    LoadFailedError,
    LoadPath,
    Reason,
    Timeout,
    UsageError,
)


async def test_remote_path_does_not_recompute() -> None:
    async with running_producer() as server, stub_for(server) as stub:
        chunks = payload(3, 1000)
        await park(stub, "hit", chunks, total=3)
        calls: list[int] = []
        async with AsyncKVConsumer(server.target) as client:
            report = await client.load_or_recompute(
                "hit", num_chunks=3, recompute=calls.append, into=np.zeros(4000, np.uint8)
            )
        assert report.path is LoadPath.REMOTE and report.reason is None
        assert report.recomputed_from is None and calls == []
        assert report.result.data.tobytes() == joined(chunks)


async def test_partial_path_recomputes_from_the_first_missing_chunk() -> None:
    async with running_producer(max_fetch_wait_s=0.3) as server, stub_for(server) as stub:
        chunks = payload(4, 1000)
        await park(stub, "half", {0: chunks[0], 1: chunks[1]}, total=4)

        async def recompute(first: int) -> str:  # an async engine hook is awaited
            return f"prefill from {first}"

        async with AsyncKVConsumer(server.target) as client:
            report = await client.load_or_recompute("half", num_chunks=4, recompute=recompute)
        assert report.path is LoadPath.PARTIAL and report.reason is Reason.WAIT_TIMEOUT
        assert report.recomputed_from == 2 and report.recompute_value == "prefill from 2"
        assert report.result.chunks_loaded == 2


async def test_recompute_path_for_a_miss_and_the_fail_policy() -> None:
    async with running_producer() as server:

        def run() -> tuple[object, object]:
            calls: list[int] = []
            with KVConsumer(server.target, timeout=Timeout(5, first_chunk_s=0.2)) as client:
                report = client.load_or_recompute(
                    "missing", chunk_ids=[3, 4], recompute=lambda k: calls.append(k) or k
                )
                failing = lambda k: calls.append(-k)  # noqa: E731 - must never be called
                with pytest.raises(LoadFailedError) as err:
                    client.load_or_recompute(
                        "missing", num_chunks=1, policy="fail", recompute=failing
                    )
            return (report, calls), err.value

        (report, calls), error = await in_thread(run)
        assert report.path is LoadPath.RECOMPUTE  # type: ignore[attr-defined]
        assert report.reason is Reason.TIMEOUT  # type: ignore[attr-defined]
        # The fail policy recomputed nothing: `calls` holds only the recompute policy's call.
        assert report.recomputed_from == 3 and calls == [3]  # type: ignore[attr-defined]
        assert report.recompute_value == 3  # type: ignore[attr-defined]
        assert error.result.reason is Reason.TIMEOUT  # type: ignore[attr-defined]
        assert "TIMEOUT" in str(error)


async def test_the_policy_is_checked_before_loading() -> None:
    async with AsyncKVConsumer("127.0.0.1:1") as client:
        with pytest.raises(UsageError):
            await client.load_or_recompute("x", policy="retry")  # type: ignore[arg-type]
        with pytest.raises(UsageError):
            await client.load_or_recompute("x", recompute=None)
