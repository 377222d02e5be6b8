"""Hand framing of the data-path messages, byte-identical to the generated stubs.

Why: with protobuf's upb runtime, building a message, parsing one and every read of
`Chunk.data` copies the payload. On the data path kvpark builds `FetchResponse{chunk}` and
`ParkRequest{chunk}` bytes itself and parses them with memoryviews, so a payload is copied
exactly once on each side (pool -> wire buffer; wire buffer -> caller's buffer). Everything
else (headers, commits, TransferDone, unary calls) goes through the generated classes.

Encoding is canonical (fields in number order, unset fields omitted), so a peer using
ordinary generated stubs in any language sees the same bytes; a test compares against
`SerializeToString()`.

Parsing reads exactly what protobuf reads, or refuses. Protobuf's rules for what we accept:
the last occurrence of a scalar or bytes field wins; a message field that occurs again is
merged with the earlier occurrence, which is the same as parsing the concatenation of both
bodies; a oneof member replaces whichever other member was set before it; unknown fields are
skipped. What protobuf would accept but we refuse with `WireError` (the producer answers
INVALID_ARGUMENT): a known field with another wire type than its declared one (in a Chunk,
and in every member of a ParkRequest), groups, field numbers outside protobuf's range, and a
message of more than MAX_FIELDS_PER_MESSAGE fields. A property test holds the two readings
together.

Field numbers (protos/kvpark/v1/kvpark.proto) written by hand here:
  Chunk         { chunk_id = 1 (varint); optional crc32c = 2 (fixed32); data = 3 (bytes) }
  FetchResponse { chunk = 1; ... }
  ParkRequest   { header = 1; chunk = 2; ... }
The other members of the two oneofs are read by the numbers the generated descriptors give.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvpark.pb import kvpark_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_CHUNK_ID_TAG = b"\x08"  # field 1, varint
_CRC_TAG = b"\x15"  # field 2, fixed32
_DATA_TAG = b"\x1a"  # field 3, length-delimited
_FETCH_CHUNK_TAG = b"\x0a"  # FetchResponse.chunk: field 1, length-delimited
_PARK_CHUNK_TAG = b"\x12"  # ParkRequest.chunk: field 2, length-delimited
_UINT32_MAX = 0xFFFFFFFF
_UINT64_MAX = 0xFFFFFFFFFFFFFFFF
_MAX_FIELD_NUMBER = 2**29 - 1
# Fields one message may have, counted over its whole parse (the top level, every body of its
# member and the messages in those). The walks run in Python, ~2-3 µs per field, on the
# producer's event loop: unbounded, one message of the receive limit made of empty unknown
# fields (millions of them in a few MB) would hold every other call for seconds. A Park
# message of kvpark's has at most ~1,300 (a ChunkRefs of 256 references, 5 fields each). Of a
# FetchResponse only the top level and a Chunk are walked: a ChunksPlaced (up to 1,024
# placements, ~5,100 fields) is the producer's, parsed by protobuf alone.
MAX_FIELDS_PER_MESSAGE = 2048
# Declared wire type of every field we read by hand; any other wire type is refused.
_CHUNK_WIRE_TYPES = {1: _VARINT, 2: _I32, 3: _LEN}


class WireError(ValueError):
    """Bytes that are not a valid encoding of the expected message."""


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A parsed Chunk whose `data` is a view into the received buffer (no copy). `crc32c` is
    None when the message did not carry one."""

    chunk_id: int
    crc32c: int | None
    data: memoryview


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _chunk_prefix(chunk_id: int, crc32c: int | None, nbytes: int) -> bytes:
    """Chunk fields before the payload, then the payload's tag and length."""
    parts = []
    if chunk_id:
        parts.append(_CHUNK_ID_TAG + _varint(chunk_id))
    if crc32c is not None:  # explicit presence: a CRC of 0 is sent too
        parts.append(_CRC_TAG + struct.pack("<I", crc32c))
    parts.append(_DATA_TAG + _varint(nbytes))
    return b"".join(parts)


def _frame(
    outer_tag: bytes, chunk_id: int, crc32c: int | None, payload: Sequence[memoryview | bytes]
) -> bytes:
    nbytes = sum(len(p) for p in payload)
    prefix = _chunk_prefix(chunk_id, crc32c, nbytes)
    body_len = len(prefix) + nbytes
    # One allocation, one copy of the payload: join concatenates views straight into the result.
    return b"".join((outer_tag, _varint(body_len), prefix, *payload))


def encode_fetch_chunk(chunk_id: int, crc32c: int, payload: Sequence[memoryview | bytes]) -> bytes:
    """`FetchResponse{chunk: Chunk{chunk_id, crc32c, data=concat(payload)}}` serialized."""
    return _frame(_FETCH_CHUNK_TAG, chunk_id, crc32c, payload)


