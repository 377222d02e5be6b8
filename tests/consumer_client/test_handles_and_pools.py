"""Handles, pools and client metrics against real producers: a park's handle names the producer
(advertised or dialed), its epoch and transports, and survives the trip through a router as a
dict or JSON; a pool loads by handle from whichever of two producers it names, with the epoch
checked; the pool's bounds (LRU room, idle close, loads in flight and pinned clients kept); a
worker's Prometheus series counted per path, reason and policy."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from conftest import FakeClock, running_producer, stub_for, wait_until
from consumer_support import in_thread, payload
from prometheus_client import CollectorRegistry

from kvpark import (
    AsyncConsumerPool,
    AsyncKVConsumer,
    AsyncKVParker,
    ClientClosedError,
    ConsumerMetrics,
    ConsumerPool,
    KVConsumer,
    KVHandle,
    KVParker,
    LoadFailedError,
    LoadPath,
    Reason,
    Timeout,
    UsageError,
)
from kvpark.client.handle import MAX_FETCH_CHUNKS


# ==================================================================================== handles
def test_handle_round_trips_through_dict_and_json_and_ignores_a_routers_own_keys() -> None:
    handle = KVHandle("req-7", "10.0.3.7:50051", 1234, 8, 8 << 20, ("tcp", "grpc"))
    data = handle.to_dict()
    assert data["remote_host"] == "10.0.3.7" and data["remote_port"] == 50051
    assert KVHandle.from_dict(data) == handle
    assert KVHandle.from_json(handle.to_json()) == handle
    assert KVHandle.coerce({**data, "router_hop": 3}) == handle
    ipv6 = KVHandle("r", "[::1]:7", 1, 1, 1)
    assert KVHandle.from_json(ipv6.to_json()) == ipv6
    assert KVHandle.coerce({**ipv6.to_dict(), "remote_host": "[::1]"}) == ipv6


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"kvpark": 2}, "format 2"),
        ({"remote_port": "50051"}, "remote_port"),
        ({"producer_epoch": -1}, "producer_epoch"),
        ({"producer_epoch": 0}, "producer_epoch"),
        ({"num_chunks": True}, "num_chunks"),
        ({"transports": ["rdma"]}, "rdma"),
        ({"kv_request_id": None}, "kv_request_id"),
        ({"kv_request_id": 42}, "kv_request_id"),
        ({"kv_request_id": "bad\nid"}, "kv_request_id"),
        ({"num_chunks": 2**32}, "num_chunks"),
        ({"num_chunks": MAX_FETCH_CHUNKS + 1}, "num_chunks"),
        ({"remote_port": 0}, "remote_port"),
        ({"remote_port": 65536}, "remote_port"),
        ({"producer_epoch": 2**64}, "producer_epoch"),
    ],
)
def test_a_malformed_handle_is_a_usage_error_naming_the_key(change: dict, named: str) -> None:
    data = {**KVHandle("r", "h:1", 1, 1, 1).to_dict(), **change}
    if change.get("kv_request_id", "") is None:
        del data["kv_request_id"]
    with pytest.raises(UsageError, match=named):
        KVHandle.from_dict(data)
    with pytest.raises(UsageError, match="not JSON"):
        KVHandle.from_json("{nope")


def test_a_handle_names_a_port_it_can_dial() -> None:
    with pytest.raises(UsageError, match="port 0 cannot be dialed"):
        KVHandle("r", "10.0.3.7:0", 1, 1, 1)


async def test_a_load_asks_for_at_most_the_chunks_one_fetch_carries() -> None:
    # The handle's bound is the load's: a handle that passes is a load that can be asked for.
    assert KVHandle("r", "h:1", 1, MAX_FETCH_CHUNKS, 1).num_chunks == MAX_FETCH_CHUNKS
    async with running_producer() as server:
        async with AsyncKVConsumer(server.target, timeout=Timeout(5)) as consumer:
            with pytest.raises(UsageError, match=f"num_chunks: expected 1..{MAX_FETCH_CHUNKS}"):
                await consumer.load("r", num_chunks=MAX_FETCH_CHUNKS + 1)
        assert server.lot.bound_count == 0


async def test_a_parks_handle_names_the_advertised_producer_or_the_dialed_one() -> None:
    advertised = "kv-node-3.example:50051"
    async with (
        running_producer() as plain,
        running_producer(
            advertise_address=advertised, data_listen="0.0.0.0:0", allow_insecure=True
        ) as behind_nat,
    ):

        def park_both() -> list:
            results = []
            for server in (plain, behind_nat):
                with KVParker(server.target) as parker:
                    results.append(parker.park("r", [b"a" * 10, b"b" * 20]))
            return results

        on_plain, on_nat = await in_thread(park_both)
        assert on_plain.handle == KVHandle("r", plain.target, plain.epoch, 2, 30, ("grpc",))
        assert on_nat.handle.producer == advertised
        assert on_nat.handle.transports == ("tcp", "grpc")
        assert on_nat.handle.producer_epoch == behind_nat.epoch

        # A target with a gRPC scheme: the handle names the host:port it dials.
        async with AsyncKVParker(f"dns:///{plain.target}") as parker:
            schemed = await parker.park("s", [b"kv"])
        assert schemed.ok and schemed.handle.producer == plain.target
        async with AsyncKVParker(plain.target) as parker:
            refused = await parker.park("r", [b"again"])  # the id is already committed
        assert not refused.ok
        with pytest.raises(UsageError, match="no handle"):
            _ = refused.handle


# ====================================================================================== pools
async def test_a_pool_loads_by_handle_from_the_producer_each_names() -> None:
    async with running_producer() as a, running_producer() as b:
        chunks = {a.target: payload(3, 1000, seed=1), b.target: payload(2, 500, seed=2)}
        routed: list[str] = []  # what the router forwards: JSON
        for server in (a, b):
            async with AsyncKVParker(server.target) as parker:
                parked = await parker.park("same-id", chunks[server.target])
            routed.append(parked.handle.to_json())

        def load_all() -> list:
            with ConsumerPool(timeout=Timeout(5)) as pool:
                results = [pool.load(h) for h in routed]
                assert sorted(pool.addresses()) == sorted([a.target, b.target])
                return results

        results = await in_thread(load_all)
        for result, server in zip(results, (a, b), strict=True):
            assert result.ok, result
            want = b"".join(chunks[server.target][i] for i in sorted(chunks[server.target]))
            assert result.data is not None and result.data.tobytes() == want

        # A handle from before a producer restarted: its epoch is refused at once.
        stale = KVHandle.from_dict({**json.loads(routed[0]), "producer_epoch": a.epoch + 1})
        async with AsyncConsumerPool(timeout=Timeout(5)) as pool:
            result = await pool.load(stale)
        assert result.reason is Reason.EPOCH_MISMATCH


async def test_pool_makes_room_by_closing_the_least_recently_used_idle_client() -> None:
    async with running_producer() as a, running_producer() as b, running_producer() as c:
        pool = AsyncConsumerPool(max_producers=2, timeout=Timeout(5))
        async with pool:
            ca = await pool.client(a.target)  # pinned: the caller keeps it
            handles = {}
            for server in (b, c):
                async with AsyncKVParker(server.target) as parker:
                    handles[server.target] = (await parker.park("x", [b"kv"])).handle
            assert (await pool.load(handles[b.target])).ok
            assert (await pool.load(handles[c.target])).ok
            # Three producers, room for two: b, the least recently used unpinned client, went.
            assert set(pool.addresses()) == {a.target, c.target}
            assert not ca.closed and len(pool) == 2
            await pool.drop(a.target)
            assert ca.closed and a.target not in pool
        with pytest.raises(ClientClosedError):
            await pool.load(handles[c.target])


async def test_pool_closes_idle_clients_but_never_one_a_load_is_using() -> None:
    clock = FakeClock()
    async with running_producer() as a, running_producer() as b:
        pool = AsyncConsumerPool(idle_close_s=60, clock=clock, timeout=Timeout(10))
        async with pool, AsyncKVParker(b.target) as parker:
            on_b = [(await parker.park(f"ready-{i}", [b"kv"])).handle for i in range(2)]
            # A load on `a` waits for an id the prefill has not parked yet.
            waiting = KVHandle("later", a.target, a.epoch, 1, 2)
            load = asyncio.create_task(pool.load(waiting, wait_timeout_s=10))
            await wait_until(lambda: a.lot.bound_count == 1, what="the load to wait on a")
            clock.advance(61)
            assert (await pool.load(on_b[0])).ok
            assert a.target in pool, "the waiting load's client was closed under it"
            async with AsyncKVParker(a.target) as parker_a:
                assert (await parker_a.park("later", [b"kv"])).ok
            assert (await load).ok
            clock.advance(61)
            assert (await pool.load(on_b[1])).ok
            assert set(pool.addresses()) == {b.target}, "idle a was not closed"


async def test_a_sync_pool_keeps_one_client_per_producer_within_its_bound() -> None:
    async with running_producer() as a, running_producer() as b:
        handles = []
        for server in (a, b):
            async with AsyncKVParker(server.target) as parker:
                handles.append((await parker.park("x", [b"kv"])).handle)

        def run() -> tuple[list[bool], list[str], KVConsumer]:
            with ConsumerPool(max_producers=1) as pool:
                first = pool.client(a.target)  # pinned: kept however full the pool is
                pool.drop(a.target)
                assert first.closed and a.target not in pool
                ok = [pool.load(h).ok for h in handles]
                evicted = pool.client(b.target)
                return ok, pool.addresses(), evicted

        ok, addresses, kept = await in_thread(run)
        assert ok == [True, True] and addresses == [b.target] and kept.closed


def test_pool_bounds_are_checked() -> None:
    for bad in ({"max_producers": 0}, {"max_producers": 1.5}, {"idle_close_s": 0}):
        with pytest.raises(UsageError):
            ConsumerPool(**bad)
    for pool in (ConsumerPool, AsyncConsumerPool):
        with pytest.raises(UsageError, match="idle_close_s"):
            pool(idle_close_s="300")


@pytest.mark.parametrize("pool", [ConsumerPool, AsyncConsumerPool])
@pytest.mark.parametrize(
    ("client_args", "named"),
    [
        ({"timeuot": 5}, "timeuot"),
        ({"transport": "tpc"}, "transport"),
        ({"timeout": "5"}, "timeout"),
        ({"max_chunk_bytes": 0}, "max_chunk_bytes"),
    ],
)
def test_a_pool_refuses_client_arguments_its_clients_would(
    pool: type, client_args: dict, named: str
) -> None:
    # At construction, not on every load after it (where even policy="recompute" raises).
    with pytest.raises(UsageError, match=named):
        pool(**client_args)


# ==================================================================================== metrics
def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_client_metrics_count_each_load_by_path_reason_and_policy() -> None:
    registry = CollectorRegistry()
    metrics = ConsumerMetrics(registry)
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("here", payload(4, 10_000))).ok

        def loads() -> list:
            recomputed: list[int] = []
            with KVConsumer(server.target, timeout=Timeout(5), metrics=metrics) as client:
                remote = client.load_or_recompute("here", recompute=recomputed.append)
                # Ids the prefill never parks: each load waits 0.1 s for it, then falls back.
                missing = client.load_or_recompute(
                    "never-parked", num_chunks=3, recompute=recomputed.append, wait_timeout_s=0.1
                )
                # A whole-id load does not know how many chunks it misses: a fallback, no chunks.
                client.load_or_recompute(
                    "never-parked-whole", recompute=recomputed.append, wait_timeout_s=0.1
                )
                with pytest.raises(LoadFailedError) as failed:
                    client.load_or_recompute(
                        "never-parked-2", num_chunks=2, policy="fail", wait_timeout_s=0.1
                    )
                plain = client.load("here")  # already delivered: a plain load, no policy
            return [remote, missing, failed.value.result, plain, recomputed]

        remote, missing, failed, plain, recomputed = await in_thread(loads)
    assert remote.path is LoadPath.REMOTE and missing.path is LoadPath.RECOMPUTE
    # Each recompute-policy load recomputed from chunk 0; policy='fail' recomputed nothing.
    assert recomputed == [0, 0], recomputed
    r = registry
    assert sample(r, "kvpark_client_loads_total", path="remote", reason="none",
                  policy="recompute") == 1  # fmt: skip
    reason = missing.reason.lower()
    assert sample(r, "kvpark_client_loads_total", path="recompute", reason=reason,
                  policy="recompute") == 2  # fmt: skip
    assert sample(r, "kvpark_client_loads_total", path="recompute",
                  reason=failed.reason.lower(), policy="fail") == 1  # fmt: skip
    assert sample(r, "kvpark_client_loads_total", path=plain.path.value,
                  reason=(plain.reason or "none").lower(), policy="none") == 1  # fmt: skip
    assert sample(r, "kvpark_client_fallbacks_total", reason=reason, policy="recompute") == 2
    assert sample(r, "kvpark_client_recomputed_chunks_total") == 3
    assert sample(r, "kvpark_client_loaded_bytes_total") == remote.result.bytes == 40_006
    assert sample(r, "kvpark_client_load_seconds_count") == 5
    assert sample(r, "kvpark_client_first_chunk_seconds_count") == 1
    assert sample(r, "kvpark_client_load_throughput_bytes_per_second_count") == 1
    assert sample(r, "kvpark_client_failure_policy", policy="recompute") == 1


async def test_a_pool_gives_its_clients_its_metrics() -> None:
    registry = CollectorRegistry()
    async with running_producer() as server, stub_for(server):
        async with AsyncKVParker(server.target) as parker:
            handle = (await parker.park("p", [np.zeros(100, np.uint8)])).handle
        async with AsyncConsumerPool(metrics=ConsumerMetrics(registry)) as pool:
            assert (await pool.load(handle)).ok
            assert isinstance(await pool.client(server.target), AsyncKVConsumer)
    assert sample(registry, "kvpark_client_loads_total", path="remote", reason="none",
                  policy="none") == 1  # fmt: skip
