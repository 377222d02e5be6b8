"""Registries: one client (one channel) per producer target, shared settings, closed together."""

from __future__ import annotations

import pytest
from conftest import park, running_producer, stub_for
from consumer_support import in_thread, payload

from kvpark.client import (
    AsyncConsumerRegistry,
    ClientClosedError,
    ConsumerRegistry,
    Timeout,
)


async def test_async_registry_one_client_per_target_closed_together() -> None:
    async with running_producer() as a, running_producer() as b:
        async with stub_for(a) as sa, stub_for(b) as sb:
            await park(sa, "on-a", payload(1, 10), total=1)
            await park(sb, "on-b", payload(1, 10), total=1)
        registry = AsyncConsumerRegistry(timeout=Timeout(5))
        async with registry:
            ca = registry.get(a.target)
            assert registry[a.target] is ca and ca.timeout == Timeout(5)
            assert (await ca.load("on-a", num_chunks=1)).ok
            assert (await registry[b.target].load("on-b", num_chunks=1)).ok
            assert len(registry) == 2 and set(registry) == {a.target, b.target}
            await registry.drop(b.target)
            assert b.target not in registry
        assert ca.closed and registry.closed
        with pytest.raises(ClientClosedError):
            registry.get(a.target)


async def test_sync_registry() -> None:
    async with running_producer() as a:
        async with stub_for(a) as sa:
            await park(sa, "x", payload(1, 10), total=1)

        def run() -> bool:
            with ConsumerRegistry() as registry:
                client = registry[a.target]
                ok = client.load("x", num_chunks=1).ok
            return ok and client.closed

        assert await in_thread(run)