def encode_park_chunk(
    chunk_id: int, crc32c: int | None, payload: Sequence[memoryview | bytes]
) -> bytes:
    """`ParkRequest{chunk: Chunk{chunk_id, crc32c, data=concat(payload)}}` serialized."""
    return _frame(_PARK_CHUNK_TAG, chunk_id, crc32c, payload)


def encode_park_header(kv_request_id: str, total_chunks: int = 0, batch_bytes: int = 0) -> bytes:
    header = pb.ParkHeader(
        kv_request_id=kv_request_id, total_chunks=total_chunks, batch_bytes=batch_bytes
    )
    return pb.ParkRequest(header=header).SerializeToString()


def encode_park_commit(chunks: int, nbytes: int) -> bytes:
    return pb.ParkRequest(commit=pb.ParkCommit(chunks=chunks, bytes=nbytes)).SerializeToString()


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
            if result > _UINT64_MAX:
                raise WireError("varint larger than 64 bits")
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


class _FieldBudget:
    """The fields a message's parse may still walk (MAX_FIELDS_PER_MESSAGE in all)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_FIELDS_PER_MESSAGE


def _fields(buf: memoryview, budget: _FieldBudget) -> list[tuple[int, int, int | memoryview]]:
    """Splits one message into (field number, wire type, value) triples, each counted against
    `budget`.

    LEN values are views into `buf`; varints/fixed are ints. Groups are refused (proto3 has
    none)."""
    out: list[tuple[int, int, int | memoryview]] = []
    pos = 0
    end = len(buf)
    while pos < end:
        budget.left -= 1
        if budget.left < 0:
            raise WireError(f"more than {MAX_FIELDS_PER_MESSAGE} fields in one message")
        key, pos = _read_varint(buf, pos)
        field, wire_type = key >> 3, key & 7
        if not 0 < field <= _MAX_FIELD_NUMBER:
            raise WireError(f"field number {field} out of range")
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


def parse_chunk(*bodies: memoryview, budget: _FieldBudget | None = None) -> ChunkView:
    """A Chunk from one serialized body, or from several that protobuf merges (the same as
    their concatenation): the last occurrence of each field wins. `data` stays a view."""
    budget = budget or _FieldBudget()
    chunk_id = 0
    crc: int | None = None
    data = memoryview(b"")
    for body in bodies:
        for field, wire_type, value in _fields(body, budget):
            declared = _CHUNK_WIRE_TYPES.get(field)
            if declared is None:
                continue  # unknown field: skipped, as protobuf does
            if wire_type != declared:
                raise WireError(f"Chunk field {field}: wire type {wire_type}, not {declared}")
            if field == 1:
                assert isinstance(value, int)
                chunk_id = value & _UINT32_MAX  # protobuf keeps a uint32's low 32 bits
            elif field == 2:
                assert isinstance(value, int)
                crc = value
            else:
                assert isinstance(value, memoryview)
                data = value
    return ChunkView(chunk_id, crc, data)


def _oneof(
    buf: bytes | memoryview, choices: dict[int, str], budget: _FieldBudget
) -> tuple[str, list[memoryview]]:
    """The oneof member set at the end of the message, with the bodies that make it up: a
    member replaces any other set before it, and repeats of the same member merge."""
    name = ""
    bodies: list[memoryview] = []
    for field, wire_type, value in _fields(memoryview(buf), budget):
        member = choices.get(field)
        if member is None:
            continue
        if wire_type != _LEN:
            raise WireError(f"{member}: wire type {wire_type}, not length-delimited")
        assert isinstance(value, memoryview)
        if member != name:
            name, bodies = member, []
        bodies.append(value)
    return name, bodies


_FIXED64_TYPES = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64,
                  FieldDescriptor.TYPE_SFIXED64}  # fmt: skip
_FIXED32_TYPES = {FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32,
                  FieldDescriptor.TYPE_SFIXED32}  # fmt: skip
_LEN_TYPES = {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES,
              FieldDescriptor.TYPE_MESSAGE}  # fmt: skip


@functools.cache
def _wire_types(descriptor: Descriptor) -> dict[int, tuple[frozenset[int], Descriptor | None]]:
    """Field number -> (the wire types protobuf writes it with, its message type if any). A
    repeated number may also come packed, length-delimited."""
    out = {}
    for field in descriptor.fields:
        if field.type in _LEN_TYPES:
            wire = _LEN
        elif field.type in _FIXED64_TYPES:
            wire = _I64
        elif field.type in _FIXED32_TYPES:
            wire = _I32
        else:
            wire = _VARINT  # the integer types, bool, enum (a group is refused by _fields)
        allowed = {wire, _LEN} if field.is_repeated else {wire}
        out[field.number] = (frozenset(allowed), field.message_type)
    return out


def _check_wire_types(descriptor: Descriptor, body: memoryview, budget: _FieldBudget) -> None:
    """Refuses a known field of `body` (and of the messages in it) with another wire type
    than its declaration's, as parse_chunk does: protobuf would keep it as an unknown field
    and parse the message as if the field were unset."""
    declared = _wire_types(descriptor)
    for field, wire_type, value in _fields(body, budget):
        known = declared.get(field)
        if known is None:
            continue  # unknown field: skipped, as protobuf does
        allowed, message_type = known
        if wire_type not in allowed:
            raise WireError(f"{descriptor.name} field {field}: wire type {wire_type}")
        if message_type is not None:
            assert isinstance(value, memoryview)
            _check_wire_types(message_type, value, budget)


def _merged(message_type: Any, bodies: list[memoryview]) -> Any:
    message = message_type()
    try:
        for body in bodies:
            message.MergeFromString(bytes(body))
    except Exception as exc:  # protobuf raises its own DecodeError
        raise WireError(f"{message_type.DESCRIPTOR.name}: {exc}") from exc
    return message


def _oneof_members(message: Any) -> dict[int, str]:
    """Field number -> name of each member of the message's `kind` oneof."""
    return {f.number: f.name for f in message.DESCRIPTOR.oneofs_by_name["kind"].fields}


