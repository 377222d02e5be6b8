"""The committed stubs match the proto, import from the installed package, and the hand-built
data-path frames are byte-identical to what the generated classes produce."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


def _protogen() -> object:
    """scripts/protogen.py, a development tool that is not part of the installed package."""
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    protogen: Any = _protogen()
    fresh = protogen.generate(tmp_path)
    for name, text in fresh.items():
        committed = (protogen.OUT_DIR / name).read_text()
        assert committed == text, f"shared/pb/{name} is stale: run `python scripts/protogen.py`"


def test_stubs_import_outside_the_source_tree(tmp_path: Path) -> None:
    code = "from kvpark.pb import kvpark_pb2_grpc; print(kvpark_pb2_grpc.KVProducerStub.__name__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "KVProducerStub"


@given(
    chunk_id=st.integers(0, 2**32 - 1),
    crc=st.none() | st.integers(0, 2**32 - 1),
    data=st.binary(min_size=1, max_size=4096),
    split=st.integers(0, 4096),
)
def test_hand_frames_equal_generated_serialization(
    chunk_id: int, crc: int | None, data: bytes, split: int
) -> None:
    parts = [memoryview(data)[:split], memoryview(data)[split:]]
    chunk = pb.Chunk(chunk_id=chunk_id, crc32c=crc, data=data)
    assert chunk.HasField("crc32c") == (crc is not None)
    assert (
        wire.encode_park_chunk(chunk_id, crc, parts)
        == pb.ParkRequest(chunk=chunk).SerializeToString()
    )
    if crc is not None:
        assert (
            wire.encode_fetch_chunk(chunk_id, crc, parts)
            == pb.FetchResponse(chunk=chunk).SerializeToString()
        )
    parsed = wire.parse_fetch_response(pb.FetchResponse(chunk=chunk).SerializeToString())
    assert isinstance(parsed, wire.ChunkView)
    assert (parsed.chunk_id, parsed.crc32c, bytes(parsed.data)) == (chunk_id, crc, data)


def test_a_crc_of_zero_is_present_and_an_absent_one_is_none() -> None:
    zero = wire.parse_park_request(wire.encode_park_chunk(3, 0, [b"abc"]))
    absent = wire.parse_park_request(wire.encode_park_chunk(3, None, [b"abc"]))
    assert isinstance(zero, wire.ChunkView) and zero.crc32c == 0
    assert isinstance(absent, wire.ChunkView) and absent.crc32c is None


def test_a_repeated_chunk_merges_as_protobuf_does() -> None:
    """chunk{id 0, crc of "a...", data "a..."} then chunk{data "b..."}: protobuf reads chunk 0
    with the CRC of the a's and the b's as data, a CRC mismatch, not a chunk without CRC."""
    a, b = b"a" * 64, b"b" * 64
    raw = (
        pb.ParkRequest(chunk=pb.Chunk(chunk_id=0, crc32c=crc32c_of(a), data=a)).SerializeToString()
        + pb.ParkRequest(chunk=pb.Chunk(data=b)).SerializeToString()
    )
    reference = pb.ParkRequest.FromString(raw)
    parsed = wire.parse_park_request(raw)
    assert isinstance(parsed, wire.ChunkView)
    assert bytes(parsed.data) == reference.chunk.data == b
    assert parsed.crc32c == reference.chunk.crc32c == crc32c_of(a)
    assert parsed.crc32c != crc32c_of(bytes(parsed.data))


def _park_messages() -> st.SearchStrategy[bytes]:
    chunk = st.builds(
        lambda cid, crc, data: pb.ParkRequest(chunk=pb.Chunk(chunk_id=cid, crc32c=crc, data=data)),
        st.integers(0, 2**32 - 1),
        st.none() | st.integers(0, 2**32 - 1),
        st.binary(max_size=32),
    )
    header = st.builds(
        lambda kid, total, size: pb.ParkRequest(
            header=pb.ParkHeader(kv_request_id=kid, total_chunks=total, batch_bytes=size)
        ),
        st.text(max_size=8),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
    )
    commit = st.builds(
        lambda n, size: pb.ParkRequest(commit=pb.ParkCommit(chunks=n, bytes=size)),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**64 - 1),
    )
    return st.one_of(chunk, header, commit, st.just(pb.ParkRequest())).map(
        lambda m: m.SerializeToString()
    )


def _fields_of(raw: bytes) -> list[bytes]:
    """The encoded fields of a serialized message, each as its own bytes (tag included)."""
    view = memoryview(raw)
    out, pos = [], 0
    while pos < len(raw):
        start = pos
        key, pos = wire._read_varint(view, pos)
        kind = key & 7
        if kind == 0:
            _, pos = wire._read_varint(view, pos)
        elif kind == 2:
            length, pos = wire._read_varint(view, pos)
            pos += length
        else:
            pos += 4 if kind == 5 else 8
        out.append(raw[start:pos])
    return out


def _same_reading(raw: bytes) -> None:
    """wire reads `raw` as protobuf does, or refuses it; never something else."""
    try:
        reference = pb.ParkRequest.FromString(raw)
    except Exception:
        reference = None
    try:
        parsed = wire.parse_park_request(raw)
    except wire.WireError:
        return  # refused: allowed
    assert reference is not None, "wire read what protobuf refuses"
    member = reference.WhichOneof("kind")
    if member is None:
        assert parsed is None
    elif member == "chunk":
        assert isinstance(parsed, wire.ChunkView)
        chunk = reference.chunk
        expected_crc = chunk.crc32c if chunk.HasField("crc32c") else None
        assert (parsed.chunk_id, parsed.crc32c, bytes(parsed.data)) == (
            chunk.chunk_id,
            expected_crc,
            chunk.data,
        )
    else:
        assert parsed == getattr(reference, member)


@given(st.lists(_park_messages(), min_size=1, max_size=5))
def test_concatenated_messages_read_as_protobuf_reads_them(messages: list[bytes]) -> None:
    _same_reading(b"".join(messages))


@given(st.lists(_park_messages(), min_size=1, max_size=3), st.data())
def test_repeated_fields_read_as_protobuf_reads_them(messages: list[bytes], data: Any) -> None:
    """Fields of the outer message and of the chunk inside it, repeated and reordered."""
    fields = [f for m in messages for f in _fields_of(m)]
    picks = data.draw(st.lists(st.sampled_from(fields), max_size=8)) if fields else []
    _same_reading(b"".join(fields + picks))
    for raw in messages:
        message = pb.ParkRequest.FromString(raw)
        if message.WhichOneof("kind") != "chunk":
            continue
        inner = _fields_of(message.chunk.SerializeToString())
        if not inner:
            continue
        repeated = data.draw(st.lists(st.sampled_from(inner), min_size=1, max_size=6))
        body = b"".join(inner + repeated)
        _same_reading(b"\x12" + wire._varint(len(body)) + body)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_read_as_protobuf_reads_them_or_refused(raw: bytes) -> None:
    _same_reading(raw)


def test_parsers_accept_any_field_order_and_skip_unknown_fields() -> None:
    # data first, then crc, then chunk_id, plus an unknown varint field 9
    body = b"\x1a\x03abc" + b"\x15\x01\x00\x00\x00" + b"\x08\x07" + b"\x48\x01"
    parsed = wire.parse_park_request(b"\x12" + bytes([len(body)]) + body)
    assert isinstance(parsed, wire.ChunkView)
    assert (parsed.chunk_id, parsed.crc32c, bytes(parsed.data)) == (7, 1, b"abc")
    done = wire.parse_fetch_response(
        wire.encode_done(pb.TransferDone(status=pb.STATUS_OK, chunks_sent=2))
    )
    assert isinstance(done, pb.TransferDone) and done.chunks_sent == 2
    assert wire.parse_fetch_response(b"") is None


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x05ab",
        b"\x12\x80",
        b"\x00",
        b"\x12\x02\x08",
        b"\x12\x03\x0a\x01x",
        b"\x0b",
        b"\x12\x02\x15\x01",
    ],
)
def test_malformed_frames_raise_wire_error(raw: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.parse_park_request(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x03\x12\x01x",  # header: total_chunks (a varint) length-delimited
        b"\x0a\x05\x15\x01\x00\x00\x00",  # header: total_chunks as a fixed32
        b"\x0a\x02\x2b\x2c",  # header: a group
        b"\x1a\x05\x0d\x01\x00\x00\x00",  # commit: chunks (a varint) as a fixed32
        b"\x1a\x02\x2b\x2c",  # commit: a group
        b"\x2a\x07\x0a\x05\x1d\x01\x00\x00\x00",  # chunk_refs: a ref's offset as a fixed32
    ],
)
def test_every_park_member_refuses_a_known_field_of_another_wire_type(raw: bytes) -> None:
    """Protobuf would keep such a field as unknown and read the message as if it were unset
    (a header's total_chunks silently 0); kvpark refuses it, as it does inside a Chunk."""
    with pytest.raises(wire.WireError):
        wire.parse_park_request(raw)


def test_park_members_still_skip_unknown_fields_and_read_nested_refs() -> None:
    header = pb.ParkHeader(kv_request_id="k", total_chunks=3).SerializeToString()
    raw = pb.ParkRequest(header=pb.ParkHeader.FromString(header + b"\x48\x01")).SerializeToString()
    parsed = wire.parse_park_request(raw)
    assert isinstance(parsed, pb.ParkHeader) and parsed.total_chunks == 3
    refs = pb.ChunkRefs(refs=[pb.ChunkRef(chunk_id=1, offset=4096, nbytes=10)])
    parsed = wire.parse_park_request(pb.ParkRequest(chunk_refs=refs).SerializeToString())
    assert isinstance(parsed, pb.ChunkRefs) and parsed.refs[0].offset == 4096


def unknown_fields(n: int) -> bytes:
    """`n` empty fields of a number no kvpark message declares (field 6, length-delimited)."""
    return b"\x32\x00" * n


def test_the_largest_message_kvpark_sends_is_within_the_field_budget() -> None:
    widest = pb.ChunkRef(chunk_id=2**32 - 1, crc32c=1, offset=2**63, nbytes=2**40)
    refs = pb.ChunkRefs(refs=[widest] * wire.MAX_REFS_PER_MESSAGE)
    parsed = wire.parse_park_request(pb.ParkRequest(chunk_refs=refs).SerializeToString())
    assert isinstance(parsed, pb.ChunkRefs) and len(parsed.refs) == wire.MAX_REFS_PER_MESSAGE


def test_the_producers_largest_placement_message_is_read_whole() -> None:
    """A ChunksPlaced of a whole batch has more fields than the budget: the client reads it
    all, since the budget bounds what the producer walks by hand, not what protobuf parses."""
    placed = [
        pb.ChunkPlaced(chunk_id=i, crc32c=i, offset=i << 12, nbytes=4096) for i in range(1024)
    ]
    raw = pb.FetchResponse(placed=pb.ChunksPlaced(chunks=placed)).SerializeToString()
    parsed = wire.parse_fetch_response(raw)
    assert isinstance(parsed, pb.ChunksPlaced) and len(parsed.chunks) == 1024
    assert wire.MAX_FIELDS_PER_MESSAGE < 5 * 1024


MANY = wire.MAX_FIELDS_PER_MESSAGE + 1
HEADER = pb.ParkHeader(kv_request_id="k", total_chunks=1).SerializeToString()
CHUNK = pb.Chunk(chunk_id=0, data=b"kv").SerializeToString()


@pytest.mark.parametrize(
    ("parse", "raw"),
    [
        # Beside a member, at the top level: protobuf would skip them all.
        (wire.parse_park_request, pb.ParkRequest(header=pb.ParkHeader()).SerializeToString()
         + unknown_fields(MANY)),
        (wire.parse_fetch_response, unknown_fields(MANY)),
        # Inside a member, which protobuf's C parser would otherwise read first.
        (wire.parse_park_request, b"\x0a" + wire._varint(len(HEADER) + 2 * MANY) + HEADER
         + unknown_fields(MANY)),
        # Inside a chunk, the hand-read data path.
        (wire.parse_park_request, b"\x12" + wire._varint(len(CHUNK) + 2 * MANY) + CHUNK
         + unknown_fields(MANY)),
        # Spread over the member's repeated bodies and the top level: one budget for all.
        (wire.parse_park_request, (b"\x0a" + wire._varint(len(HEADER) + 2048) + HEADER
         + unknown_fields(1024)) * 2),
    ],
    ids=["top-level", "fetch-top-level", "in-header", "in-chunk", "over-bodies"],
)  # fmt: skip
def test_a_message_of_more_fields_than_the_budget_is_refused(parse: Any, raw: bytes) -> None:
    """Each field costs the producer's event loop a few microseconds of Python: a message of
    the receive limit made of millions of empty fields would hold every other call for
    seconds, so the parse stops at MAX_FIELDS_PER_MESSAGE, fields of every level counted."""
    with pytest.raises(wire.WireError, match=f"more than {wire.MAX_FIELDS_PER_MESSAGE} fields"):
        parse(raw)


@given(st.binary(max_size=64))
def test_random_bytes_never_crash_the_parser(raw: bytes) -> None:
    try:
        wire.parse_park_request(raw)
        wire.parse_fetch_response(raw)
    except wire.WireError:
        pass
