"""Hand framing of the two data-path messages, byte-identical to the generated stubs.

Why: with protobuf's upb runtime, building a message, parsing one and every read of
`Chunk.data` copies the payload (performance-notes.md, lever 2). On the data path kvpark builds
`FetchResponse{chunk}` and `ParkRequest{chunk}` bytes itself and parses them with memoryviews,
so a payload is copied exactly once on each side (pool -> wire buffer; wire buffer -> caller's
buffer). Everything else (headers, TransferDone, unary calls) goes through the generated
classes.

The encoding is the canonical one (fields in number order, zero scalars omitted), so a client
or server using ordinary generated stubs in any language sees the same bytes; a test compares
against `SerializeToString()`. The parsers accept any valid protobuf encoding (any field order,
unknown fields skipped, last scalar wins), and raise `WireError` on anything malformed.

Field numbers (protos/kvpark/v1/kvpark.proto):
  Chunk         { chunk_id = 1 (varint); crc32c = 2 (fixed32); data = 3 (bytes) }
  FetchResponse { chunk = 1; done = 2 }
  ParkRequest   { header = 1; chunk = 2 }
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpark.pb import kvpark_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_CHUNK_ID_TAG = b"\x08"  # field 1, varint
_CRC_TAG = b"\x15"  # field 2, fixed32
_DATA_TAG = b"\x1a"  # field 3, length-delimited
_FETCH_CHUNK_TAG = b"\x0a"  # FetchResponse.chunk: field 1, length-delimited
_PARK_CHUNK_TAG = b"\x12"  # ParkRequest.chunk: field 2, length-delimited
_UINT32_MAX = 0xFFFFFFFF


class WireError(ValueError):
    """Bytes that are not a valid encoding of the expected message."""


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A parsed Chunk whose `data` is a view into the received buffer (no copy)."""

    chunk_id: int
    crc32c: int
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _chunk_prefix(chunk_id: int, crc32c: int, nbytes: int) -> bytes:
    """Chunk fields before the payload, then the payload's tag and length."""
    parts = []
    if chunk_id:
        parts.append(_CHUNK_ID_TAG + _varint(chunk_id))
    if crc32c:
        parts.append(_CRC_TAG + struct.pack("<I", crc32c))
    parts.append(_DATA_TAG + _varint(nbytes))
    return b"".join(parts)


def _frame(
    outer_tag: bytes, chunk_id: int, crc32c: int, payload: Sequence[memoryview | bytes]
) -> bytes:
    nbytes = sum(len(p) for p in payload)
    prefix = _chunk_prefix(chunk_id, crc32c, nbytes)
    body_len = len(prefix) + nbytes
    # One allocation, one copy of the payload: join concatenates views straight into the result.
    return b"".join((outer_tag, _varint(body_len), prefix, *payload))


def encode_fetch_chunk(chunk_id: int, crc32c: int, payload: Sequence[memoryview | bytes]) -> bytes:
    """`FetchResponse{chunk: Chunk{chunk_id, crc32c, data=concat(payload)}}` serialized."""
    return _frame(_FETCH_CHUNK_TAG, chunk_id, crc32c, payload)


def encode_park_chunk(chunk_id: int, crc32c: int, payload: Sequence[memoryview | bytes]) -> bytes:
    """`ParkRequest{chunk: Chunk{chunk_id, crc32c, data=concat(payload)}}` serialized."""
    return _frame(_PARK_CHUNK_TAG, chunk_id, crc32c, payload)


def encode_park_header(kv_request_id: str, total_chunks: int = 0, batch_bytes: int = 0) -> bytes:
    header = pb.ParkHeader(
        kv_request_id=kv_request_id, total_chunks=total_chunks, batch_bytes=batch_bytes
    )
    return pb.ParkRequest(header=header).SerializeToString()


