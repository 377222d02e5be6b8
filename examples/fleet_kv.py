"""The fleet demo's KV: synthetic bytes, the same for a request id wherever they are made.

A prefill node "computes" chunk c of request r as pseudo-random bytes keyed by (r, c); a
decode worker "recomputes" a missing chunk the same way, and checks every loaded byte against
it. Stand-ins for an engine's KV cache that cost next to no CPU and make any byte that went
astray (another request's chunk, another node's, a wrong offset) a visible mismatch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Shape:
    """How much KV a request has: `chunks` chunks of `chunk_bytes` each."""

    chunks: int
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return self.chunks * self.chunk_bytes

    @property
    def first_part(self) -> int:
        """The chunks a "hold_rest" prefill parks at once (the rest later): half, but at
        least one, since a batch of none is no park; a one-chunk request goes out whole."""
        return max(1, self.chunks // 2)


def chunk(request_id: str, index: int, shape: Shape) -> Bytes:
    """Chunk `index` of `request_id`'s KV."""
    key = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
    rng = np.random.default_rng([key, index])
    return np.frombuffer(rng.bytes(shape.chunk_bytes), dtype=np.uint8)


def fill(request_id: str, shape: Shape, into: Bytes, first: int) -> None:
    """Writes chunks `first`.. of `request_id` into their places in `into` (a recompute)."""
    for index in range(first, shape.chunks):
        start = index * shape.chunk_bytes
        into[start : start + shape.chunk_bytes] = chunk(request_id, index, shape)


def matches(request_id: str, shape: Shape, kv: Bytes) -> bool:
    """Whether `kv` holds exactly `request_id`'s KV, every byte."""
    expected = np.empty(shape.nbytes, dtype=np.uint8)
    fill(request_id, shape, expected, 0)
    return kv.shape == expected.shape and bool(np.array_equal(kv, expected))
