"""The CRC32C every transport checks is the Castagnoli CRC other languages compute: the
published test vectors (RFC 3720, appendix B.4, and the "123456789" check value), piece by
piece equal to whole, and the same over every buffer type a chunk arrives in."""

from __future__ import annotations

import numpy as np
import pytest

from kvpark.checksum import crc32c_of

VECTORS = [
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"", 0),
]


@pytest.mark.parametrize(("data", "expected"), VECTORS)
def test_published_vectors(data: bytes, expected: int) -> None:
    assert crc32c_of(data) == expected


def test_pieces_chain_to_the_crc_of_the_whole() -> None:
    data = np.random.default_rng(5).integers(0, 256, 3 * 2**20 + 17, dtype=np.uint8).tobytes()
    whole = crc32c_of(data)
    view = memoryview(data)
    for cuts in ([1], [4096, 2**20], [2**20 + 3, 2 * 2**20]):
        crc, start = 0, 0
        for end in [*cuts, len(data)]:
            crc = crc32c_of(view[start:end], crc)
            start = end
        assert crc == whole, cuts


def test_every_buffer_type_gives_the_same_crc() -> None:
    array = np.random.default_rng(6).integers(0, 256, 1 << 16, dtype=np.uint8)
    expected = crc32c_of(array.tobytes())
    assert crc32c_of(array) == expected  # type: ignore[arg-type]
    assert crc32c_of(memoryview(array)) == expected
    assert crc32c_of(bytearray(array.tobytes())) == expected
    assert crc32c_of(memoryview(array)[100:]) == crc32c_of(array.tobytes()[100:])
