"""Idle heap trim: the policy (when) on a fake clock, and the effect (RSS comes back after a
burst) on a real producer process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import psutil
from conftest import MiB, ProducerProcess, channel_options, park_requests, wait_for

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.idle_trim import IdleHeapTrim


class _Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_trims_once_per_quiet_period_after_activity() -> None:
    clock = _Clock()
    policy = IdleHeapTrim(after_s=2.0, clock=clock)
    assert not policy.due((0,), busy=False)  # baseline
    clock.now += 10
    assert not policy.due((0,), busy=False)  # nothing ever moved: nothing to give back
    assert not policy.due((1,), busy=False)  # data moved
    clock.now += 1.9
    assert not policy.due((1,), busy=False)  # quiet, not long enough
    clock.now += 0.2
    assert policy.due((1,), busy=False)  # quiet for 2.1 s: trim
    clock.now += 30
    assert not policy.due((1,), busy=False)  # once per quiet period
    assert not policy.due((2,), busy=False)  # activity re-arms
    clock.now += 2.5
    assert policy.due((2,), busy=False)


def test_a_bound_fetch_keeps_it_from_trimming() -> None:
    clock = _Clock()
    policy = IdleHeapTrim(after_s=2.0, clock=clock)
    policy.due((0,), busy=False)
    assert not policy.due((1,), busy=False)
    for _ in range(10):
        clock.now += 1.0
        assert not policy.due((1,), busy=True)  # e.g. a Fetch waiting for chunks
    clock.now += 2.5
    assert policy.due((1,), busy=False)


def test_producer_hands_burst_heap_back_once_idle(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    """16 concurrent streams of 4 MiB chunks grow the producer's heap (gRPC's buffers for the
    messages in flight), which the tuned allocator keeps; once idle, the producer releases it."""
    producer = producer_process(pool_bytes=160 * MiB)
    process = psutil.Process(producer.proc.pid)
    chunk = 4 * MiB
    ids = [f"burst-{i}" for i in range(16)]

    async def burst() -> None:
        async with grpc.aio.insecure_channel(producer.target, options=channel_options()) as ch:
            stub = pb_grpc.KVProducerStub(ch)
            data = {c: bytes([c + 1]) * chunk for c in range(2)}
            for kid in ids:
                assert (await stub.Park(iter(park_requests(kid, data, total=2)))).status == 1

            async def fetch(kid: str) -> int:
                return len([m async for m in stub.Fetch(pb.FetchRequest(kv_request_id=kid))])

            assert await asyncio.gather(*(fetch(kid) for kid in ids)) == [3] * 16

    base = process.memory_info().rss
    asyncio.run(burst())
    grown = process.memory_info().rss
    assert grown - base > 24 * MiB, f"the burst grew RSS by only {(grown - base) / MiB:.0f} MiB"
    wait_for(  # at least half of what the burst grew is given back
        lambda: process.memory_info().rss < base + (grown - base) / 2,
        timeout=15,
        what="the idle producer to give its burst heap back",
    )
