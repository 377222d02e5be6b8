"""Tests of producer_service.pool.HostPool over real pools: byte-exact round trips, extents,
generations ("never serve freed memory"), exact accounting, reservations, and a checker that
is shown to fail on corrupted state. A hypothesis state machine drives random operations and
checks every live chunk's bytes and every counter after each step."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpark.producer.pool import (
    HostPool,
    PoolStatistics,
    Reservation,
    SlotHandle,
    StaleSlotError,
)

PAGE = 4096


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def joined(pool: HostPool, handle: SlotHandle) -> bytes:
    return b"".join(bytes(v) for v in pool.views(handle))


def address(view: memoryview) -> int:
    """Where a view starts in memory (to tell which pool page it is)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def store(pool: HostPool, data: bytes, reservation: Reservation | None = None) -> SlotHandle:
    handle = pool.store(memoryview(data), reservation)
    assert handle is not None, "pool unexpectedly full"
    pool.check_invariants()
    return handle


@pytest.fixture
def pool() -> HostPool:
    return HostPool(16 * PAGE, page_bytes=PAGE)


# --- construction and sizing ----------------------------------------------------------------


def test_pool_is_cut_into_whole_pages_and_starts_empty() -> None:
    pool = HostPool(10 * PAGE + 123, page_bytes=PAGE)
    assert (pool.total_pages, pool.pool_bytes) == (10, 10 * PAGE)
    assert pool.statistics() == PoolStatistics(
        pool_bytes=10 * PAGE, page_bytes=PAGE, used_bytes=0, stored_bytes=0,
        reserved_bytes=0, free_bytes=10 * PAGE, slots_in_use=0, reservations_open=0,
    )  # fmt: skip
    pool.check_invariants()


@pytest.mark.parametrize(("pool_bytes", "page_bytes"), [(PAGE - 1, PAGE), (PAGE, 0), (PAGE, -1)])
def test_pool_smaller_than_one_page_is_rejected(pool_bytes: int, page_bytes: int) -> None:
    with pytest.raises(ValueError, match="at least one"):
        HostPool(pool_bytes, page_bytes=page_bytes)


def test_pages_for_rounds_up_and_fits_ever_compares_with_the_whole_pool(pool: HostPool) -> None:
    assert [pool.pages_for(n) for n in (1, PAGE - 1, PAGE, PAGE + 1)] == [1, 1, 1, 2]
    assert pool.fits_ever(16 * PAGE) and not pool.fits_ever(16 * PAGE + 1)


# --- round trips and extents ----------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 17, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 16 * PAGE])
def test_store_then_views_round_trips_bytes_exactly(pool: HostPool, nbytes: int) -> None:
    data = random_bytes(nbytes, seed=nbytes)
    handle = store(pool, data)
    assert handle.nbytes == nbytes
    assert joined(pool, handle) == data
    assert pool.equals(handle, memoryview(data))


def test_store_accepts_a_uint8_numpy_array_without_copying_it_first(pool: HostPool) -> None:
    array = np.random.default_rng(1).integers(0, 256, 12 * PAGE + 5, dtype=np.uint8)
    tracemalloc.start()
    try:
        handle = pool.store(memoryview(array))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert handle is not None
    # The copy goes straight into the pool's pages; a `bytes(data)` on the way would allocate
    # the whole 48 KiB.
    assert peak < array.nbytes // 4, peak
    assert joined(pool, handle) == array.tobytes()


def test_fresh_pool_stores_each_chunk_as_one_contiguous_extent(pool: HostPool) -> None:
    handles = [store(pool, random_bytes(n, seed=n)) for n in (PAGE + 1, 3 * PAGE, 5)]
    for handle in handles:
        assert len(pool.views(handle)) == 1
    # Pages are handed out lowest first, so the chunks sit back to back in page order: the
    # second starts 2 pages (PAGE + 1 bytes) after the first, the third 3 pages later.
    starts = [address(pool.views(h)[0]) for h in handles]
    assert [start - starts[0] for start in starts] == [0, 2 * PAGE, 5 * PAGE]


