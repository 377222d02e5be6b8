"""CRC32C (Castagnoli) of chunk payloads, the checksum the contract carries in `Chunk.crc32c`.

Uses the `crc32c-rs` package: it folds with carry-less multiplication (PCLMULQDQ, or
VPCLMULQDQ on AVX-512 CPUs; the CRC and PMULL instructions on ARMv8), picking the variant
tuned for the CPU at run time, with a portable fallback. On data a `recv_into` or a memcpy has
just brought into the cache, where every transport checksums, it runs at ~28 GB/s on our
2-core benchmark machine against ~13 GB/s for the SSE4.2 `crc32` instruction loop of the
`crc32c` package; that cut 10-15 % off the CPU per GB of a tcp fetch, an shm park and an shm
fetch (docs/performance.md). Accepts anything with the buffer protocol, including memoryviews
of the pool and numpy arrays, without copying, and releases the GIL while it runs.
"""

from __future__ import annotations

import crc32c_rs as _crc32c

IMPLEMENTATION = f"crc32c-rs {_crc32c.__version__}"


def crc32c_of(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of one buffer; with `crc`, of the bytes that gave `crc` followed by `data` (a
    chunk in several pieces is checksummed piece by piece, never joined)."""
    return int(_crc32c.crc32c(data, crc))
