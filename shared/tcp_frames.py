"""The framing of the TCP data connection: how chunk bytes travel outside gRPC.

A consumer connects to the producer's data address and sends the 32-byte ticket its Fetch was
given; the producer answers one byte (ACCEPTED) once the ticket matched, then writes one frame
per chunk, in request order, and closes the connection after the last one. The byte lets a
consumer tell a data path that failed before it started (no byte: fall back to the gRPC
stream) from a transfer that ended (the call's TransferDone says how):

    frame = chunk_id u32 | crc32c u32 | nbytes u64   (16 bytes, little-endian) | payload

The producer writes each frame with one `sendmsg` of the header and the pool's own memoryviews
(the kernel copies them into the socket; nothing is copied in user space), and the consumer
reads the payload with `recv_into` straight into the place its destination gives for that
chunk. Both calls release the GIL, so they run on worker threads beside the event loop. Over
TLS, `sendmsg` is not available and each view goes through `sendall` instead.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence

TICKET_BYTES = 32
ACCEPTED = b"\x01"
_HEADER = struct.Struct("<IIQ")
HEADER_BYTES = _HEADER.size
# sendmsg takes at most IOV_MAX buffers per call (1024 on Linux); a chunk has a few extents.
_IOV_MAX = 1024


class FrameError(ConnectionError):
    """The data connection broke the framing or ended inside a frame."""


def header(chunk_id: int, crc32c: int, nbytes: int) -> bytes:
    return _HEADER.pack(chunk_id, crc32c, nbytes)


def send_frame(
    sock: socket.socket, chunk_id: int, crc32c: int, views: Sequence[memoryview]
) -> None:
    """Writes one frame: its header and the payload views, without copying them."""
    nbytes = sum(len(v) for v in views)
    buffers: list[memoryview] = [memoryview(header(chunk_id, crc32c, nbytes)), *views]
    if isinstance(sock, ssl.SSLSocket):
        for buffer in buffers:
            sock.sendall(buffer)
        return
    while buffers:
        sent = sock.sendmsg(buffers[:_IOV_MAX])
        # A blocking sendmsg may stop short (a timeout, a signal): resume where it stopped.
        while sent and buffers:
            first = buffers[0]
            if sent >= len(first):
                sent -= len(first)
                buffers.pop(0)
            else:
                buffers[0] = first[sent:]
                sent = 0


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from the socket; FrameError if the connection ends first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the data connection ended {len(view) - got} bytes early")
        got += n


def recv_header(sock: socket.socket) -> tuple[int, int, int] | None:
    """The next frame's (chunk_id, crc32c, nbytes), or None when the producer closed the
    connection cleanly between frames."""
    raw = bytearray(HEADER_BYTES)
    view = memoryview(raw)
    first = sock.recv_into(view)
    if first == 0:
        return None
    if first < HEADER_BYTES:
        recv_exactly(sock, view[first:])
    chunk_id, crc32c, nbytes = _HEADER.unpack(raw)
    return chunk_id, crc32c, nbytes


def recv_payload(sock: socket.socket, parts: Sequence[memoryview], nbytes: int) -> None:
    """Reads `nbytes` of payload straight into `parts`, in order (a scatter list)."""
    left = nbytes
    for part in parts:
        if not left:
            break
        take = min(len(part), left)
        recv_exactly(sock, part[:take])
        left -= take
    if left:
        raise FrameError(f"the destination has {nbytes - left} of the chunk's {nbytes} bytes")