def test_chunk_spans_several_extents_after_fragmentation(pool: HostPool) -> None:
    singles = [store(pool, random_bytes(PAGE, seed=i)) for i in range(16)]
    for handle in singles[0:16:2]:  # free every other page: no two free pages are adjacent
        pool.free(handle)
    pool.check_invariants()
    data = random_bytes(3 * PAGE + 100, seed=99)
    handle = store(pool, data)
    views = pool.views(handle)
    assert len(views) == 4
    assert [len(v) for v in views] == [PAGE, PAGE, PAGE, 100]
    assert b"".join(bytes(v) for v in views) == data
    assert pool.equals(handle, memoryview(data))
    # Its neighbours were not touched.
    for i, other in enumerate(singles[1:16:2]):
        assert joined(pool, other) == random_bytes(PAGE, seed=2 * i + 1)


def test_equals_is_false_for_other_bytes_or_other_length(pool: HostPool) -> None:
    data = random_bytes(2 * PAGE + 3, seed=5)
    handle = store(pool, data)
    changed = bytearray(data)
    changed[-1] ^= 0xFF
    assert not pool.equals(handle, memoryview(bytes(changed)))
    assert not pool.equals(handle, memoryview(data[:-1]))
    assert not pool.equals(handle, memoryview(data + b"\0"))


def test_empty_chunk_is_refused(pool: HostPool) -> None:
    with pytest.raises(ValueError, match="empty"):
        pool.store(memoryview(b""))
    pool.check_invariants()


# --- generations: never serve freed memory ----------------------------------------------------


def test_freed_handle_is_stale_even_after_its_slot_is_reused_with_new_data(
    pool: HostPool,
) -> None:
    old = store(pool, random_bytes(PAGE + 9, seed=1))
    pool.free(old)
    new_data = random_bytes(PAGE + 9, seed=2)
    new = store(pool, new_data)
    # Same slot index, same pages even, but a new generation.
    assert new.index == old.index and new.generation == old.generation + 1
    assert not pool.is_live(old) and pool.is_live(new)
    with pytest.raises(StaleSlotError):
        pool.views(old)
    with pytest.raises(StaleSlotError):
        pool.equals(old, memoryview(new_data))
    with pytest.raises(StaleSlotError):
        pool.free(old)  # a double free is caught, and does not free the new owner's pages
    assert joined(pool, new) == new_data
    assert pool.statistics().slots_in_use == 1
    pool.check_invariants()


def test_freed_pages_are_handed_out_again_last_freed_first_in_their_old_order(
    pool: HostPool,
) -> None:
    one = store(pool, random_bytes(PAGE, seed=1))  # page 0
    three = store(pool, random_bytes(3 * PAGE, seed=2))  # pages 1-3
    kept = store(pool, random_bytes(PAGE - 1, seed=3))  # page 4
    pool.free(one)
    pool.free(three)
    pool.check_invariants()
    assert pool.statistics().free_bytes == 15 * PAGE
    # The chunk freed last comes back first, from its first page: pages 1-3, then page 0.
    again = store(pool, random_bytes(4 * PAGE, seed=4))
    run, page0 = pool.views(again)
    assert (len(run), len(page0)) == (3 * PAGE, PAGE)
    assert address(run) - address(page0) == PAGE
    assert joined(pool, again) == random_bytes(4 * PAGE, seed=4)
    pool.free(kept)
    single = store(pool, b"z")  # page 4 again, before the never-used pages 5-15
    assert address(pool.views(single)[0]) - address(page0) == 4 * PAGE
    del run, page0
    pool.free(again)
    pool.free(single)
    assert pool.statistics().free_bytes == 16 * PAGE
    pool.check_invariants()


def test_freed_handle_is_stale_while_its_slot_is_empty(pool: HostPool) -> None:
    handle = store(pool, b"abc")
    pool.free(handle)
    assert not pool.is_live(handle)
    with pytest.raises(StaleSlotError):
        pool.views(handle)


