"""A minimal raw HTTP/2 client that opens gRPC streams with HEADERS and never sends a message:
what a peer does to hold server calls open. It answers the server's SETTINGS and PINGs (so
keepalive never closes the connection) and records which streams the server ended. Plain
sockets and hand-built frames; response headers are not decoded (no HPACK state is kept)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

_DATA_FRAME, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4


def _int7(n: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (the string-length form, Huffman bit clear)."""
    if n < 127:
        return bytes([n])
    out = [127]
    n -= 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman: needs no table."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _int7(len(raw_name)) + raw_name + _int7(len(raw_value)) + raw_value


def _frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    header = struct.pack("!I", len(payload))[1:] + bytes([ftype, flags])
    return header + struct.pack("!I", stream_id) + payload


class HeadersOnlyClient:
    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._lock = threading.Lock()
        self._next_id = 1
        self.ended: set[int] = set()  # streams the server closed (END_STREAM or RST_STREAM)
        self.closed = False  # the connection ended (GOAWAY, EOF or an error)
        self._send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(_SETTINGS, 0, 0))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def open_stream(
        self, path: str, authority: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> int:
        """Opens a gRPC call on `path` and sends nothing after its HEADERS."""
        stream_id = self._next_id
        self._next_id += 2
        fields = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        block = b"".join(_literal(k, v) for k, v in fields)
        self._send(_frame(_HEADERS, _END_HEADERS, stream_id, block))  # no END_STREAM
        return stream_id

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(timeout=10)

    def _send(self, data: bytes) -> None:
        with self._lock:
            self._sock.sendall(data)

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self._sock.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed by the server")
            buf += got
        return buf

    def _read(self) -> None:
        try:
            while True:
                head = self._recv(9)
                length = int.from_bytes(head[:3], "big")
                ftype, flags = head[3], head[4]
                stream_id = struct.unpack("!I", head[5:])[0] & 0x7FFFFFFF
                payload = self._recv(length)
                if ftype == _SETTINGS and not flags & _ACK:
                    self._send(_frame(_SETTINGS, _ACK, 0))
                elif ftype == _PING and not flags & _ACK:
                    self._send(_frame(_PING, _ACK, 0, payload))
                elif ftype == _RST_STREAM or (
                    ftype in (_HEADERS, _DATA_FRAME) and flags & _END_STREAM
                ):
                    self.ended.add(stream_id)
                elif ftype == _GOAWAY:
                    self.closed = True
        except (OSError, ConnectionError):
            self.closed = True
