"""The producer's TCP data path when its peer misbehaves or the Fetch ends at a bad moment: a
ticket trickled in a byte at a time is refused once the handshake's time is up (not once per
byte), a Fetch cancelled while its write waits for a data thread leaves at once, a data
connection the consumer resets ends the Fetch UNAVAILABLE with the id kept, a connection that
arrives as its Fetch is cancelled is closed, a TLS consumer that reads slowly but steadily is
not taken for stalled, and cutting a TLS write off never drops the TLS layer under it. Real
sockets and threads throughout; the producer is real and in-process where one is needed."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import MiB, park, running_producer, state_of, stub_for, wait_until
from tls_certs import make_certs

from kvpark.address import Address
from kvpark.pb import kvpark_pb2 as pb
from kvpark.producer import data_listener
from kvpark.producer.data_listener import DataListener
from kvpark.producer.data_threads import DataThreads
from kvpark.producer.lot import ReadyChunk
from kvpark.producer.transports import Stalled, TcpStream
from kvpark.tcp_frames import ACCEPTED, TICKET_BYTES


def reader(sock: socket.socket, stop: threading.Event, got: list[int], pause_s: float) -> None:
    """A consumer that reads 16 KiB at a time, `pause_s` apart, until stopped or closed."""
    buf = bytearray(16 * 1024)
    while not stop.wait(pause_s):
        try:
            n = sock.recv_into(buf)
        except OSError:
            return
        if n == 0:
            return
        got[0] += n


def connected_pair(tmp_path: Path | None = None) -> tuple[socket.socket, socket.socket]:
    """(producer's end, consumer's end) over loopback with small buffers, so that a slow reader
    keeps the writer waiting; TLS when `tmp_path` is given."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        theirs = socket.socket()
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        theirs.connect(server.getsockname())
        ours, _ = server.accept()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    if tmp_path is None:
        return ours, theirs
    certs = make_certs(tmp_path)
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(certs.server_cert, certs.server_key)
    client_side = ssl.create_default_context(cafile=str(certs.ca))
    wrapped: list[ssl.SSLSocket] = []
    handshake = threading.Thread(
        target=lambda: wrapped.append(server_side.wrap_socket(ours, server_side=True))
    )
    handshake.start()
    theirs = client_side.wrap_socket(theirs, server_hostname="127.0.0.1")
    handshake.join()
    return wrapped[0], theirs


def one_chunk(nbytes: int, chunk_id: int = 0) -> ReadyChunk:
    data = np.zeros(nbytes, np.uint8)
    return ReadyChunk(chunk_id, 0, [memoryview(data)], nbytes)


async def test_a_ticket_trickled_past_the_handshake_timeout_is_refused() -> None:
    listener = DataListener(
        Address.parse("127.0.0.1:0"),
        tls=None,
        loop=asyncio.get_running_loop(),
        handshake_timeout_s=0.3,
    )
    port = listener.start()
    try:
        ticket, arrival = listener.expect()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            # One byte every 50 ms: each read sees a byte well within 0.3 s, the whole ticket
            # would take 1.6 s. The peer pacing itself is the point, not a wait for a result.
            sent = 0
            try:
                while sent < TICKET_BYTES - 1:
                    sock.sendall(ticket[sent : sent + 1])
                    sent += 1
                    await asyncio.sleep(0.05)
                sock.sendall(ticket[sent:])
                sent += 1
                answer = await asyncio.to_thread(sock.recv, 1)
            except ConnectionError:
                answer = b""
        assert answer != ACCEPTED and sent < TICKET_BYTES, (answer, sent)
        await wait_until(lambda: listener.refused == 1, what="the trickler refused")
        assert not arrival.done()
    finally:
        listener.stop()


async def test_a_fetch_cancelled_while_its_write_waits_for_a_thread_leaves_at_once() -> None:
    threads = DataThreads(1)
    slow_ours, slow_theirs = connected_pair()
    queued_ours, queued_theirs = socket.socketpair()
    stop, got = threading.Event(), [0]
    # Reads steadily, so its write never pauses long enough to give its thread back.
    consumer = threading.Thread(target=reader, args=(slow_theirs, stop, got, 0.002))
    consumer.start()
    slow = TcpStream(slow_ours, stall_s=30, threads=threads)
    queued = TcpStream(queued_ours, stall_s=30, threads=threads)
    holding = asyncio.create_task(slow.send([one_chunk(16 * MiB)]))
    waiting = asyncio.create_task(queued.send([one_chunk(MiB)]))
    try:
        await wait_until(lambda: got[0] > 0 and threads.waiting() == 1, what="a job queued")
        waiting.cancel()
        await wait_until(waiting.done, what="the queued write given up")
        assert waiting.cancelled()
        assert not holding.done(), "the slow consumer's write ended first: nothing was shown"
        assert threads.waiting() == 0
    finally:
        stop.set()
        holding.cancel()
        await asyncio.gather(holding, waiting, return_exceptions=True)
        consumer.join()
        for sock in (slow_theirs, queued_theirs):
            sock.close()
        slow.close()
        queued.close()
        threads.close()


