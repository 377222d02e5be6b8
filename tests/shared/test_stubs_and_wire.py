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
    crc=st.integers(0, 2**32 - 1),
    data=st.binary(min_size=1, max_size=4096),
    split=st.integers(0, 4096),
)
def test_hand_frames_equal_generated_serialization(
    chunk_id: int, crc: int, data: bytes, split: int
) -> None:
    parts = [memoryview(data)[:split], memoryview(data)[split:]]
    chunk = pb.Chunk(chunk_id=chunk_id, crc32c=crc, data=data)
    assert (
        wire.encode_fetch_chunk(chunk_id, crc, parts)
        == pb.FetchResponse(chunk=chunk).SerializeToString()
    )
    assert (
        wire.encode_park_chunk(chunk_id, crc, parts)
        == pb.ParkRequest(chunk=chunk).SerializeToString()
    )
    parsed = wire.parse_fetch_response(pb.FetchResponse(chunk=chunk).SerializeToString())
    assert isinstance(parsed, wire.ChunkView)
    assert (parsed.chunk_id, parsed.crc32c, bytes(parsed.data)) == (chunk_id, crc, data)


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


@given(st.binary(max_size=64))
def test_random_bytes_never_crash_the_parser(raw: bytes) -> None:
    try:
        wire.parse_park_request(raw)
        wire.parse_fetch_response(raw)
    except wire.WireError:
        pass