def test_handle_naming_a_slot_that_never_existed_is_stale(pool: HostPool) -> None:
    for handle in (SlotHandle(0, 0, 1), SlotHandle(-1, 0, 1), SlotHandle(5, 0, 1)):
        assert not pool.is_live(handle)
        with pytest.raises(StaleSlotError):
            pool.views(handle)


# --- accounting -----------------------------------------------------------------------------


def test_statistics_are_exact_after_every_step(pool: HostPool) -> None:
    def expect(used_pages: int, stored: int, reserved_pages: int, slots: int, open_: int) -> None:
        s = pool.statistics()
        assert s.used_bytes == used_pages * PAGE
        assert s.free_bytes == (16 - used_pages) * PAGE
        assert s.stored_bytes == stored
        assert s.reserved_bytes == reserved_pages * PAGE
        assert (s.slots_in_use, s.reservations_open) == (slots, open_)
        assert s.used_bytes + s.free_bytes == s.pool_bytes
        pool.check_invariants()

    a = store(pool, random_bytes(PAGE + 1))
    expect(used_pages=2, stored=PAGE + 1, reserved_pages=0, slots=1, open_=0)
    r = pool.reserve(3 * PAGE)
    assert r is not None
    expect(used_pages=5, stored=PAGE + 1, reserved_pages=3, slots=1, open_=1)
    b = store(pool, random_bytes(10), r)
    expect(used_pages=5, stored=PAGE + 11, reserved_pages=2, slots=2, open_=1)
    pool.free(a)
    expect(used_pages=3, stored=10, reserved_pages=2, slots=1, open_=1)
    pool.close_reservation(r)
    expect(used_pages=1, stored=10, reserved_pages=0, slots=1, open_=0)
    pool.free(b)
    expect(used_pages=0, stored=0, reserved_pages=0, slots=0, open_=0)


def test_full_pool_returns_none_and_stores_nothing(pool: HostPool) -> None:
    kept = store(pool, random_bytes(12 * PAGE, seed=3))
    before = pool.statistics()
    assert pool.store(memoryview(random_bytes(4 * PAGE + 1))) is None
    assert pool.statistics() == before
    pool.check_invariants()
    assert joined(pool, kept) == random_bytes(12 * PAGE, seed=3)
    # What does fit still goes in, up to the last page.
    store(pool, random_bytes(4 * PAGE))
    assert pool.statistics().free_bytes == 0
    assert pool.store(memoryview(b"x")) is None


def test_freed_pages_are_reused(pool: HostPool) -> None:
    for i in range(50):
        handle = store(pool, random_bytes(16 * PAGE, seed=i))
        assert joined(pool, handle) == random_bytes(16 * PAGE, seed=i)
        pool.free(handle)
    assert pool.statistics().free_bytes == pool.pool_bytes
    pool.check_invariants()


# --- reservations -----------------------------------------------------------------------------


def test_reservation_takes_its_pages_up_front(pool: HostPool) -> None:
    r = pool.reserve(5 * PAGE - 1)
    assert r is not None and r.open and len(r.pages) == 5
    assert pool.free_bytes == 11 * PAGE
    # The reserved pages are not handed to anyone else.
    assert pool.store(memoryview(random_bytes(12 * PAGE))) is None
    pool.check_invariants()


def test_reservation_larger_than_free_memory_is_refused_and_takes_nothing(pool: HostPool) -> None:
    store(pool, random_bytes(10 * PAGE))
    before = pool.statistics()
    assert pool.reserve(6 * PAGE + 1) is None
    assert pool.statistics() == before
    assert pool.reserve(6 * PAGE) is not None


