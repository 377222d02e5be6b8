"""Park over shared memory: a batch's chunks copied from the buffer its client lent.

The client wrote its KV into a buffer it lent over shm_socket (kvpark.producer.shm_lending) and
names each chunk by offset and size (`ChunkRef`), several per message (`ChunkRefs`). For each
one the lot hands out pool pages (`begin_fill`); one worker thread job per message copies its
chunks into them and computes the CRC32C of what landed (so what is checked is exactly what is
kept, whatever the client does to its buffer meanwhile), and the lot checks and keeps each
(`end_fill`). A chunk the id already holds (a batch sent again after a broken call) is
compared with the stored bytes instead (`end_compare`), taking no pages, as inline. A few jobs
run at once, so reading the next message overlaps the copies; the
commit waits for all of them, and a batch cut off waits for its threads before their pages
can go back. While the call waits for its copies it reads no message, so the lot does not count
that time as the client's silence (`Lot.begin_copy_wait`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb

from .data_threads import DataThreads, wait
from .lot import Lot, ParkBatch, Refusal, Resent
from .pool import SlotHandle

# Groups of fills in flight per batch: enough to keep both cores copying while the next
# ChunkRefs message is read, few enough that a refusal stops the batch early.
MAX_GROUPS_IN_FLIGHT = 4


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


def compare_and_crc(source: memoryview, views: list[memoryview]) -> tuple[int, bool]:
    """The CRC32C of `source`, and whether the stored chunk's views hold the same bytes."""
    crc = 0
    pos = 0
    same = True
    for view in views:
        n = len(view)
        piece = source[pos : pos + n]
        crc = crc32c_of(piece, crc)
        same = same and np.array_equal(
            np.frombuffer(view, np.uint8), np.frombuffer(piece, np.uint8)
        )
        pos += n
    return crc, same


# One chunk of a job: its bytes in the lent buffer, the pool views they go to (or, re-sent,
# are compared with), and whether it is re-sent.
Job = tuple[memoryview, list[memoryview], bool]


def copy_group(jobs: list[Job]) -> list[tuple[int, bool]]:
    return [
        compare_and_crc(source, views) if resent else (copy_and_crc(source, views), True)
        for source, views, resent in jobs
    ]


Fill = tuple[pb.ChunkRef, SlotHandle | Resent]


class LentChunks:
    """The fills of one Park batch from one lent buffer, a ChunkRefs message at a time: the
    chunks one message names are copied by one job on a worker thread."""

    def __init__(self, lot: Lot, batch: ParkBatch, lent: memoryview, threads: DataThreads) -> None:
        self._lot = lot
        self._threads = threads
        self._batch = batch
        self._lent = lent
        self._groups: deque[tuple[Future[list[tuple[int, bool]]], list[Fill]]] = deque()

    def check_range(self, ref: pb.ChunkRef) -> str | None:
        """What is wrong with the range `ref` names, or None."""
        if not 0 < ref.nbytes <= len(self._lent) - ref.offset:
            return (
                f"chunk_ref {ref.chunk_id}: bytes {ref.offset}+{ref.nbytes} are empty or beyond "
                f"the {len(self._lent)}-byte lent buffer"
            )
        return None

    async def add(self, refs: Sequence[pb.ChunkRef]) -> Refusal | None:
        """Starts filling one message's chunks; returns a refusal (the batch is undone) if a
        chunk was refused or a fill it had to wait for failed. Raises MalformedRequest as
        `Lot.begin_fill` does."""
        opened: list[tuple[pb.ChunkRef, SlotHandle | Resent, list[memoryview]]] = []
        refused: Refusal | None = None
        try:
            for ref in refs:
                slot = self._lot.begin_fill(self._batch, ref.chunk_id, ref.nbytes)
                if isinstance(slot, Refusal):
                    refused = slot
                    break
                if isinstance(slot, Resent):
                    opened.append((ref, slot, self._lot.stored_views(slot)))
                else:
                    opened.append((ref, *slot))
        finally:
            if refused is not None or len(opened) < len(refs):  # refused, or raised
                self._end_unfilled([(ref, handle) for ref, handle, _ in opened])
        if refused is not None:
            return refused
        jobs = [
            (self._lent[r.offset : r.offset + r.nbytes], views, isinstance(slot, Resent))
            for r, slot, views in opened
        ]
        job = self._threads.submit(copy_group, jobs)
        self._groups.append((job, [(ref, handle) for ref, handle, _ in opened]))
        while len(self._groups) >= MAX_GROUPS_IN_FLIGHT:
            refused = await self._end_oldest()
            if refused is not None:
                return refused
        return None

    async def finish(self) -> Refusal | None:
        """Waits for every fill and keeps each; the first refusal undoes the batch."""
        while self._groups:
            refused = await self._end_oldest()
            if refused is not None:
                await self.drain()
                return refused
        return None

    async def drain(self) -> None:
        """After the batch was cut off: waits for the threads still writing (a cancel of the
        handler does not stop them), then lets the lot free their pages. A cancel that arrives
        meanwhile is re-raised once every group is handed back."""
        cancelled = False
        while self._groups:
            job, fills = self._groups.popleft()
            try:
                await wait(job)
            except asyncio.CancelledError:
                cancelled = True
            except Exception:
                pass  # a failed copy: its pages go back like the others
            self._end_unfilled(fills)
        if cancelled:
            raise asyncio.CancelledError

    def _end_unfilled(self, fills: list[Fill]) -> None:
        """Hands back slots of a batch already undone: the lot frees them."""
        for ref, handle in fills:
            if not isinstance(handle, Resent):  # a compared chunk holds no pages of its own
                self._lot.end_fill(self._batch, ref.chunk_id, handle, None, 0)

    async def _end_oldest(self) -> Refusal | None:
        job, fills = self._groups[0]
        # Meanwhile no message of the client's is read: the wait is not its silence.
        self._lot.begin_copy_wait(self._batch)
        try:
            ends = await wait(job)  # cancelled: the group stays for `drain`
        finally:
            self._lot.end_copy_wait(self._batch)
        self._groups.popleft()
        for i, ((ref, handle), (crc, same)) in enumerate(zip(fills, ends, strict=True)):
            given = ref.crc32c if ref.HasField("crc32c") else None
            if isinstance(handle, Resent):
                refused = self._lot.end_compare(
                    self._batch, ref.chunk_id, handle, given, crc, same_bytes=same
                )
            else:
                refused = self._lot.end_fill(self._batch, ref.chunk_id, handle, given, crc)
            if refused is not None:
                self._end_unfilled(fills[i + 1 :])
                return refused
        return None
