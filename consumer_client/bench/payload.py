"""The bytes `kvpark bench` moves, and the comparison that says each one arrived.

The payload is a deterministic pattern (a multiplicative hash of the 8-byte word index), so the
raw-TCP peer process builds the same bytes without being sent them, and a misplaced, stale or
lost block compares unequal. Every transfer moves its own window of one larger pattern, an odd
offset apart: bytes left over from an earlier transfer (a stale pool slot, the previous load
into the same array) fail the comparison too.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]

SHIFT = 4099  # odd: no two windows line up on a word
_BLOCK = 64 * 1024 * 1024  # compare and build in blocks: small temporaries
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def source_bytes(nbytes: int, windows: int) -> int:
    return nbytes + windows * SHIFT


def pattern(nbytes: int) -> U8:
    words = np.empty((nbytes + 7) // 8, dtype=np.uint64)
    step = _BLOCK // 8
    for start in range(0, len(words), step):
        block = words[start : start + step]
        block[:] = np.arange(start, start + len(block), dtype=np.uint64)
        block *= _GOLDEN
        block ^= block >> np.uint64(29)
    return words.view(np.uint8)[:nbytes]


def window(source: U8, index: int, nbytes: int) -> U8:
    """Transfer `index`'s bytes."""
    start = index * SHIFT
    if start + nbytes > len(source):
        raise ValueError(f"pattern of {len(source)} bytes too short for window {index}")
    return source[start : start + nbytes]


def first_difference(got: U8, expected: U8) -> int:
    """Index of the first byte that differs, -1 when every byte is equal."""
    if len(got) != len(expected):
        return min(len(got), len(expected))
    for start in range(0, len(got), _BLOCK):
        a, b = got[start : start + _BLOCK], expected[start : start + _BLOCK]
        if not np.array_equal(a, b):
            return start + int(np.flatnonzero(a != b)[0])
    return -1
