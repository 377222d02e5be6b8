"""The data listener's guards against a host that runs short and a peer that stays silent: a
handshake thread that cannot be started refuses its connection and gives its slot back (so the
listener never runs out of slots for good), one host cannot take every handshake slot,
stopping twice is harmless, and a ticket whose ACCEPTED byte found no room
stays good for the consumer's next connection. The producer is real, in-process; only the
start of a handshake thread is made to fail, as a tight pids limit makes it fail, and the
full send buffer is a stand-in."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import types
from typing import Any

import numpy as np
import pytest
from conftest import MiB, running_producer, wait_until

from kvpark import KVConsumer, KVParker
from kvpark.address import Address
from kvpark.client._tcp import TURNED_AWAY_IN_A_ROW
from kvpark.producer import data_listener
from kvpark.producer.data_listener import MAX_HANDSHAKES, DataListener

SETTINGS: dict[str, Any] = {"data_listen": "127.0.0.1:0", "pool_bytes": 16 * MiB}


class NoThreadToBeHad(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def loads_over_tcp(target: str, kid: str) -> None:
    """Parks 1 MiB as `kid` and loads it back: it must come over a data connection."""
    chunk = np.arange(MiB, dtype=np.uint8)

    def park_and_load() -> Any:
        with KVParker(target) as parker, KVConsumer(target, transport="tcp") as consumer:
            assert parker.park(kid, [chunk]).ok
            return consumer.load(kid, num_chunks=1)

    result = await asyncio.to_thread(park_and_load)
    assert result.ok and result.transport == "tcp", result
    assert bytes(result.data) == chunk.tobytes()


async def test_a_handshake_thread_that_cannot_start_refuses_and_frees_its_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None
        # The listener's own module sees a Thread that cannot start; nothing else does.
        failing = types.SimpleNamespace(**vars(threading))
        failing.Thread = NoThreadToBeHad
        monkeypatch.setattr(data_listener, "threading", failing)
        address = ("127.0.0.1", server.data_port)
        # More connections than there are slots: each is refused, none keeps its slot.
        for n in range(1, MAX_HANDSHAKES + 2):
            with socket.create_connection(address) as sock:
                await wait_until(lambda s=sock: closed_by_peer(s), what=f"connection {n} closed")
            await wait_until(lambda n=n: server.data.refused == n, what=f"{n} refused")
        assert server.data.accepting
        monkeypatch.undo()
        await loads_over_tcp(server.target, "after")
        assert server.data.accepted == 1


async def test_one_silent_host_cannot_take_every_handshake_slot() -> None:
    """A host that opens MAX_HANDSHAKES connections and sends nothing (no ticket, nothing to
    authenticate) keeps half the handshake slots until the handshake timeout; the rest are
    closed at once, and a consumer on another host (here 127.0.0.1, the silent one being
    127.0.0.2) still gets its data connection instead of falling back to the gRPC stream."""
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None
        silent = []
        try:
            for _ in range(MAX_HANDSHAKES):
                sock = socket.socket()
                silent.append(sock)
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", server.data_port))
            turned_away = MAX_HANDSHAKES - MAX_HANDSHAKES // 2
            await wait_until(lambda: server.data.refused == turned_away, what="the extra closed")
            assert sum(closed_by_peer(sock) for sock in silent) == turned_away
            await loads_over_tcp(server.target, "past-the-silent")
        finally:
            for sock in silent:
                sock.close()


async def test_a_connection_turned_away_for_its_host_costs_one_load_not_the_path() -> None:
    """Half the handshake slots held by silent connections from the consumer's own host: the
    consumer's next new data connection is closed unread (a reset), and that one load goes
    over the gRPC stream. The path is not marked failed: once the slots are free the next
    load goes over TCP again, instead of the gRPC stream for RETRY_AFTER_S."""
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None
        address = ("127.0.0.1", server.data_port)
        silent = [socket.create_connection(address) for _ in range(MAX_HANDSHAKES // 2 + 1)]
        chunk = np.arange(MiB, dtype=np.uint8)
        with KVParker(server.target) as parker, KVConsumer(server.target, transport="tcp") as c:
            try:
                await wait_until(lambda: server.data.refused == 1, what="the host's share full")
                assert (await asyncio.to_thread(parker.park, "turned-away", [chunk])).ok
                first = await asyncio.to_thread(c.load, "turned-away", num_chunks=1)
                assert first.ok and first.transport == "grpc", first
                assert server.data.refused == 2, "the consumer's own connection was turned away"
            finally:
                for sock in silent:
                    sock.close()
            await wait_until(
                lambda: server.data.refused == len(silent) + 1, what="the silent ones ended"
            )
            assert (await asyncio.to_thread(parker.park, "welcome", [chunk])).ok
            second = await asyncio.to_thread(c.load, "welcome", num_chunks=1)
            assert second.ok and second.transport == "tcp", second


async def test_a_data_port_that_always_turns_connections_away_is_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer (or a proxy in front of it) that takes every new data connection and then
    resets it unanswered: one such connection costs only its load, but TURNED_AWAY_IN_A_ROW
    of them with none accepted in between is a path that never works, and TCP is left out
    for RETRY_AFTER_S instead of costing every load a connect and a reset."""
    refuse = DataListener._refuse

    def reset(listener: DataListener, conn: socket.socket, peer: Any, exc: Exception) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        refuse(listener, conn, peer, exc)

    def turn_away(*_: Any) -> Any:
        raise ConnectionRefusedError("every ticket turned away")

    monkeypatch.setattr(DataListener, "_refuse", reset)
    monkeypatch.setattr(DataListener, "_answer", turn_away)
    loads = TURNED_AWAY_IN_A_ROW + 2
    async with running_producer(**SETTINGS) as server:
        assert server.data is not None

        def park_and_load_all() -> list[Any]:
            with KVParker(server.target) as parker, KVConsumer(
                server.target, transport="tcp"
            ) as consumer:  # fmt: skip
                for i in range(loads):
                    assert parker.park(f"away-{i}", [np.ones(1024, np.uint8)]).ok
                return [consumer.load(f"away-{i}", num_chunks=1) for i in range(loads)]

        results = await asyncio.to_thread(park_and_load_all)
        assert all(r.ok and r.transport == "grpc" for r in results), results
        assert server.data.refused == TURNED_AWAY_IN_A_ROW


