"""Park over shared memory: a batch's chunks copied from the buffer its client lent.

The client wrote its KV into a buffer it lent over shm_socket (kvpark.producer.shm_lending) and
names each chunk by offset and size (`ChunkRef`). For each one the lot hands out pool pages
(`begin_fill`), a worker thread copies the chunk into them and computes the CRC32C of what
landed (so what is checked is exactly what is kept, whatever the client does to its buffer
meanwhile), and the lot checks and keeps it (`end_fill`). A few fills run at once, so reading
the next ChunkRef overlaps the copies; the commit waits for all of them, and a batch cut off
waits for its threads before their pages can go back.
"""

from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb

from .lot import Lot, ParkBatch, Refusal
from .pool import SlotHandle

# Fills in flight per batch: enough to keep a worker thread busy while the next ChunkRef is
# read, few enough that a refusal stops the batch early.
MAX_FILLS_IN_FLIGHT = 4


def copy_and_crc(source: memoryview, views: list[memoryview]) -> int:
    """Copies `source` into the slot's views; returns the CRC32C of the copy. numpy's copy and
    the hardware CRC release the GIL."""
    crc = 0
    pos = 0
    for view in views:
        n = len(view)
        np.copyto(np.frombuffer(view, np.uint8), np.frombuffer(source[pos : pos + n], np.uint8))
        crc = crc32c_of(view, crc)
        pos += n
    return crc


class LentChunks:
    """The fills of one Park batch from one lent buffer."""

    def __init__(self, lot: Lot, batch: ParkBatch, lent: memoryview) -> None:
        self._lot = lot
        self._batch = batch
        self._lent = lent
        self._fills: deque[tuple[asyncio.Future[int], pb.ChunkRef, SlotHandle]] = deque()

    def check_range(self, ref: pb.ChunkRef) -> str | None:
        """What is wrong with the range `ref` names, or None."""
        if not 0 < ref.nbytes <= len(self._lent) - ref.offset:
            return (
                f"chunk_ref {ref.chunk_id}: bytes {ref.offset}+{ref.nbytes} are empty or beyond "
                f"the {len(self._lent)}-byte lent buffer"
            )
        return None

    async def add(self, ref: pb.ChunkRef) -> Refusal | None:
        """Starts filling one chunk; returns a refusal (the batch is undone) if one of the fills
        it had to wait for failed. Raises MalformedRequest as `Lot.begin_fill` does."""
        opened = self._lot.begin_fill(self._batch, ref.chunk_id, ref.nbytes)
        if isinstance(opened, Refusal):
            return opened
        handle, views = opened
        source = self._lent[ref.offset : ref.offset + ref.nbytes]
        future = asyncio.ensure_future(asyncio.to_thread(copy_and_crc, source, views))
        self._fills.append((future, ref, handle))
        while len(self._fills) >= MAX_FILLS_IN_FLIGHT:
            refused = await self._end_oldest()
            if refused is not None:
                return refused
        return None

    async def finish(self) -> Refusal | None:
        """Waits for every fill and keeps each; the first refusal undoes the batch."""
        while self._fills:
            refused = await self._end_oldest()
            if refused is not None:
                await self.drain()
                return refused
        return None

    async def drain(self) -> None:
        """After the batch was cut off: waits for the threads still writing (a cancel of the
        handler does not stop them), then lets the lot free their pages."""
        while self._fills:
            future, ref, handle = self._fills.popleft()
            try:
                crc = await asyncio.shield(future)
            except asyncio.CancelledError:
                crc = await future  # the thread is still writing: its pages must wait for it
            self._lot.end_fill(self._batch, ref.chunk_id, handle, None, crc)

    async def _end_oldest(self) -> Refusal | None:
        future, ref, handle = self._fills[0]
        crc = await future
        self._fills.popleft()
        given = ref.crc32c if ref.HasField("crc32c") else None
        return self._lot.end_fill(self._batch, ref.chunk_id, handle, given, crc)
