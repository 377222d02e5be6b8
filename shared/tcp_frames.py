"""The framing of the TCP data connection: how chunk bytes travel outside gRPC.

A consumer connects to the producer's data address and sends the 32-byte ticket its Fetch was
given; the producer answers one byte (ACCEPTED) once the ticket matched, then writes one frame
per chunk, in request order, and closes the connection after the last one (or keeps it,
below). The byte lets a consumer tell a data path that failed before it started (no byte:
fall back to the gRPC stream) from a transfer that ended (the call's TransferDone says how):

    frame = chunk_id u32 | crc32c u32 | nbytes u64   (16 bytes, little-endian) | payload

A consumer that keeps its data connections (FetchRequest.reuse_data_connection) gets an end
frame instead of the close: chunk id END_CHUNK_ID, crc 0, nbytes 0 (no chunk has that id:
chunk ids stop one below it, kvpark.ids). The connection is then idle at both ends and
carries the consumer's next ticket for this producer, which spares a later Fetch the connect,
the TLS handshake and TCP's window ramp.

The producer writes each frame with `sendmsg` of the header and the pool's own memoryviews
(the kernel copies them into the socket; nothing is copied in user space), and the consumer
reads the payload with `recv_into` straight into the place its destination gives for that
chunk. Both calls release the GIL, so they run on worker threads beside the event loop. Over
TLS, `sendmsg` is not available and each view goes through `send` instead.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable, Iterable, Sequence

from kvpark.checksum import crc32c_of
from kvpark.ids import MAX_CHUNKS

TICKET_BYTES = 32
ACCEPTED = b"\x01"
END_CHUNK_ID = MAX_CHUNKS  # one past the highest chunk id any id may hold
_HEADER = struct.Struct("<IIQ")
HEADER_BYTES = _HEADER.size
# sendmsg takes at most IOV_MAX buffers per call (1024 on Linux); a chunk has a few extents.
_IOV_MAX = 1024
# Over TLS, one `send` per at most this many bytes: CPython's SSL write is all or nothing and
# its socket timeout bounds the whole call, so a bigger view that times out counts no progress
# (and is retried with the very same slice, as OpenSSL requires).
_TLS_PIECE = 256 * 1024


class FrameError(ConnectionError):
    """The data connection broke the framing or ended inside a frame."""


def header(chunk_id: int, crc32c: int, nbytes: int) -> bytes:
    return _HEADER.pack(chunk_id, crc32c, nbytes)


def is_end(frame_header: tuple[int, int, int]) -> bool:
    """Whether a received header is the end frame of a kept connection."""
    return frame_header == (END_CHUNK_ID, 0, 0)


class FrameWriter:
    """Writes a sequence of frames to a socket that has a (short) timeout, resumably: `write`
    sends until every frame is out, or until the socket has had no room for its timeout, or,
    between two frames, until `give_way` says so; then it returns False, and a later `write`
    goes on exactly where this one stopped. So a writer whose consumer stops reading gives its
    thread back instead of blocking it, and a long write can share its thread.

    A timed-out call sent nothing (the socket first waits for room, then sends what fits),
    so the position stays exact. Over TLS, where sendmsg is not available, each view goes
    through `send`, at most _TLS_PIECE bytes at a time: a TLS write is all or nothing and
    its timeout bounds the whole call, so one piece that times out sent nothing and is
    retried with the very same piece, as OpenSSL requires."""

    def __init__(self, frames: Iterable[tuple[int, int, Sequence[memoryview]]]) -> None:
        self._frames = iter(frames)
        self._buffers: list[memoryview] = []  # what is left of the frame being written
        self._header_left = 0  # bytes of the current frame's header not sent yet
        self.sent_bytes = 0
        self.payload_bytes = 0  # of `sent_bytes`, chunk bytes (not frame headers)
        self.frames_written = 0  # frames sent whole, from the first
        self.gave_way = False  # the last `write` stopped because `give_way` said so

    def write(self, sock: socket.socket, give_way: Callable[[int], bool] | None = None) -> bool:
        """True once every frame is written; False when the socket had no room for its
        timeout, or when `give_way(bytes this call sent)`, asked before each next frame that
        carries a payload, was True (`gave_way`). Other socket errors (the consumer went away)
        propagate."""
        tls = isinstance(sock, ssl.SSLSocket)
        self.gave_way = False
        start = self.sent_bytes
        while True:
            if not self._buffers:
                frame = next(self._frames, None)
                if frame is None:
                    return True
                self._buffers = _frame_buffers(*frame)
                self._header_left = len(self._buffers[0])
                # Only before a frame with a payload: giving way for a bare end frame would
                # make the consumer wait a whole turn of the queue for 16 bytes.
                payload = len(self._buffers) > 1
                if payload and give_way is not None and give_way(self.sent_bytes - start):
                    self.gave_way = True
                    return False
            try:
                sent = (
                    sock.send(self._buffers[0][:_TLS_PIECE])
                    if tls
                    else sock.sendmsg(self._buffers[:_IOV_MAX])
                )
            except TimeoutError:
                return False
            self.sent_bytes += sent
            # A send never spans two frames (`_buffers` holds one), so it is the rest of this
            # frame's header first, then payload.
            header = min(sent, self._header_left)
            self._header_left -= header
            self.payload_bytes += sent - header
            _consume(self._buffers, sent)
            if not self._buffers:
                self.frames_written += 1


def _frame_buffers(chunk_id: int, crc32c: int, views: Sequence[memoryview]) -> list[memoryview]:
    nbytes = sum(len(v) for v in views)
    return [memoryview(header(chunk_id, crc32c, nbytes)), *views]


def _consume(buffers: list[memoryview], sent: int) -> None:
    """Drops the first `sent` bytes from `buffers` (a send may stop anywhere)."""
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
    _fill(sock, view, checksum=False)


def _fill(sock: socket.socket, view: memoryview, *, checksum: bool, crc: int = 0) -> int:
    """Fills `view`; with `checksum`, returns `crc` extended by its bytes, each piece
    checksummed the moment a read returns it, while it is still in the cache: a CRC pass over
    a whole chunk after it landed reads part of it back from memory (2-8 % more receiver CPU
    per GB, measured in interleaved loads)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the data connection ended {len(view) - got} bytes early")
        if checksum:
            crc = crc32c_of(view[got : got + n], crc)
        got += n
    return crc


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


def recv_payload(sock: socket.socket, parts: Sequence[memoryview], nbytes: int) -> int:
    """Reads `nbytes` of payload straight into `parts`, in order (a scatter list); returns
    the CRC32C of what landed."""
    left, crc = nbytes, 0
    for part in parts:
        if not left:
            break
        take = min(len(part), left)
        crc = _fill(sock, part[:take], checksum=True, crc=crc)
        left -= take
    if left:
        raise FrameError(f"the destination has {nbytes - left} of the chunk's {nbytes} bytes")
    return crc