def encode_done(done: pb.TransferDone) -> bytes:
    return pb.FetchResponse(done=done).SerializeToString()


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _fields(buf: memoryview) -> list[tuple[int, int, int | memoryview]]:
    """Splits one message into (field number, wire type, value) triples.

    LEN values are views into `buf`; varints/fixed are ints. Groups are rejected (proto3 has
    none)."""
    out: list[tuple[int, int, int | memoryview]] = []
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
            out.append((field, wire_type, value))
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            if length > end - pos:
                raise WireError(f"field {field}: length {length} runs past the message end")
            out.append((field, wire_type, buf[pos : pos + length]))
            pos += length
        elif wire_type == _I32:
            if pos + 4 > end:
                raise WireError(f"field {field}: truncated fixed32")
            out.append((field, wire_type, int.from_bytes(buf[pos : pos + 4], "little")))
            pos += 4
        elif wire_type == _I64:
            if pos + 8 > end:
                raise WireError(f"field {field}: truncated fixed64")
            out.append((field, wire_type, int.from_bytes(buf[pos : pos + 8], "little")))
            pos += 8
        else:
            raise WireError(f"field {field}: unsupported wire type {wire_type}")
    return out


def parse_chunk(buf: memoryview) -> ChunkView:
    """Parses a serialized Chunk; `data` stays a view into `buf`."""
    chunk_id = 0
    crc = 0
    data = buf[0:0]
    for field, wire_type, value in _fields(buf):
        if field == 1:
            if wire_type != _VARINT:
                raise WireError("Chunk.chunk_id: wrong wire type")
            assert isinstance(value, int)
            if value > _UINT32_MAX:
                # protobuf truncates an oversized uint32 varint to its low 32 bits.
                value &= _UINT32_MAX
            chunk_id = value
        elif field == 2:
            if wire_type != _I32:
                raise WireError("Chunk.crc32c: wrong wire type")
            assert isinstance(value, int)
            crc = value
        elif field == 3:
            if wire_type != _LEN:
                raise WireError("Chunk.data: wrong wire type")
            assert isinstance(value, memoryview)
            data = value
    return ChunkView(chunk_id, crc, data)


def _oneof(buf: bytes | memoryview, choices: dict[int, str]) -> tuple[str, memoryview] | None:
    """Returns (name, body view) of the last set oneof member, or None when none is set."""
    found: tuple[str, memoryview] | None = None
    for field, wire_type, value in _fields(memoryview(buf)):
        if field in choices:
            if wire_type != _LEN:
                raise WireError(f"{choices[field]}: wrong wire type")
            assert isinstance(value, memoryview)
            found = (choices[field], value)
    return found


def _parse_oneof(
    buf: bytes | memoryview, choices: dict[int, str], message_type: Any
) -> ChunkView | Any | None:
    """The set member of a oneof whose members are a Chunk (parsed as a view) and one small
    message (parsed by the generated class); None when no member is set."""
    member = _oneof(buf, choices)
    if member is None:
        return None
    name, body = member
    if name == "chunk":
        return parse_chunk(body)
    message = message_type()
    try:
        message.ParseFromString(bytes(body))
    except Exception as exc:  # protobuf raises its own DecodeError
        raise WireError(f"{message_type.DESCRIPTOR.name}: {exc}") from exc
    return message


def parse_park_request(buf: bytes | memoryview) -> pb.ParkHeader | ChunkView | None:
    """A ParkRequest as its header (a generated message) or its chunk (a view); None if empty."""
    result: pb.ParkHeader | ChunkView | None = _parse_oneof(
        buf, {1: "header", 2: "chunk"}, pb.ParkHeader
    )
    return result


def parse_fetch_response(buf: bytes | memoryview) -> ChunkView | pb.TransferDone | None:
    """A FetchResponse as its chunk (a view) or its TransferDone; None if empty."""
    result: ChunkView | pb.TransferDone | None = _parse_oneof(
        buf, {1: "chunk", 2: "done"}, pb.TransferDone
    )
    return result