def test_store_draws_from_the_reservation_first_then_the_free_list(pool: HostPool) -> None:
    r = pool.reserve(3 * PAGE)
    assert r is not None
    free_before = pool.free_bytes
    a = store(pool, random_bytes(2 * PAGE, seed=1), r)
    assert pool.free_bytes == free_before, "the free list was touched"
    assert len(r.pages) == 1 and pool.statistics().reserved_bytes == PAGE
    b = store(pool, random_bytes(2 * PAGE + 1, seed=2), r)  # 1 reserved page + 2 free pages
    assert pool.free_bytes == free_before - 2 * PAGE
    assert r.pages == [] and pool.statistics().reserved_bytes == 0
    assert joined(pool, a) == random_bytes(2 * PAGE, seed=1)
    assert joined(pool, b) == random_bytes(2 * PAGE + 1, seed=2)


def test_store_that_does_not_fit_leaves_the_reservation_intact(pool: HostPool) -> None:
    r = pool.reserve(2 * PAGE)
    assert r is not None
    store(pool, random_bytes(13 * PAGE))  # 1 page left on the free list
    before = pool.statistics()
    assert pool.store(memoryview(random_bytes(3 * PAGE + 1)), r) is None
    assert pool.statistics() == before and len(r.pages) == 2
    pool.check_invariants()


def test_closing_a_reservation_returns_unused_pages_and_is_idempotent(pool: HostPool) -> None:
    r = pool.reserve(4 * PAGE)
    assert r is not None
    kept = store(pool, random_bytes(PAGE + 1), r)
    pool.close_reservation(r)
    s = pool.statistics()
    assert (s.reserved_bytes, s.reservations_open, s.used_bytes) == (0, 0, 2 * PAGE)
    assert not r.open and r.pages == []
    pool.close_reservation(r)
    assert pool.statistics() == s
    pool.check_invariants()
    # The stored chunk outlives its reservation; a closed reservation is just ignored.
    assert joined(pool, kept) == random_bytes(PAGE + 1)
    other = store(pool, b"xyz", r)
    assert pool.statistics().used_bytes == 3 * PAGE and joined(pool, other) == b"xyz"


def test_closed_reservation_pages_can_be_reserved_again(pool: HostPool) -> None:
    for _ in range(5):
        r = pool.reserve(16 * PAGE)
        assert r is not None and pool.free_bytes == 0
        pool.close_reservation(r)
        assert pool.free_bytes == 16 * PAGE
    pool.check_invariants()


# --- the checker can fail ---------------------------------------------------------------------


def _drop_a_free_page(p: HostPool, r: Reservation) -> None:
    p._free_pages.pop()


def _free_a_page_a_slot_still_owns(p: HostPool, r: Reservation) -> None:
    p._free_pages.pop()  # keep the page count right, so only the double ownership is wrong
    p._free_pages.append(p._slots[0].pages[0])


def _miscount_stored_bytes(p: HostPool, r: Reservation) -> None:
    p._stored_bytes += 1


def _miscount_slots(p: HostPool, r: Reservation) -> None:
    p._slots_in_use -= 1


def _shrink_an_extent(p: HostPool, r: Reservation) -> None:
    offset, length = p._slots[0].extents[-1]
    p._slots[0].extents[-1] = (offset, length - 1)


def _lose_a_slot_from_the_slot_free_list(p: HostPool, r: Reservation) -> None:
    p._free_slots.pop()


def _reserve_a_page_that_is_also_free(p: HostPool, r: Reservation) -> None:
    # Counts stay right: the reservation swaps its own page for one on the free list.
    r.pages[0] = p._free_pages[-1]


def _lose_a_reserved_page(p: HostPool, r: Reservation) -> None:
    r.pages.pop()


@pytest.mark.parametrize(
    "corrupt",
    [
        _drop_a_free_page,
        _free_a_page_a_slot_still_owns,
        _miscount_stored_bytes,
        _miscount_slots,
        _shrink_an_extent,
        _lose_a_slot_from_the_slot_free_list,
        _reserve_a_page_that_is_also_free,
        _lose_a_reserved_page,
    ],
)
def test_check_invariants_fails_on_corrupted_state(
    pool: HostPool, corrupt: Callable[[HostPool, Reservation], None]
) -> None:
    store(pool, random_bytes(2 * PAGE + 1))
    pool.free(store(pool, b"freed"))  # leaves one slot on the slot free list
    r = pool.reserve(PAGE)
    assert r is not None
    pool.check_invariants()
    corrupt(pool, r)
    with pytest.raises(AssertionError):
        pool.check_invariants()


