"""/metrics over real HTTP reflects a park, a fetch, a reap and a late-fetch rejection; sent
bytes count what went out, not what was ready."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from conftest import (
    FakeClock,
    MiB,
    fetch_all,
    park,
    running_producer,
    state_of,
    stub_for,
    wait_until,
)
from prometheus_client.parser import text_string_to_metric_families

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc as pb_grpc
from kvpark.producer.metrics import ProducerMetrics


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


async def get_metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return await asyncio.to_thread(scrape, port)


async def test_metrics_reflect_park_fetch_reap_and_late_fetch() -> None:
    clock = FakeClock()
    async with (
        running_producer(
            clock=clock, metrics_listen="127.0.0.1:0", unbound_store_timeout_s=5
        ) as server,
        stub_for(server) as stub,
    ):
        m = await get_metrics(server.metrics_port)
        assert m[("kvpark_pool_bytes", ())] == server.pool.pool_bytes
        assert m[("kvpark_pool_used_bytes", ())] == 0
        assert ("kvpark_late_fetch_rejections_total", ()) in m

        await park(stub, "served", {0: b"s" * 1000}, total=1)
        await park(stub, "doomed", {0: b"d" * 2000}, total=1)
        # Scrapes read what the event loop published on its last reaper pass.
        m = await scraped(server, lambda m: m[("kvpark_parked_ids", ())] == 2)
        assert m[("kvpark_park_total", (("reason", "none"), ("status", "ok")))] == 2
        assert m[("kvpark_parked_bytes_total", ())] == 3000
        assert m[("kvpark_pool_used_bytes", ())] > 0

        done = (await fetch_all(stub, "served"))[-1].done
        m = await scraped(server, lambda m: m[("kvpark_delivered_ids", ())] == 1)
        assert m[("kvpark_delivered_total", ())] == 1 and m[("kvpark_parked_ids", ())] == 1
        await stub.Release(pb.ReleaseRequest(kv_request_id="served", delivery_id=done.delivery_id))
        clock.advance(5)
        await fetch_all(stub, "never-parked", wait_timeout_s=0.01)
        clock.advance(1)
        await wait_until(lambda: server.lot.statistics().reaped_total == 1)
        await fetch_all(stub, "doomed")  # late: answered from the tombstone

        m = await scraped(server, lambda m: m[("kvpark_late_fetch_rejections_total", ())] == 1)
        assert m[("kvpark_fetch_total", (("reason", "none"), ("status", "ok")))] == 1
        assert m[("kvpark_fetch_total", (("reason", "reaped"), ("status", "failed")))] == 1
        assert m[("kvpark_fetch_total", (("reason", "wait_timeout"), ("status", "failed")))] == 1
        assert m[("kvpark_reaped_total", ())] == 1
        assert m[("kvpark_confirmed_total", ())] == 1 and m[("kvpark_consumed_total", ())] == 1
        assert m[("kvpark_delivered_ids", ())] == 0
        assert m[("kvpark_sent_bytes_total", (("transport", "grpc"),))] == 1000
        assert m[("kvpark_tombstones", ())] == 2
        assert m[("kvpark_parked_ids", ())] == 0 and m[("kvpark_pool_used_bytes", ())] == 0
        assert m[("kvpark_fetch_duration_seconds_count", ())] == 3
        assert m[("kvpark_time_to_fetch_seconds_count", ())] == 1


async def scraped(server: Any, ready: Callable[[dict[Any, float]], bool]) -> dict[Any, float]:
    """The first scrape that satisfies `ready` (the snapshot is published on reaper passes,
    which a test producer runs every 50 ms)."""
    found: list[dict[Any, float]] = []

    async def scrape() -> bool:
        m = await get_metrics(server.metrics_port)
        found[:] = [m]
        return ready(m)

    await wait_until(scrape, what="a scrape showing the change")
    return found[0]


async def test_repeated_late_fetch_warnings_are_rate_limited_and_counted() -> None:
    clock = FakeClock()
    async with (
        running_producer(
            clock=clock, metrics_listen="127.0.0.1:0", unbound_store_timeout_s=5
        ) as server,
        stub_for(server) as stub,
    ):
        await park(stub, "noisy", {0: b"n"}, total=1)
        clock.advance(6)
        await wait_until(lambda: server.lot.statistics().reaped_total == 1)
        for _ in range(20):
            await fetch_all(stub, "noisy")
        m = await scraped(server, lambda m: m[("kvpark_late_fetch_rejections_total", ())] == 20)
        # The first late fetch is logged; the other 19 for the same id are counted instead.
        assert m[("kvpark_suppressed_warnings_total", (("kind", "late_fetch"),))] == 19


def test_process_memory_is_exported_and_holds_the_pool(producer_process) -> None:  # type: ignore[no-untyped-def]
    pool = 256 * MiB
    producer = producer_process(pool_bytes=pool)
    m = scrape(producer.metrics_port)
    rss = m[("process_resident_memory_bytes", ())]
    # The pool is touched at start-up, so a fresh producer's resident memory already holds it,
    # plus the interpreter and gRPC (README: ~60 MiB at start).
    assert pool <= rss < pool + 200 * MiB, rss / MiB
    assert m[("process_open_fds", ())] > 0


def test_documented_metric_names_exist() -> None:
    """The names operators alert on are all exported."""
    from kvpark.producer.lot import Lot, LotSettings
    from kvpark.producer.pool import HostPool

    lot = Lot(HostPool(1 << 20), LotSettings(), epoch=1, clock=lambda: 0.0)
    metrics = ProducerMetrics(lot.pool.statistics(), lot.statistics())
    metrics.count_fetch(pb.REASON_UNSPECIFIED)
    metrics.count_park(pb.REASON_UNSPECIFIED)
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    for name in [
        "kvpark_pool_bytes",
        "kvpark_pool_used_bytes",
        "kvpark_parked_ids",
        "kvpark_bound_ids",
        "kvpark_delivered_ids",
        "kvpark_confirmed_total",
        "kvpark_evicted_total",
        "kvpark_stalled_fetches_total",
        "kvpark_tombstones",
        "kvpark_park_total",
        "kvpark_fetch_total",
        "kvpark_late_fetch_rejections_total",
        "kvpark_reaped_total",
        "kvpark_parked_bytes_total",
        "kvpark_sent_bytes_total",
        "kvpark_fetch_duration_seconds_bucket",
        "kvpark_time_to_fetch_seconds_bucket",
    ]:
        assert f"\n{name}" in text, name


@pytest.mark.parametrize("transport", [pb.TRANSPORT_GRPC, pb.TRANSPORT_TCP])
async def test_a_consumer_cut_off_for_stalling_counts_only_what_went_out(transport: int) -> None:
    """A Fetch's batch may be every ready chunk (on TCP, the whole id): a consumer that reads
    nothing and is cut off for it is counted for the bytes the producer got out, not for 32
    MiB it never sent; a whole Fetch counts its bytes exactly."""
    chunks = {i: bytes([i]) * MiB for i in range(32)}
    total = 32 * MiB
    settings = {"fetch_stall_timeout_s": 0.5, "data_listen": "127.0.0.1:0", "max_chunk_bytes": MiB}
    async with running_producer(**settings) as server, stub_for(server) as stub:
        assert (await park(stub, "kv", chunks)).status == pb.STATUS_OK
        request = pb.FetchRequest(kv_request_id="kv", accept_transports=[transport])
        # A channel whose flow-control window stays small: a reader that reads nothing.
        options = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 2 * MiB)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            call = pb_grpc.KVProducerStub(channel).Fetch(request)
            data = None
            if transport == pb.TRANSPORT_TCP:
                offer = (await call.read()).data_offer
                data = socket.socket()
                data.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                data.connect(("127.0.0.1", server.data_port))
                data.sendall(offer.ticket)
            await wait_until(lambda: server.lot.statistics().stalled_fetches_total == 1)
            call.cancel()
            if data is not None:
                data.close()
        stalled = server.metrics.sent_bytes
        # Out before the stall: what a 64 KiB window passes on the stream (a gRPC batch is 4
        # MiB); on TCP, what the two sockets' buffers took (the batch is all 32 MiB).
        assert 0 <= stalled <= (2 * MiB if transport == pb.TRANSPORT_GRPC else total // 2), stalled
        assert (await state_of(stub, "kv")).state == pb.STATE_PARKED
        # The whole id now, on the gRPC stream: counted exactly.
        done = (await fetch_all(stub, "kv"))[-1].done
        assert done.status == pb.STATUS_OK and done.bytes_sent == total
        assert server.metrics.sent_bytes - stalled == total
        server.lot.check_invariants()
