"""The TCP data connection's frame writer against real sockets: when the reader stops, `write`
gives up after the socket's timeout instead of blocking, and a later `write` resumes exactly
where it stopped, plain and over TLS (where a timed-out write must be retried with the same
bytes)."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tls_certs import make_certs

from kvpark.checksum import crc32c_of
from kvpark.tcp_frames import FrameWriter, recv_header, recv_payload

CHUNKS = 6
CHUNK_BYTES = 1 << 20


def frames() -> list[tuple[int, int, list[memoryview]]]:
    """Frames of 1 MiB, each payload in two views (the pool's extents)."""
    rng = np.random.default_rng(7)
    out = []
    for chunk_id in range(CHUNKS):
        data = memoryview(rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes())
        out.append((chunk_id, chunk_id * 11, [data[:1000], data[1000:]]))
    return out


def read_all(sock: socket.socket) -> list[tuple[int, int, bytes]]:
    got = []
    while (header := recv_header(sock)) is not None:
        chunk_id, crc32c, nbytes = header
        payload = bytearray(nbytes)
        view = memoryview(payload)
        # A scatter list whose parts split the payload where no read would: the CRC that
        # recv_payload computed piece by piece is the payload's.
        landed_crc = recv_payload(sock, [view[:777], view[777:]], nbytes)
        assert landed_crc == crc32c_of(payload)
        got.append((chunk_id, crc32c, bytes(payload)))
    return got


@pytest.fixture(params=["plain", "tls"])
def connection(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(writer side, reader side) of a loopback connection with small buffers, so a few
    frames fill it."""
    listener = socket.create_server(("127.0.0.1", 0))
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(listener.getsockname())
    writer, _ = listener.accept()
    listener.close()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    if request.param == "tls":
        certs = make_certs(tmp_path)
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(certs.server_cert, certs.server_key)
        client = ssl.create_default_context(cafile=str(certs.ca))
        with ThreadPoolExecutor(1) as pool:  # both ends of the handshake at once
            wrapped = pool.submit(server.wrap_socket, writer, server_side=True)
            reader = client.wrap_socket(reader, server_hostname="localhost")
            writer = wrapped.result(timeout=10)
    yield writer, reader
    writer.close()
    reader.close()


def test_a_write_to_a_reader_that_stops_pauses_and_resumes_where_it_stopped(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    writer_sock, reader_sock = connection
    writer_sock.settimeout(0.01)
    sent = frames()
    writer = FrameWriter(sent)

    assert writer.write(writer_sock) is False  # nobody reads: the socket filled, no block
    assert 0 < writer.sent_bytes < CHUNKS * CHUNK_BYTES
    # The kernel may still move a few bytes on from the socket's send queue to the reader's
    # receive queue, making room for a next write; once both are full, a write sends nothing.
    while True:
        paused_at = writer.sent_bytes
        assert writer.write(writer_sock) is False
        if writer.sent_bytes == paused_at:
            break
    assert paused_at < CHUNKS * CHUNK_BYTES
    assert writer.frames_written == paused_at // (16 + CHUNK_BYTES)  # whole frames only

    received: list[tuple[int, int, bytes]] = []
    reading = threading.Thread(target=lambda: received.extend(read_all(reader_sock)))
    reading.start()
    while not writer.write(writer_sock):  # each call goes on from the last
        pass
    writer_sock.close()  # the end of the frames, as the producer closes after the last
    reading.join(30)
    assert not reading.is_alive()
    assert received == [(cid, crc, b"".join(views)) for cid, crc, views in sent]
    assert writer.sent_bytes == CHUNKS * (16 + CHUNK_BYTES)
    assert writer.frames_written == CHUNKS


def test_a_write_gives_way_between_frames_and_resumes_where_it_stopped(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    """`give_way` is asked before each frame after the first bytes: once it says so, the
    call returns at that frame boundary, and the next call sends the rest."""
    writer_sock, reader_sock = connection
    writer_sock.settimeout(5)
    received: list[tuple[int, int, bytes]] = []
    reading = threading.Thread(target=lambda: received.extend(read_all(reader_sock)))
    reading.start()
    sent = frames()
    writer = FrameWriter(sent)
    asked: list[int] = []

    def after_two_frames(sent_by_this_call: int) -> bool:
        asked.append(sent_by_this_call)
        return sent_by_this_call >= 2 * (16 + CHUNK_BYTES)

    assert writer.write(writer_sock, after_two_frames) is False and writer.gave_way
    assert writer.sent_bytes == 2 * (16 + CHUNK_BYTES)  # exactly at a frame boundary
    assert writer.frames_written == 2
    assert asked == [0, 16 + CHUNK_BYTES, 2 * (16 + CHUNK_BYTES)]
    assert writer.write(writer_sock) is True and not writer.gave_way
    writer_sock.close()
    reading.join(30)
    assert not reading.is_alive()
    assert received == [(cid, crc, b"".join(views)) for cid, crc, views in sent]


def test_a_write_does_not_give_way_for_a_bare_end_frame(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    """After the last chunk only the end frame (no payload) is left: it goes out in the same
    call, or the consumer would wait a whole turn of the queue for 16 bytes."""
    writer_sock, reader_sock = connection
    writer_sock.settimeout(5)
    received: list[tuple[int, int, bytes]] = []
    reading = threading.Thread(target=lambda: received.extend(read_all(reader_sock)))
    reading.start()
    writer = FrameWriter([frames()[0], (0xFFFFFFFF, 0, [])])
    assert writer.write(writer_sock, lambda sent_by_this_call: sent_by_this_call > 0) is True
    assert not writer.gave_way and writer.sent_bytes == 2 * 16 + CHUNK_BYTES
    writer_sock.close()
    reading.join(30)
    assert [cid for cid, _, _ in received] == [0, 0xFFFFFFFF]
