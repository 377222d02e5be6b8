"""Per-chunk destinations against a real producer: a chunk must fill a destination of several
buffers (a paged cache's per-layer K and V runs) exactly, so KV of another prompt length is
refused with the id kept rather than landing shifted across the pieces; and what is no
buffer of bytes is refused as misuse."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import running_producer

from kvpark import (
    AsyncKVConsumer,
    AsyncKVParker,
    BufferTooSmallError,
    State,
    Timeout,
    UsageError,
)
from kvpark.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=np.float16, tokens_per_chunk=16)


def paged_layers(seed: int | None = None) -> list[npt.NDArray[Any]]:
    shape = (2, 8, LAYOUT.tokens_per_chunk, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    if seed is None:
        return [np.zeros(shape, LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


async def test_a_short_chunk_is_refused_by_a_multi_part_destination_and_the_id_kept() -> None:
    source = LAYOUT.paged(paged_layers(seed=1), block_table=[1, 2, 3], num_tokens=40)
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("kv", LAYOUT.chunk_buffers(source, range(3)))).ok
        async with AsyncKVConsumer(server.target, timeout=Timeout(10)) as consumer:
            # The decode side believes the prompt is 48 tokens: chunk 2 (8 tokens) is shorter
            # than the 16-token runs it was given.
            wrong = LAYOUT.paged(paged_layers(), block_table=[4, 5, 6], num_tokens=48)
            with pytest.raises(BufferTooSmallError, match="chunk 2 is 512 bytes") as refused:
                await consumer.load("kv", num_chunks=3, into=LAYOUT.chunk_buffers(wrong, range(3)))
            assert refused.value.chunks_loaded == 2

            right_layers = paged_layers()
            right = LAYOUT.paged(right_layers, block_table=[4, 5, 6], num_tokens=40)
            result = await consumer.load(
                "kv", num_chunks=3, into=LAYOUT.chunk_buffers(right, range(3))
            )
    assert result.ok, result
    for chunk in range(3):
        loaded = b"".join(bytes(p) for p in LAYOUT.chunk_parts(right, chunk))
        assert loaded == b"".join(bytes(p) for p in LAYOUT.chunk_parts(source, chunk))


async def test_one_buffer_per_chunk_still_takes_a_shorter_chunk_at_its_start() -> None:
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("kv", [b"a" * 100, b"b" * 40])).ok
        buffers = [np.zeros(100, np.uint8), np.zeros(100, np.uint8)]
        async with AsyncKVConsumer(server.target, timeout=Timeout(10)) as consumer:
            result = await consumer.load("kv", num_chunks=2, into=buffers)
    assert result.ok, result
    assert buffers[1][:40].tobytes() == b"b" * 40 and not buffers[1][40:].any()


async def test_an_array_of_objects_is_not_a_destination() -> None:
    async with AsyncKVConsumer("h:1") as consumer:
        for into in (np.empty(8, object), [np.empty(8, object)], [[np.empty(8, object)]]):
            with pytest.raises(UsageError, match="holds references"):
                await consumer.load("kv", num_chunks=1, into=into)


async def test_destinations_that_share_memory_are_refused_before_anything_moves() -> None:
    """`[buffer] * n` would have every chunk overwrite the one before, each verified as it
    landed, and the load report success; it is misuse, refused with the id untouched."""
    shared = np.zeros(64, np.uint8)
    other = np.zeros(64, np.uint8)
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("kv", [b"a" * 64, b"b" * 64, b"c" * 64])).ok
        async with AsyncKVConsumer(server.target, timeout=Timeout(10)) as consumer:
            for into, names in (
                ([shared, other, shared], r"into\[0\] and into\[2\]"),
                ([shared[:40], other, shared[32:]], r"into\[0\] and into\[2\]"),
                (
                    [other, [shared[:40], shared[32:]], np.zeros(64, np.uint8)],
                    r"parts of into\[1\]",
                ),
            ):
                with pytest.raises(UsageError, match=names + " share memory"):
                    await consumer.load("kv", num_chunks=3, into=into)
            assert not shared.any() and not other.any()
            # Neighbouring views of one buffer are fine: they touch, they do not overlap.
            pair = np.zeros(128, np.uint8)
            result = await consumer.load("kv", num_chunks=3, into=[pair[:64], pair[64:], other])
        server.lot.check_invariants()
    assert result.ok, result
    assert pair.tobytes() == b"a" * 64 + b"b" * 64 and other.tobytes() == b"c" * 64


async def test_fewer_destinations_than_chunks_asked_is_refused_before_anything_moves() -> None:
    """Two destinations for four chunks could only end in BufferTooSmallError after two had
    landed, with the id delivered and unconfirmed; it is refused first, the id kept PARKED."""
    first, second = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    async with running_producer() as server:
        async with AsyncKVParker(server.target) as parker:
            assert (await parker.park("kv", [bytes([i + 1]) * 64 for i in range(4)])).ok
        async with AsyncKVConsumer(server.target, timeout=Timeout(10)) as consumer:
            for ask in ({"num_chunks": 4}, {"chunk_ids": [0, 1, 3]}):
                with pytest.raises(UsageError, match="2 chunk destinations for"):
                    await consumer.load("kv", into=[first, second], **ask)
            assert not first.any() and not second.any()
            [status] = await consumer.lookup(["kv"])
            assert status.state is State.PARKED, status
        server.lot.check_invariants()
