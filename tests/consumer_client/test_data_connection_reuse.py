"""Data connections kept between TCP loads: the wire (end frame, the next ticket on the same
connection, the close for consumers that do not ask), the bundled client's pool (one
connection for loads in a row, TLS included), and every way a kept connection goes away: the
client closes, the producer drops it while idle, or it dies just as the next ticket goes out.
Each load still gets its bytes over TCP, and the pool's invariants hold."""

from __future__ import annotations

import asyncio
import socket
import ssl
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MiB, running_producer, stub_for, wait_until

from kvpark import KVConsumer, KVParker
from kvpark.client import _data_connections
from kvpark.pb import kvpark_pb2 as pb
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
        assert server.data.idle == 1

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


async def test_a_load_cut_off_mid_transfer_keeps_no_connection() -> None:
    """A load that times out between frames closes its connection at both ends (it is not at
    a frame boundary the producer knows of); the next load connects anew."""
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
            with KVParker(server.target) as parker:
                assert (await asyncio.to_thread(parker.park, "half", {1: parts[1]})).ok
            whole, landed = await asyncio.to_thread(load, consumer, "half")
        assert whole.ok and whole.transport == "tcp"
        assert landed == b"".join(p.tobytes() for p in parts)
        assert (server.data.accepted, server.data.reused) == (2, 0)
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
            assert first.ok and server.data.idle == 1
            server.data.idle_timeout_s = 0.0
            await wait_until(lambda: server.data.idle == 0, what="the producer dropped it")
            second, landed = await asyncio.to_thread(load, consumer, "d2")
        assert second.ok and second.transport == "tcp" and landed == expected["d2"], second
        assert (server.data.accepted, server.data.reused) == (2, 0)
        server.lot.check_invariants()
