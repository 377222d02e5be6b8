"""A data connection's name lookup stays inside the load's budget: a DNS server that never
answers costs a load its connect budget and a fallback to the gRPC stream, not its whole
timeout (or, unbounded, for ever on the caller's thread). A lookup that answers late serves
the loads after it, and loads share one lookup of a name. An IP address is never looked up.

The slow DNS server is a stand-in for `socket.getaddrinfo` (no resolver this machine runs can
be made slow on purpose); everything else is real: the producer, its data listener, the
gRPC channel (which resolves "localhost" on its own, in grpc's core)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_until
from consumer_support import no_thread_starts

from kvpark import KVConsumer, KVParker
from kvpark.address import Address
from kvpark.client import _resolve

HOST = "localhost"


class SlowDns:
    """`socket.getaddrinfo` that holds every lookup of HOST until `answer()`."""

    def __init__(self) -> None:
        self.lookups = 0
        self._answered = threading.Event()
        self._real = socket.getaddrinfo

    def __call__(self, host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == HOST:
            self.lookups += 1
            self._answered.wait()
        return self._real(host, *args, **kwargs)

    def answer(self) -> None:
        self._answered.set()


@pytest.fixture
def slow_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[SlowDns]:
    dns = SlowDns()
    monkeypatch.setattr(socket, "getaddrinfo", dns)
    monkeypatch.setattr(_resolve, "_cache", {})
    monkeypatch.setattr(_resolve, "_in_flight", {})
    yield dns
    dns.answer()  # the lookup thread ends


def park_and_load(
    server_target: str, kid: str, consumer: KVConsumer | None = None
) -> tuple[Any, bool]:
    """Parks 2 MiB under `kid` on the producer, then loads it from "localhost:PORT" with
    `consumer`, or a new client (transport auto: TCP offered); the result and whether every
    byte arrived."""
    data = np.random.default_rng(list(kid.encode())).integers(0, 256, 2 * MiB, dtype=np.uint8)
    with KVParker(server_target) as parker:
        assert parker.park(kid, [data[:MiB], data[MiB:]]).ok
    port = Address.parse(server_target).port
    into = np.zeros_like(data)
    if consumer is not None:
        result = consumer.load(kid, num_chunks=2, into=into)
    else:
        with KVConsumer(f"{HOST}:{port}", timeout=30) as new:
            result = new.load(kid, num_chunks=2, into=into)
    return result, bool(np.array_equal(into, data))


async def test_a_lookup_that_never_answers_costs_the_load_a_fallback_only(
    slow_dns: SlowDns,
) -> None:
    async with running_producer(data_listen="127.0.0.1:0") as server:
        result, whole = await asyncio.to_thread(park_and_load, server.target, "never")
        assert result.ok and whole
        assert result.transport == "grpc"
        assert slow_dns.lookups == 1


async def test_a_late_answer_serves_the_next_loads_and_one_lookup_serves_them_all(
    slow_dns: SlowDns,
) -> None:
    """The load that gave up on the lookup fell back; it says nothing about the path, so the
    same client's next loads go over TCP as soon as the answer is in, all on that one lookup;
    so do a new client's."""
    async with running_producer(data_listen="127.0.0.1:0") as server:
        port = Address.parse(server.target).port
        with KVConsumer(f"{HOST}:{port}", timeout=30) as consumer:
            first, whole = await asyncio.to_thread(park_and_load, server.target, "first", consumer)
            assert first.ok and whole and first.transport == "grpc"
            slow_dns.answer()
            await wait_until(
                lambda: any(host == HOST for host, _ in _resolve._cache),
                what="the late answer kept",
            )
            for kid in ("second", "third"):
                result, whole = await asyncio.to_thread(park_and_load, server.target, kid, consumer)
                assert result.ok and whole and result.transport == "tcp"
        result, whole = await asyncio.to_thread(park_and_load, server.target, "fourth")
        assert result.ok and whole and result.transport == "tcp"
        assert slow_dns.lookups == 1


def test_answers_expire_and_are_not_kept_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new answer drops the expired ones: a client that met many producers over time
    keeps only those it used lately."""
    monkeypatch.setattr(_resolve, "_cache", {})
    monkeypatch.setattr(_resolve, "_in_flight", {})
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, port, **_: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))],
    )
    for i in range(3):
        _resolve.addresses(Address(f"kept-{i}.example", 7000), timeout_s=10)
    assert len(_resolve._cache) == 3
    monkeypatch.setattr(_resolve, "CACHE_S", 0.0)  # from now on, every answer expires at once
    for i in range(50):
        _resolve.addresses(Address(f"gone-{i}.example", 7000), timeout_s=10)
    # The three live answers stay; of the fifty expired ones only the last, not yet replaced.
    assert sorted(host for host, _ in _resolve._cache) == [
        "gone-49.example", "kept-0.example", "kept-1.example", "kept-2.example"
    ]  # fmt: skip


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_an_ip_address_is_never_looked_up(slow_dns: SlowDns, host: str) -> None:
    (family, _, _, sockaddr), *rest = _resolve.addresses(Address(host, 7000), timeout_s=0)
    assert not rest and sockaddr[:2] == (host, 7000)
    assert family == (socket.AF_INET6 if ":" in host else socket.AF_INET)
    assert slow_dns.lookups == 0


def test_an_answer_whose_addresses_refuse_is_looked_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose kept answer no longer takes connections (the producer moved to another
    address under the same name) is looked up again by the next connection, not after the
    answer's 30 s."""
    monkeypatch.setattr(_resolve, "_cache", {})
    monkeypatch.setattr(_resolve, "_in_flight", {})
    with socket.socket() as live, socket.socket() as moved_away:
        live.bind(("127.0.0.1", 0))
        live.listen()
        moved_away.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        ports = [moved_away.getsockname()[1], live.getsockname()[1]]
        lookups = []

        def getaddrinfo(host: str, port: int, **_: Any) -> list[Any]:
            lookups.append(host)
            where = ("127.0.0.1", ports[min(len(lookups), 2) - 1])
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", where)]

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        name = Address("producer.example", 7000)
        with pytest.raises(ConnectionRefusedError):
            _resolve.connect(name, timeout_s=5)
        with _resolve.connect(name, timeout_s=5) as sock:
            assert sock.getpeername()[1] == ports[1]
        assert lookups == ["producer.example", "producer.example"]


def test_a_lookup_thread_that_cannot_start_fails_that_lookup_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No thread to be had (a pids limit): that lookup fails with an OSError, which a load
    takes for a failed path and falls back from, and the next lookup of the name starts anew
    instead of waiting on one that never started."""
    monkeypatch.setattr(_resolve, "_cache", {})
    monkeypatch.setattr(_resolve, "_in_flight", {})
    with (
        no_thread_starts("kvpark-resolve"),
        pytest.raises(OSError, match="can't start new thread"),
    ):
        _resolve.addresses(Address(HOST, 7000), timeout_s=5)
    (_, _, _, sockaddr), *_ = _resolve.addresses(Address(HOST, 7000), timeout_s=5)
    assert sockaddr[1] == 7000
