"""Data connections kept between TCP loads: the wire (end frame, the next ticket on the same
connection, the close for consumers that do not ask), the bundled client's pool (one
connection for loads in a row, TLS included, expiry and limits), and every way a kept
connection goes away: the client closes, the producer drops it while idle, it dies just as the
next ticket goes out, it goes silent, the load is cancelled meanwhile; and the producer keeps
only a connection whose transfer was written whole. Each load still gets its bytes over TCP,
and the pool's invariants hold."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, running_producer, stub_for, wait_until

from kvpark import KVConsumer, KVParker, Reason
from kvpark.checksum import crc32c_of
from kvpark.client import _data_connections
from kvpark.pb import kvpark_pb2 as pb
from kvpark.producer import data_listener
from kvpark.tcp_frames import ACCEPTED, END_CHUNK_ID, recv_exactly, recv_header, recv_payload

CHUNK = MiB
SETTINGS: dict[str, Any] = {"data_listen": "127.0.0.1:0", "pool_bytes": 64 * MiB}


def data_for(kid: str, n: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(list(kid.encode()))
    return [rng.integers(0, 256, CHUNK, dtype=np.uint8) for _ in range(n)]


def park_all(target: str, ids: list[str], **parker_args: Any) -> dict[str, bytes]:
    expected = {}
    with KVParker(target, **parker_args) as parker:
        for kid in ids:
            parts = data_for(kid)
            assert parker.park(kid, parts).ok
            expected[kid] = b"".join(p.tobytes() for p in parts)
    return expected


def load(consumer: KVConsumer, kid: str) -> tuple[Any, bytes]:
    into = np.zeros(2 * CHUNK, np.uint8)
    result = consumer.load(kid, num_chunks=2, into=into)
    return result, into.tobytes()


async def park_the_rest_and_load(
    target: str, consumer: KVConsumer, kid: str, parts: list[np.ndarray]
) -> None:
    """Parks chunk 1 of an id whose chunk 0 is parked, then loads the whole id over TCP:
    every byte, in order."""
    with KVParker(target) as parker:
        assert (await asyncio.to_thread(parker.park, kid, {1: parts[1]})).ok
    whole, landed = await asyncio.to_thread(load, consumer, kid)
    assert whole.ok and whole.transport == "tcp", whole
    assert landed == b"".join(p.tobytes() for p in parts)


def read_transfer(sock: socket.socket) -> tuple[list[tuple[int, bytes]], str]:
    """The frames of one transfer and how it ended: "end" (end frame) or "close"."""
    frames = []
    while (header := recv_header(sock)) is not None:
        chunk_id, crc32c, nbytes = header
        if chunk_id == END_CHUNK_ID:
            assert (crc32c, nbytes) == (0, 0), header
            return frames, "end"
        payload = bytearray(nbytes)
        assert recv_payload(sock, [memoryview(payload)], nbytes) == crc32c
        frames.append((chunk_id, bytes(payload)))
    return frames, "close"


# ==================================================================================== wire
async def test_the_wire_end_frame_then_the_next_ticket_on_the_same_connection() -> None:
    """What a client in another language sees: with reuse_data_connection the transfer ends
    with the end frame and the next Fetch's ticket is accepted on that connection; without it
    the producer closes after the last frame, as before."""
    async with running_producer(**SETTINGS) as server:
        expected = await asyncio.to_thread(park_all, server.target, ["w1", "w2", "w3"])
        port = server.data_port
        async with stub_for(server) as stub:

            async def offer(kid: str, reuse: bool) -> tuple[Any, bytes]:
                request = pb.FetchRequest(
                    kv_request_id=kid,
                    accept_transports=[pb.TRANSPORT_TCP],
                    reuse_data_connection=reuse,
                )
                call = stub.Fetch(request)
                return call, (await call.read()).data_offer.ticket

            def present(sock: socket.socket, ticket: bytes) -> None:
                sock.sendall(ticket)
                answer = bytearray(1)
                recv_exactly(sock, memoryview(answer))
                assert bytes(answer) == ACCEPTED

            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                for kid in ("w1", "w2"):
                    call, ticket = await offer(kid, reuse=True)
                    await asyncio.to_thread(present, sock, ticket)
                    frames, how = await asyncio.to_thread(read_transfer, sock)
                    assert how == "end" and b"".join(p for _, p in frames) == expected[kid]
                    done = (await call.read()).done
                    assert done.status == pb.STATUS_OK and done.transport == pb.TRANSPORT_TCP
            assert server.data.accepted == 1 and server.data.reused == 1

            call, ticket = await offer("w3", reuse=False)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                await asyncio.to_thread(present, sock, ticket)
                frames, how = await asyncio.to_thread(read_transfer, sock)
            assert how == "close" and b"".join(p for _, p in frames) == expected["w3"]
            assert (await call.read()).done.status == pb.STATUS_OK
        await wait_until(lambda: server.data.idle == 0, what="the dropped connection closed")
        server.lot.check_invariants()


# ============================================================================ bundled client
async def test_loads_in_a_row_share_one_data_connection_until_the_client_closes() -> None:
    async with running_producer(**SETTINGS) as server:
        ids = ["a", "b", "c"]
        expected = await asyncio.to_thread(park_all, server.target, ids)
        consumer = KVConsumer(server.target, transport="tcp")
        for kid in ids:
            result, landed = await asyncio.to_thread(load, consumer, kid)
            assert result.ok and result.transport == "tcp" and landed == expected[kid], result
        assert (server.data.accepted, server.data.reused) == (1, 2)
        # The producer's event loop watches a handed-back connection (before the TransferDone).
        await wait_until(lambda: server.data.idle == 1, what="the connection kept")

        def sample(name: str, **labels: str) -> float | None:
            return server.metrics.registry.get_sample_value(name, labels)

        counts = [sample("kvpark_data_connections_total", connection=c) for c in ("new", "kept")]
        assert counts == [1, 2] and sample("kvpark_data_connections_idle") == 1
        await wait_until(lambda: server.pool.statistics().used_bytes == 0, what="confirmed")
        consumer.close()
        await wait_until(lambda: server.data.idle == 0, what="the producer saw the close")
        assert sample("kvpark_data_connections_idle") == 0
        assert server.data.refused == 0
        server.lot.check_invariants()


async def test_a_tls_data_connection_is_kept_too(tmp_path: Path) -> None:
    from tls_certs import make_certs

    certs = make_certs(tmp_path)
    async with running_producer(
        **SETTINGS, tls_cert_file=str(certs.server_cert), tls_key_file=str(certs.server_key)
    ) as server:
        ca = certs.ca.read_bytes()
        tls: dict[str, Any] = {
            "credentials": grpc.ssl_channel_credentials(root_certificates=ca),
            "channel_options": [("grpc.ssl_target_name_override", "localhost")],
        }
        expected = await asyncio.to_thread(park_all, server.target, ["t1", "t2"], **tls)
        context = ssl.create_default_context(cadata=ca.decode())
        context.check_hostname = False  # the certificate names localhost; we dial 127.0.0.1
        with KVConsumer(server.target, data_tls=context, **tls) as consumer:
            for kid in ("t1", "t2"):
                result, landed = await asyncio.to_thread(load, consumer, kid)
                assert result.ok and result.transport == "tcp" and landed == expected[kid]
        assert (server.data.accepted, server.data.reused, server.data.refused) == (1, 1, 0)


async def test_a_load_that_times_out_keeps_no_connection() -> None:
    """A load that times out while the producer waits for its next chunk closes its
    connection (the producer's Fetch is cancelled with it, its end closes too); the next load
    connects anew and gets the whole id."""
    async with running_producer(**SETTINGS) as server:
        parts = data_for("half")

        def park_half() -> None:
            with KVParker(server.target) as parker:
                assert parker.park("half", {0: parts[0]}, total_chunks=2).ok

        await asyncio.to_thread(park_half)
        with KVConsumer(server.target, transport="tcp", timeout=0.5) as consumer:
            cut, _ = await asyncio.to_thread(load, consumer, "half")
            assert not cut.ok and cut.chunks_loaded == 1, cut
            await wait_until(lambda: server.lot.bound_count == 0, what="the id back to parked")
            await park_the_rest_and_load(server.target, consumer, "half", parts)
        assert (server.data.accepted, server.data.reused) == (2, 0)
        server.lot.check_invariants()


async def test_a_fetch_the_producer_ends_short_keeps_its_connection() -> None:
    """The producer's wait for the next chunk runs out (WAIT_TIMEOUT after chunk 0): no last
    batch carried the end frame, so the Fetch's end writes it on its own and the connection
    is kept; the next load of the whole id takes it."""
    async with running_producer(**SETTINGS) as server:
        parts = data_for("short")
        with KVParker(server.target) as parker:
            first = await asyncio.to_thread(parker.park, "short", {0: parts[0]}, total_chunks=2)
            assert first.ok
        with KVConsumer(server.target, transport="tcp") as consumer:

            def load_waiting() -> Any:
                into = np.zeros(2 * CHUNK, np.uint8)
                return consumer.load("short", num_chunks=2, into=into, wait_timeout_s=0.2)

            short = await asyncio.to_thread(load_waiting)
            assert short.reason is Reason.WAIT_TIMEOUT and short.chunks_loaded == 1, short
            assert short.transport == "tcp"
            await wait_until(lambda: server.data.idle == 1, what="the connection kept")
            await park_the_rest_and_load(server.target, consumer, "short", parts)
        assert (server.data.accepted, server.data.reused) == (1, 1)
        server.lot.check_invariants()


# =============================================================== a kept connection goes away
@pytest.mark.parametrize("noticed", [True, False], ids=["seen-before-use", "dies-at-use"])
async def test_a_kept_connection_the_producer_dropped_is_replaced_within_the_load(
    noticed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer drops an idle connection (its idle limit). The client either sees the
    close before it uses the connection, or (the close racing the check) sends its ticket into
    it; either way the load connects anew within its own attempt and goes over TCP."""
    if not noticed:
        monkeypatch.setattr(_data_connections, "_quiet", lambda sock: True)
    async with running_producer(**SETTINGS) as server:
        expected = await asyncio.to_thread(park_all, server.target, ["d1", "d2"])
        with KVConsumer(server.target, transport="tcp") as consumer:
            first, _ = await asyncio.to_thread(load, consumer, "d1")
            assert first.ok
            await wait_until(lambda: server.data.idle == 1, what="the connection kept")
            server.data.idle_timeout_s = 0.0
            await wait_until(lambda: server.data.idle == 0, what="the producer dropped it")
            second, landed = await asyncio.to_thread(load, consumer, "d2")
        assert second.ok and second.transport == "tcp" and landed == expected["d2"], second
        assert (server.data.accepted, server.data.reused) == (2, 0)
        server.lot.check_invariants()


async def test_beyond_its_idle_limit_the_producer_closes_the_longest_idle_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two consumers each keep a connection; the producer keeps at most one idle: the first
    one's goes, so its next load connects anew while the second's reuses its own."""
    monkeypatch.setattr(data_listener, "MAX_IDLE", 1)
    async with running_producer(**SETTINGS) as server:
        ids = ["m1", "m2", "m3", "m4"]
        expected = await asyncio.to_thread(park_all, server.target, ids)
        with (
            KVConsumer(server.target, transport="tcp") as first,
            KVConsumer(server.target, transport="tcp") as second,
        ):
            for consumer, kid in ((first, "m1"), (second, "m2")):
                result, _ = await asyncio.to_thread(load, consumer, kid)
                assert result.ok and result.transport == "tcp", result
            await wait_until(lambda: server.data.idle == 1, what="one connection kept")
            assert (server.data.accepted, server.data.reused) == (2, 0)
            # The second first (its connection is the one kept): the first's new connection
            # then pushes it out in turn.
            for consumer, kid, counts in ((second, "m3", (2, 1)), (first, "m4", (3, 1))):
                result, landed = await asyncio.to_thread(load, consumer, kid)
                assert result.ok and result.transport == "tcp" and landed == expected[kid]
                assert (server.data.accepted, server.data.reused) == counts
        server.lot.check_invariants()


# ========================================================== the producer's end of a transfer
@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut-mid-frame"])
async def test_only_a_transfer_written_whole_hands_its_connection_back(cut: bool) -> None:
    """The producer's TcpStream on a real socket pair: a transfer whose frames all went out
    ends with the end frame and hands the connection back; one whose write stalled inside a
    frame (the consumer stopped reading) closes it whatever happens to the Fetch next, since
    an end frame there would be read as payload."""
    from kvpark.producer.data_threads import DataThreads
    from kvpark.producer.lot import ReadyChunk
    from kvpark.producer.transports import Stalled, TcpStream

    ours, theirs = socket.socketpair()
    for sock in (ours, theirs):  # small buffers: a 4 MiB frame cannot fit while nobody reads
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    threads = DataThreads(1)
    kept: list[socket.socket] = []
    payload = np.arange(4 * MiB if cut else 4096, dtype=np.uint8).view(np.uint8)
    chunk = ReadyChunk(7, crc32c_of(payload), [memoryview(payload)], payload.nbytes)
    stream = TcpStream(ours, 0.2, threads, kept.append)
    try:
        if cut:
            with pytest.raises(Stalled):
                await stream.send([chunk])
            # The consumer reads again: there is room for an end frame now, mid-chunk.
            theirs.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                while theirs.recv(1 << 20):
                    pass
        else:
            await stream.send([chunk])
        await stream.finish()
        stream.close()  # as the servicer does on every exit: a no-op once handed back
        if cut:
            assert kept == [] and ours.fileno() == -1
        else:
            assert kept == [ours] and ours.fileno() != -1
            theirs.settimeout(5)
            frames, how = read_transfer(theirs)
            assert how == "end" and frames == [(7, payload.tobytes())]
    finally:
        threads.close()
        ours.close()
        theirs.close()


async def test_a_kept_connection_that_went_silent_costs_half_the_attempt_not_the_load() -> None:
    """A kept connection whose peer vanished without a word (its host gone, a NAT that forgot
    it) takes the ticket and never answers. The load gives it half of its connect attempt,
    then connects anew and still goes over TCP; TCP is not marked as failing."""
    async with running_producer(**SETTINGS) as server:
        expected = await asyncio.to_thread(park_all, server.target, ["s1", "s2"])
        with (
            socket.create_server(("127.0.0.1", 0)) as black_hole,
            KVConsumer(server.target, transport="tcp") as consumer,
        ):
            silent = socket.create_connection(black_hole.getsockname())
            key = ("127.0.0.1", server.data_port, False, None)
            consumer._core.data_connections.give(key, silent)
            for kid in ("s1", "s2"):
                result, landed = await asyncio.to_thread(load, consumer, kid)
                assert result.ok and result.transport == "tcp", result
                assert landed == expected[kid]
            assert silent.fileno() == -1  # given up and closed
        assert (server.data.accepted, server.data.reused) == (1, 1)


async def test_a_load_cancelled_while_its_kept_connection_is_tried_connects_no_more() -> None:
    """An async load cancelled while its ticket sits in a kept connection that does not answer
    ends there: it does not go on to a new connection and read a transfer nobody wants."""
    from kvpark import AsyncKVConsumer

    async with running_producer(**SETTINGS) as server:
        await asyncio.to_thread(park_all, server.target, ["c1"])
        with socket.create_server(("127.0.0.1", 0)) as black_hole:
            async with AsyncKVConsumer(server.target, transport="tcp") as consumer:
                silent = socket.create_connection(black_hole.getsockname())
                key = ("127.0.0.1", server.data_port, False, None)
                consumer._core.data_connections.give(key, silent)
                into = np.zeros(2 * CHUNK, np.uint8)
                loading = asyncio.ensure_future(consumer.load("c1", num_chunks=2, into=into))
                far_end, _ = await asyncio.to_thread(black_hole.accept)
                with far_end:
                    far_end.settimeout(10)
                    ticket = bytearray(32)
                    await asyncio.to_thread(recv_exactly, far_end, memoryview(ticket))
                    loading.cancel()  # the ticket is in the silent connection: cancel now
                    with pytest.raises(asyncio.CancelledError):
                        await loading
        await wait_until(lambda: server.lot.bound_count == 0, what="the Fetch cancelled")
        assert server.data.accepted == 0 and server.data.reused == 0
        server.lot.check_invariants()


def test_the_client_closes_what_it_keeps_too_long_or_beyond_its_limit() -> None:
    """The client's pool closes connections idle past its limit at its next use (here the
    limit is 0: everything kept is expired by then), keeps at most MAX_PER_ADDRESS per address,
    and hands out the newest first."""
    pairs = [socket.socketpair() for _ in range(_data_connections.MAX_PER_ADDRESS + 3)]
    try:
        mine = [a for a, _ in pairs]
        expiring = _data_connections.DataConnections(idle_s=0.0)
        expiring.give("k", mine[0])
        expiring.give("k", mine[1])
        assert mine[0].fileno() == -1 and expiring.take("k") is None and mine[1].fileno() == -1

        pool = _data_connections.DataConnections()
        for sock in mine[2:]:
            pool.give("k", sock)
        limit = _data_connections.MAX_PER_ADDRESS
        assert pool.idle("k") == limit and mine[-1].fileno() == -1  # one too many: closed
        assert pool.take("k") is mine[-2]
        pool.close()
        assert all(sock.fileno() == -1 for sock in mine[2:-2])
    finally:
        for a, b in pairs:
            a.close()
            b.close()


async def test_kept_connections_are_served_while_every_handshake_slot_is_taken() -> None:
    """MAX_HANDSHAKES connections that send nothing hold every handshake thread (for 5 s each)
    and one more waits in the backlog. A consumer's kept connection is still served at once;
    the waiting connection is refused once a slot frees, not lost. One host takes at most
    MAX_HANDSHAKES_PER_HOST slots, so the silent connections come from several loopback
    addresses."""
    from kvpark.producer.data_listener import MAX_HANDSHAKES, MAX_HANDSHAKES_PER_HOST

    def silent_from(n: int) -> socket.socket:
        sock = socket.socket()
        sock.bind((f"127.0.0.{2 + n // MAX_HANDSHAKES_PER_HOST}", 0))
        sock.connect(("127.0.0.1", server.data_port))
        return sock

    async with running_producer(**SETTINGS) as server:
        expected = await asyncio.to_thread(park_all, server.target, ["h1", "h2"])
        with KVConsumer(server.target, transport="tcp") as consumer:
            first, _ = await asyncio.to_thread(load, consumer, "h1")
            assert first.ok and first.transport == "tcp"
            await wait_until(lambda: server.data.idle == 1, what="the connection kept")
            silent = [silent_from(n) for n in range(MAX_HANDSHAKES + 1)]
            try:
                await wait_until(
                    lambda: not server.data.accepting, what="every handshake slot taken"
                )
                second, landed = await asyncio.to_thread(load, consumer, "h2")
                assert second.ok and second.transport == "tcp" and landed == expected["h2"]
                assert (server.data.accepted, server.data.reused) == (1, 1)
                # The handshakes time out; the one in the backlog gets its turn and its own.
                await wait_until(
                    lambda: server.data.refused == MAX_HANDSHAKES + 1,
                    timeout=30,
                    what="every silent connection refused",
                )
            finally:
                for sock in silent:
                    sock.close()


def test_a_connection_kept_for_an_address_no_longer_used_is_closed_by_any_next_use() -> None:
    """A connection kept for one data address is closed once idle past the limit when the
    client next uses any address, not only that one again: a client whose producer moved to
    another address (a restart elsewhere, a Service in front of several) does not hold the
    old connections half-closed for ever. (A pool's client of a producer that left the fleet
    gets no more loads: another client's use closes its connections, see the next test.)"""
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        (gone, _), (other, _) = pairs
        expiring = _data_connections.DataConnections(idle_s=0.0)
        expiring.give("producer-that-left", gone)
        assert expiring.take("another-producer") is None
        assert gone.fileno() == -1 and expiring.idle("producer-that-left") == 0
        expiring.give("producer-that-left", other)
        expiring.give("another-producer", pairs[0][1])
        assert other.fileno() == -1  # giving to another address expires it too
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_another_clients_use_closes_what_a_client_with_no_loads_keeps_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool's client of a producer that left the fleet gets no loads of its own: the next
    use of any other client in the process closes its connections idle past the limit."""
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        (departed_conn, _), (live_conn, _) = pairs
        departed = _data_connections.DataConnections(idle_s=0.0)
        departed.give("producer-that-left", departed_conn)
        live = _data_connections.DataConnections()
        monkeypatch.setattr(_data_connections, "_next_sweep", 0.0)  # a sweep is due
        live.give("producer-still-here", live_conn)
        assert departed_conn.fileno() == -1 and departed.idle("producer-that-left") == 0
        assert live.take("producer-still-here") is live_conn  # not expired: kept
    finally:
        for a, b in pairs:
            a.close()
            b.close()