# --- random operations ------------------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random store / free / reserve / store-into-reservation / close, against a model that
    knows every live chunk's bytes and predicts every counter exactly."""

    PAGES = 12
    handles = Bundle("handles")
    reservations = Bundle("reservations")

    @initialize()
    def make_pool(self) -> None:
        self.pool = HostPool(self.PAGES * 64, page_bytes=64)
        self.live: dict[SlotHandle, bytes] = {}
        self.stale: list[SlotHandle] = []
        self.reserved: dict[int, int] = {}  # id(reservation) -> unused pages it holds
        self.serial = 0

    def _data(self, nbytes: int) -> bytes:
        self.serial += 1
        return random_bytes(nbytes, seed=self.serial)

    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // 64)

    def _free_pages(self) -> int:
        used = sum(self._pages(len(d)) for d in self.live.values()) + sum(self.reserved.values())
        return self.PAGES - used

    def _store(self, nbytes: int, reservation: Reservation | None) -> SlotHandle | None:
        data = self._data(nbytes)
        from_reservation = self.reserved.get(id(reservation), 0) if reservation else 0
        fits = self._pages(nbytes) <= from_reservation + self._free_pages()
        handle = self.pool.store(memoryview(data), reservation)
        assert (handle is not None) == fits
        if handle is None:
            return None
        assert handle not in self.live
        self.live[handle] = data
        if reservation is not None and reservation.open:
            self.reserved[id(reservation)] -= min(self._pages(nbytes), from_reservation)
        return handle

    @rule(target=handles, nbytes=st.integers(1, 5 * 64))
    def store(self, nbytes: int) -> SlotHandle | None:
        return self._store(nbytes, None)

    @rule(target=handles, reservation=reservations, nbytes=st.integers(1, 4 * 64))
    def store_into_reservation(self, reservation: Reservation, nbytes: int) -> SlotHandle | None:
        return self._store(nbytes, reservation)

    @rule(handle=consumes(handles))
    def free(self, handle: SlotHandle | None) -> None:
        if handle is None:
            return
        self.pool.free(handle)
        del self.live[handle]
        self.stale.append(handle)

    @rule(target=reservations, nbytes=st.integers(1, 6 * 64))
    def reserve(self, nbytes: int) -> Reservation | None:
        fits = self._pages(nbytes) <= self._free_pages()
        reservation = self.pool.reserve(nbytes)
        assert (reservation is not None) == fits
        if reservation is not None:
            self.reserved[id(reservation)] = self._pages(nbytes)
        return reservation

    @rule(reservation=reservations)
    def close(self, reservation: Reservation | None) -> None:
        if reservation is None:
            return
        self.pool.close_reservation(reservation)  # again and again: idempotent
        self.reserved.pop(id(reservation), None)

    @precondition(lambda self: self.stale)
    @rule(data=st.data())
    def stale_handle_never_reads(self, data: st.DataObject) -> None:
        handle = data.draw(st.sampled_from(self.stale))
        with pytest.raises(StaleSlotError):
            self.pool.views(handle)

    @invariant()
    def accounting_is_exact_and_bytes_are_intact(self) -> None:
        pool = self.pool
        pool.check_invariants()
        s = pool.statistics()
        assert s.stored_bytes == sum(len(d) for d in self.live.values())
        assert s.slots_in_use == len(self.live)
        assert s.reserved_bytes == sum(self.reserved.values()) * 64
        assert s.reservations_open == len(self.reserved)
        assert s.free_bytes == self._free_pages() * 64
        for handle, data in self.live.items():
            assert joined(pool, handle) == data
        for handle in self.stale:
            assert not pool.is_live(handle)


PoolMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_pool_state_machine = PoolMachine.TestCase
