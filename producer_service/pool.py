"""The host pool: one preallocated block of memory that parked chunks live in.

The pool is allocated once at start-up (`pool_bytes`) and touched so its pages are resident:
the hot path never asks the OS for memory and never page-faults, so storing a chunk costs one
copy into memory already resident. It is cut into fixed pages (`page_bytes`); a chunk occupies
whole pages, not necessarily adjacent, so there is no fragmentation to manage. Consecutive page
indices are merged into one extent, and since the free list hands pages out in order, a chunk is
usually one extent (one memoryview).

Slots and generations (a Fetch must never send memory that was freed): every stored chunk is a
*slot* with a generation number. A `SlotHandle` names (slot index, generation); `views()` only
answers while the slot still holds that generation, and freeing a slot bumps it. A handle kept
by mistake after a free raises `StaleSlotError` instead of reading someone else's bytes.

Reservations: a Park batch that declares `batch_bytes` takes its pages out of the free list
before any data is sent, so a declared batch that was accepted cannot run out half-way (the
lot asks only for what exceeds the id's committed bytes: a re-sent chunk takes no pages).

Accounting is exact and checked by `check_invariants()`: every page is in exactly one of
{free list, an unused reservation, a slot}, and the counters match the sum of the parts.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PAGE_BYTES = 256 * 1024


class StaleSlotError(RuntimeError):
    """A handle whose slot was freed (and maybe reused): its bytes are not ours any more."""


@dataclass(frozen=True, slots=True)
class SlotHandle:
    """Names one stored chunk: slot index plus the generation it was stored under."""

    index: int
    generation: int
    nbytes: int


@dataclass(slots=True)
class Reservation:
    """Pages set aside for one declared batch. Owned by the pool; the caller only passes it."""

    pages: list[int]
    nbytes: int
    open: bool = True


@dataclass(slots=True)
class _Slot:
    generation: int = 0
    in_use: bool = False
    nbytes: int = 0
    pages: list[int] = field(default_factory=list)
    # (byte offset, length) runs of adjacent pages, covering exactly nbytes.
    extents: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    pool_bytes: int
    page_bytes: int
    used_bytes: int  # pages held by slots or reservations, in bytes
    stored_bytes: int  # payload bytes in slots (used_bytes minus page rounding and reservations)
    reserved_bytes: int  # pages reserved but not yet holding a slot, in bytes
    free_bytes: int
    slots_in_use: int
    reservations_open: int


class HostPool:
    def __init__(self, pool_bytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> None:
        if page_bytes <= 0 or pool_bytes < page_bytes:
            raise ValueError(
                f"pool_bytes {pool_bytes} must hold at least one {page_bytes}-byte page"
            )
        self.page_bytes = page_bytes
        self.total_pages = pool_bytes // page_bytes
        self.pool_bytes = self.total_pages * page_bytes
        self._mmap = mmap.mmap(-1, self.pool_bytes)
        # Touch one byte per OS page so the whole pool is resident now, not on the hot path.
        np.frombuffer(self._mmap, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
        self._memory = memoryview(self._mmap)
        # Free page indices; pop() hands out the lowest first so chunks come out contiguous.
        self._free_pages: list[int] = list(range(self.total_pages - 1, -1, -1))
        self._slots: list[_Slot] = []
        self._free_slots: list[int] = []  # indices of _slots not in use, reused LIFO
        # Open reservations by id(); held here so check_invariants can see their pages.
        self._reservations: dict[int, Reservation] = {}
        self._reserved_pages = 0  # pages held by open reservations, not yet in a slot
        self._stored_bytes = 0
        self._slots_in_use = 0

    # ----------------------------------------------------------------------------- sizing
    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    @property
    def free_bytes(self) -> int:
        return len(self._free_pages) * self.page_bytes

    def fits_ever(self, nbytes: int) -> bool:
        """Whether `nbytes` could fit in the empty pool."""
        return self.pages_for(nbytes) <= self.total_pages

    # ------------------------------------------------------------------------ reservations
    def reserve(self, nbytes: int) -> Reservation | None:
        """Sets pages aside for `nbytes` of payload, or returns None if they are not free."""
        need = self.pages_for(nbytes)
        if need > len(self._free_pages):
            return None
        pages = [self._free_pages.pop() for _ in range(need)]
        reservation = Reservation(pages=pages, nbytes=nbytes)
        self._reservations[id(reservation)] = reservation
        self._reserved_pages += need
        return reservation

    def close_reservation(self, reservation: Reservation) -> None:
        """Returns a reservation's unused pages to the free list (idempotent)."""
        if not reservation.open:
            return
        reservation.open = False
        self._reservations.pop(id(reservation), None)
        self._reserved_pages -= len(reservation.pages)
        self._free_pages.extend(reversed(reservation.pages))
        reservation.pages = []

    # --------------------------------------------------------------------------- slots
    def store(self, data: memoryview, reservation: Reservation | None = None) -> SlotHandle | None:
        """Copies `data` into free pages and returns its handle, or None if the pool is full.

        Pages come from `reservation` first (when given and open), then from the free list.
        """
        handle = self.allocate(len(data), reservation)
        if handle is None:
            return None
        pos = 0
        for view in self.views(handle):
            view[:] = data[pos : pos + len(view)]
            pos += len(view)
        return handle

    def allocate(self, nbytes: int, reservation: Reservation | None = None) -> SlotHandle | None:
        """A slot of `nbytes` whose contents the caller writes through `views` (a copy made off
        the event loop), or None if the pool is full. Pages as for `store`."""
        if nbytes <= 0:
            raise ValueError("cannot store an empty chunk")
        need = self.pages_for(nbytes)
        from_reservation = reservation.pages if reservation is not None and reservation.open else []
        if need > len(from_reservation) + len(self._free_pages):
            return None
        # Reserved pages first, taken from the front in one slice (they are in address order).
        taken = min(need, len(from_reservation))
        pages = from_reservation[:taken]
        del from_reservation[:taken]
        self._reserved_pages -= taken
        while len(pages) < need:
            pages.append(self._free_pages.pop())
        extents = self._extents(pages, nbytes)
        index = self._free_slots.pop() if self._free_slots else self._new_slot()
        slot = self._slots[index]
        slot.in_use = True
        slot.nbytes = nbytes
        slot.pages = pages
        slot.extents = extents
        self._stored_bytes += nbytes
        self._slots_in_use += 1
        return SlotHandle(index, slot.generation, nbytes)

    def _new_slot(self) -> int:
        self._slots.append(_Slot())
        return len(self._slots) - 1

    def _extents(self, pages: list[int], nbytes: int) -> list[tuple[int, int]]:
        page = self.page_bytes
        extents: list[tuple[int, int]] = []
        remaining = nbytes
        run_start = pages[0]
        run_len = 1
        for p in pages[1:]:
            if p == run_start + run_len:
                run_len += 1
                continue
            length = run_len * page
            extents.append((run_start * page, length))
            remaining -= length
            run_start, run_len = p, 1
        extents.append((run_start * page, remaining))
        return extents

    def _slot(self, handle: SlotHandle) -> _Slot:
        if 0 <= handle.index < len(self._slots):
            slot = self._slots[handle.index]
            if slot.in_use and slot.generation == handle.generation:
                return slot
        raise StaleSlotError(f"slot {handle.index} generation {handle.generation} was freed")

    def views(self, handle: SlotHandle) -> list[memoryview]:
        """The chunk's bytes as views into the pool; valid until the handle is freed."""
        slot = self._slot(handle)
        return [self._memory[offset : offset + length] for offset, length in slot.extents]

    def equals(self, handle: SlotHandle, data: memoryview) -> bool:
        """Whether the stored chunk holds exactly `data` (idempotent re-park check)."""
        return self._slot(handle).nbytes == len(data) and self.equals_at(handle, 0, data)

    def same_bytes(self, a: SlotHandle, b: SlotHandle) -> bool:
        """Whether two stored chunks hold exactly the same bytes."""
        if self._slot(a).nbytes != self._slot(b).nbytes:
            return False
        pos = 0
        for view in self.views(a):
            if not self.equals_at(b, pos, view):
                return False
            pos += len(view)
        return True

    def equals_at(self, handle: SlotHandle, start: int, data: memoryview) -> bool:
        """Whether the stored chunk holds `data` at byte `start`."""
        pos = 0
        end = start + len(data)
        for offset, length in self._slot(handle).extents:
            lo, hi = max(start, pos), min(end, pos + length)
            if (
                lo < hi
                and self._memory[offset + lo - pos : offset + hi - pos]
                != data[lo - start : hi - start]
            ):
                return False
            pos += length
        return True

    def free(self, handle: SlotHandle) -> None:
        """Frees a stored chunk; its generation changes so old handles go stale."""
        slot = self._slot(handle)
        slot.generation += 1
        slot.in_use = False
        pages = slot.pages
        if len(pages) == 1:  # the common small chunk: no reversed() iterator to build
            self._free_pages.append(pages[0])
        else:
            self._free_pages.extend(reversed(pages))
        self._stored_bytes -= slot.nbytes
        self._slots_in_use -= 1
        # Emptied in place: the slot is the only owner of both lists (`store` gives it new ones).
        pages.clear()
        slot.extents.clear()
        slot.nbytes = 0
        self._free_slots.append(handle.index)

    def is_live(self, handle: SlotHandle) -> bool:
        try:
            self._slot(handle)
        except StaleSlotError:
            return False
        return True

    # ---------------------------------------------------------------------- observability
    def statistics(self) -> PoolStatistics:
        free = len(self._free_pages) * self.page_bytes
        return PoolStatistics(
            pool_bytes=self.pool_bytes,
            page_bytes=self.page_bytes,
            used_bytes=self.pool_bytes - free,
            stored_bytes=self._stored_bytes,
            reserved_bytes=self._reserved_pages * self.page_bytes,
            free_bytes=free,
            slots_in_use=self._slots_in_use,
            reservations_open=len(self._reservations),
        )

    def check_invariants(self) -> None:
        """Raises AssertionError if any page is lost, doubly owned, or a counter is off."""
        slot_pages = [p for s in self._slots if s.in_use for p in s.pages]
        reserved = [p for r in self._reservations.values() for p in r.pages]
        assert len(reserved) == self._reserved_pages, "reserved page count is off"
        owners = len(self._free_pages) + len(reserved) + len(slot_pages)
        assert owners == self.total_pages, f"pages: {owners} owned of {self.total_pages}"
        seen = set(self._free_pages) | set(reserved) | set(slot_pages)
        assert len(seen) == owners, "a page is owned twice"
        in_use = [s for s in self._slots if s.in_use]
        assert self._slots_in_use == len(in_use) >= 0, "slot count is off"
        assert self._stored_bytes == sum(s.nbytes for s in in_use) >= 0, "stored bytes are off"
        assert self._reserved_pages >= 0, "negative reserved pages"
        for s in in_use:
            assert sum(length for _, length in s.extents) == s.nbytes, "extents do not cover slot"
            assert len(s.pages) == self.pages_for(s.nbytes), "slot holds the wrong page count"
        assert len(self._free_slots) + len(in_use) == len(self._slots), "slot free list is off"

    def close(self) -> None:
        """Releases the mapping; only when no views are alive (end of process or test)."""
        self._memory.release()
        self._mmap.close()