async def test_a_data_connection_reset_mid_transfer_ends_unavailable_and_keeps_the_id() -> None:
    async with running_producer(data_listen="127.0.0.1:0", pool_bytes=64 * MiB) as server:
        async with stub_for(server) as stub:
            chunks = {i: bytes([i]) * (4 * MiB) for i in range(8)}
            assert (await park(stub, "k", chunks, total=8)).status == pb.STATUS_OK
            call = stub.Fetch(
                pb.FetchRequest(kv_request_id="k", accept_transports=[pb.TRANSPORT_TCP])
            )
            offer = (await call.read()).data_offer
            sock = await asyncio.to_thread(
                socket.create_connection, ("127.0.0.1", server.data_port), 5
            )
            sock.sendall(offer.ticket)
            assert await asyncio.to_thread(sock.recv, 1) == ACCEPTED
            await asyncio.to_thread(sock.recv, 4096)  # the transfer has started
            # The consumer's end goes away abruptly (RST); its gRPC call stays.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
            assert "data connection" in (ended.value.details() or "")
            state = await state_of(stub, "k")
            assert state.state == pb.STATE_PARKED and state.chunks_parked == 8, state


class RecordingContext:
    """The part of a grpc.aio servicer context `_open` uses before the data connection comes."""

    def __init__(self) -> None:
        self.wrote = asyncio.Event()

    async def write(self, _: bytes) -> None:
        self.wrote.set()


async def test_a_connection_arriving_as_its_fetch_is_cancelled_is_closed() -> None:
    async with running_producer(data_listen="127.0.0.1:0", pool_bytes=16 * MiB) as server:
        listener = server.data
        assert listener is not None
        arrivals: list[asyncio.Future[socket.socket]] = []
        expect = listener.expect

        def recording_expect() -> tuple[bytes, asyncio.Future[socket.socket]]:
            ticket, arrival = expect()
            arrivals.append(arrival)
            return ticket, arrival

        listener.expect = recording_expect  # type: ignore[method-assign]
        context = RecordingContext()
        request = pb.FetchRequest(kv_request_id="k", accept_transports=[pb.TRANSPORT_TCP])
        opening = asyncio.create_task(
            server.servicer._open(pb.TRANSPORT_TCP, None, request, None, context)
        )
        await context.wrote.wait()
        ours, theirs = socket.socketpair()
        # In one turn of the loop: the connection is handed over and the Fetch is cancelled.
        data_listener._deliver(arrivals[0], ours)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        assert ours.fileno() == -1, "the connection was left open"
        assert theirs.recv(1) == b""
        theirs.close()


async def test_a_tls_consumer_reading_slowly_but_steadily_is_not_stalled(
    tmp_path: Path,
) -> None:
    ours, theirs = connected_pair(tmp_path)
    stop, got = threading.Event(), [0]
    # ~1.6 MB/s: a 4 MiB view takes ~2.5 s, but room appears every 10 ms.
    consumer = threading.Thread(target=reader, args=(theirs, stop, got, 0.01))
    consumer.start()
    threads = DataThreads(1)
    stream = TcpStream(ours, stall_s=1.0, threads=threads)
    sending = asyncio.create_task(stream.send([one_chunk(4 * MiB)]))
    try:
        # Well past the stall bound, the write is still going and the consumer still reading.
        await wait_until(lambda: got[0] > 2 * MiB or sending.done(), what="2 MiB read")
        if sending.done():
            with pytest.raises(Stalled):  # the failure this test is about, shown plainly
                sending.result()
            pytest.fail("a steadily reading TLS consumer was cut off as stalled")
    finally:
        stop.set()
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
        consumer.join()
        stream.close()
        theirs.close()
        threads.close()


async def test_cutting_a_tls_write_off_keeps_the_tls_layer(tmp_path: Path) -> None:
    """`SSLSocket.shutdown` drops its SSL object before it shuts the socket down: a data
    thread's send in between would go out in clear. The cut-off must leave it in place."""
    ours, theirs = connected_pair(tmp_path)
    assert isinstance(ours, ssl.SSLSocket)
    threads = DataThreads(1)
    stream = TcpStream(ours, stall_s=30, threads=threads)
    try:
        stream._interrupt()
        assert ours._sslobj is not None  # type: ignore[attr-defined]
        assert theirs.recv(1) == b""  # yet the consumer sees the connection end
    finally:
        stream.close()
        theirs.close()
        threads.close()
