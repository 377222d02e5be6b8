"""Copies on the data path, measured: a load into a preallocated array allocates no full-size
intermediate buffer (the reason the data path frames chunks by hand in `kvpark.wire` rather
than through the generated message classes).

Per chunk the client process holds gRPC's own `bytes` of the received message (the transport's
copy out of its socket buffers, which Python cannot avoid) and copies the payload once, with
one memcpy, into `into`; parsing and the CRC32C work on memoryviews. tracemalloc sees every
Python-level allocation, including those `bytes`, so its peak during a 64 MiB load bounds what
was alive at once. The producer is a separate process so its own buffers do not count.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
from conftest import MiB, ProducerProcess
from consumer_support import park_sync

from kvpark.client import KVConsumer

CHUNK = 4 * MiB
CHUNKS = 16
PAYLOAD = CHUNK * CHUNKS  # 64 MiB


def _park(producer: ProducerProcess, kid: str) -> bytes:
    rng = np.random.default_rng(11)
    chunks = {i: rng.bytes(CHUNK) for i in range(CHUNKS)}
    for start in range(0, CHUNKS, 4):  # in batches: keeps the test's own Park messages small
        part = {i: chunks[i] for i in range(start, start + 4)}
        assert park_sync(producer.target, kid, part, total=CHUNKS).status == 1
    return b"".join(chunks[i] for i in range(CHUNKS))


def _traced_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        value = fn()
        return value, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_paged_destinations_get_one_copy_per_byte_too(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    """A paged KV cache: one non-contiguous block per chunk (every other block of a larger
    cache), given as a list and as a callable. Each chunk lands in its block with one copy and
    nothing full-size is allocated on the way."""
    producer = producer_process(pool_bytes=256 * MiB, max_chunk_bytes=CHUNK)
    expected = {kid: _park(producer, kid) for kid in ("paged-list", "paged-call")}
    cache = np.zeros((2 * CHUNKS, CHUNK), np.uint8)  # touched: page faults are not copies
    listed = [cache[2 * i] for i in range(CHUNKS)]
    asked: list[int] = []

    def block_for(chunk_id: int, nbytes: int) -> np.ndarray:
        asked.append(chunk_id)
        return cache[2 * chunk_id + 1][:nbytes]

    with KVConsumer(producer.target) as client:
        as_list, peak_list = _traced_peak(
            lambda: client.load("paged-list", num_chunks=CHUNKS, into=listed)
        )
        by_call, peak_call = _traced_peak(
            lambda: client.load("paged-call", num_chunks=CHUNKS, into=block_for)
        )
    assert as_list.ok and by_call.ok and as_list.data is None
    assert b"".join(cache[2 * i].tobytes() for i in range(CHUNKS)) == expected["paged-list"]
    assert b"".join(cache[2 * i + 1].tobytes() for i in range(CHUNKS)) == expected["paged-call"]
    assert asked == list(range(CHUNKS))
    for peak in (peak_list, peak_call):
        assert peak < PAYLOAD / 4, f"peak {peak / MiB:.1f} MiB for a 64 MiB paged load"


def test_load_into_preallocated_array_has_no_full_size_intermediate(
    producer_process: Callable[..., ProducerProcess],
) -> None:
    producer = producer_process(pool_bytes=256 * MiB, max_chunk_bytes=CHUNK)
    expected_a = _park(producer, "copies-a")
    expected_b = _park(producer, "copies-b")
    into = np.empty(PAYLOAD, np.uint8)
    into[:] = 0  # touch it now: page faults are not the client's copies
    with KVConsumer(producer.target) as client:
        client.server_info()  # first contact outside the measurement
        result, peak_into = _traced_peak(
            lambda: client.load("copies-a", num_chunks=CHUNKS, into=into)
        )
        assert result.ok and result.bytes == PAYLOAD
        assert into.tobytes() == expected_a
        owned, peak_owned = _traced_peak(lambda: client.load("copies-b", num_chunks=CHUNKS))
        assert owned.ok and owned.data.tobytes() == expected_b
    # With `into`: a few messages alive at a time, never the payload.
    assert peak_into < PAYLOAD / 4, f"peak {peak_into / MiB:.1f} MiB for a 64 MiB load"
    assert peak_owned >= PAYLOAD  # the measurement does see full-size allocations
    print(
        f"\ntracemalloc peak: into=preallocated {peak_into / MiB:.1f} MiB, "
        f"no into {peak_owned / MiB:.1f} MiB, payload {PAYLOAD / MiB:.0f} MiB"
    )