_PARK_MEMBERS = _oneof_members(pb.ParkRequest)
_FETCH_MEMBERS = _oneof_members(pb.FetchResponse)
# The small oneof members, parsed by the generated classes.
_PARK_MESSAGES: dict[str, Any] = {
    "header": pb.ParkHeader,
    "commit": pb.ParkCommit,
    "chunk_refs": pb.ChunkRefs,
}
_FETCH_MESSAGES: dict[str, Any] = {
    "done": pb.TransferDone,
    "data_offer": pb.DataOffer,
    "placed": pb.ChunksPlaced,
}
ParkMessage = pb.ParkHeader | ChunkView | pb.ParkCommit | pb.ChunkRefs
FetchMessage = ChunkView | pb.TransferDone | pb.DataOffer | pb.ChunksPlaced


# Chunk references per ChunkRefs message, and the bytes such a message may take (a ChunkRef
# encodes in at most 36). The producer parses a message and starts its copies on its event
# loop, ~15 µs per reference: unbounded, one message of the received-message limit (millions
# of references) would hold every other call for tens of seconds. The bundled clients send 64.
MAX_REFS_PER_MESSAGE = 256
MAX_CHUNK_REFS_BYTES = MAX_REFS_PER_MESSAGE * 64


def parse_park_request(buf: bytes | memoryview) -> ParkMessage | None:
    """A ParkRequest as its chunk (a view) or its other member (a generated message); None
    when no member is set."""
    budget = _FieldBudget()
    name, bodies = _oneof(buf, _PARK_MEMBERS, budget)
    if name == "chunk":
        return parse_chunk(*bodies, budget=budget)
    if not name:
        return None
    message_type = _PARK_MESSAGES[name]
    refs = _chunk_refs(bodies) if name == "chunk_refs" else None
    # Walked (bounded by the budget) before protobuf parses a member of unbounded size: its C
    # parser takes ~0.1 s for a 30 MB body of empty unknown fields.
    for body in bodies:
        _check_wire_types(message_type.DESCRIPTOR, body, budget)
    message: ParkMessage = refs if refs is not None else _merged(message_type, bodies)
    return message


def _chunk_refs(bodies: list[memoryview]) -> pb.ChunkRefs:
    """A ChunkRefs within the per-message bounds: sized before anything walks it, then
    parsed (protobuf's C parser, cheap at that size) and counted."""
    if sum(len(body) for body in bodies) > MAX_CHUNK_REFS_BYTES:
        raise WireError(
            f"ChunkRefs of more than {MAX_CHUNK_REFS_BYTES} bytes: at most "
            f"{MAX_REFS_PER_MESSAGE} references per message, send the rest in more"
        )
    refs: pb.ChunkRefs = _merged(pb.ChunkRefs, bodies)
    if len(refs.refs) > MAX_REFS_PER_MESSAGE:
        raise WireError(
            f"ChunkRefs names {len(refs.refs)} chunks: at most {MAX_REFS_PER_MESSAGE} "
            "per message, send the rest in more"
        )
    return refs


def parse_fetch_response(buf: bytes | memoryview) -> FetchMessage | None:
    """A FetchResponse as its chunk (a view) or its other member (a generated message); None
    when no member is set."""
    budget = _FieldBudget()
    name, bodies = _oneof(buf, _FETCH_MEMBERS, budget)
    if name == "chunk":
        return parse_chunk(*bodies, budget=budget)
    if name:
        message: FetchMessage = _merged(_FETCH_MESSAGES[name], bodies)
        return message
    return None