async def test_stopping_twice_is_harmless() -> None:
    listener = DataListener(Address.parse("127.0.0.1:0"), tls=None, loop=asyncio.get_running_loop())
    port = listener.start()
    listener.stop()
    listener.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


class NoRoom:
    """A connection whose send buffer is full (a real one cannot be made full on cue)."""

    def send(self, data: bytes) -> int:
        raise BlockingIOError("no room")


async def test_a_ticket_whose_answer_found_no_room_stays_good_for_the_next_connection() -> None:
    """The ACCEPTED byte could not go out on a kept connection: that connection is refused,
    and the consumer's new connection with the same ticket still gets its transfer."""
    listener = DataListener(Address.parse("127.0.0.1:0"), tls=None, loop=asyncio.get_running_loop())
    port = listener.start()
    try:
        ticket, arrival = listener.expect()
        with pytest.raises(BlockingIOError):
            listener._answer(NoRoom(), ticket, kept=True)  # type: ignore[arg-type]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(ticket)
            assert sock.recv(1) == data_listener.ACCEPTED
            conn = await asyncio.wait_for(arrival, 5)
            conn.close()
        assert (listener.accepted, listener.reused) == (1, 0)
    finally:
        listener.stop()


async def test_a_ticket_whose_fetch_ended_while_its_answer_failed_is_not_put_back() -> None:
    """The Fetch ends (and forgets its ticket) while a connection's ACCEPTED byte for that
    ticket is being sent, and the send fails: the ticket is not put back to wait for ever,
    and a connection that presents it afterwards is refused."""
    listener = DataListener(Address.parse("127.0.0.1:0"), tls=None, loop=asyncio.get_running_loop())
    port = listener.start()
    try:
        ticket, _ = listener.expect()

        class FetchEndsMeanwhile(NoRoom):
            def send(self, data: bytes) -> int:
                listener.forget(ticket)
                return super().send(data)

        with pytest.raises(BlockingIOError):
            listener._answer(FetchEndsMeanwhile(), ticket, kept=True)  # type: ignore[arg-type]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(ticket)
            assert sock.recv(1) == b"", "a ticket whose Fetch ended opened a connection"
        assert listener.accepted == 0
    finally:
        listener.stop()
