"""Payload the benchmark moves, and the check that every byte arrived where it belongs.

The payload is a deterministic pattern (a multiplicative hash of the 8-byte word index), so
two processes can build the same bytes without sending them to each other, and any misplaced,
stale or lost block compares unequal. Each repetition moves a window starting at a different,
odd offset of one larger pattern: a repetition that got the previous one's bytes (a stale pool
slot, a reused buffer) fails the comparison too.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvpark.checksum import crc32c_of

# The same pattern `kvpark bench` moves, so both benchmarks compare the same bytes.
from kvpark.client.bench.payload import SHIFT, pattern

from .report import VerificationError

U8 = npt.NDArray[np.uint8]
__all__ = [
    "REP_SHIFT", "U8", "check_same", "chunk_crcs", "first_difference", "pattern", "same_bytes",
    "source_size", "window",
]  # fmt: skip

# Offset step between repetitions: odd, so windows never line up with each other's words.
REP_SHIFT = SHIFT
_BLOCK = 64 * 1024 * 1024


def window(source: U8, rep: int, nbytes: int) -> U8:
    """Repetition `rep`'s bytes: `nbytes` from an odd offset that differs per repetition."""
    offset = rep * REP_SHIFT
    if offset + nbytes > len(source):
        raise ValueError(f"pattern of {len(source)} bytes too short for repetition {rep}")
    return source[offset : offset + nbytes]


def source_size(nbytes: int, reps: int) -> int:
    return nbytes + (reps + 1) * REP_SHIFT


def same_bytes(a: U8, b: U8) -> bool:
    """Exact comparison, 8 bytes at a time in 64 MiB blocks (fast, small temporaries)."""
    if len(a) != len(b):
        return False
    whole = len(a) // 8 * 8
    for start in range(0, whole, _BLOCK):
        end = min(whole, start + _BLOCK)
        if not np.array_equal(a[start:end].view(np.uint64), b[start:end].view(np.uint64)):
            return False
    return bytes(a[whole:]) == bytes(b[whole:])


def first_difference(a: U8, b: U8) -> int:
    """Index of the first differing byte (for the failure message), -1 if equal."""
    if len(a) != len(b):
        return min(len(a), len(b))
    for start in range(0, len(a), _BLOCK):
        end = min(len(a), start + _BLOCK)
        diff = np.flatnonzero(a[start:end] != b[start:end])
        if len(diff):
            return start + int(diff[0])
    return -1


def check_same(got: U8, expected: U8, what: str) -> None:
    """Raises VerificationError naming `what` and the first differing byte unless `got` holds
    exactly `expected`."""
    if not same_bytes(got, expected):
        where = first_difference(got, expected)
        raise VerificationError(f"{what}: byte {where} differs from what was sent")


def chunk_crcs(data: U8, chunk_bytes: int) -> list[int]:
    """CRC32C of each `chunk_bytes` piece of `data` (the last one may be shorter)."""
    view = memoryview(data)  # type: ignore[arg-type]
    return [crc32c_of(view[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]
