"""Tests of producer_service.lot.Lot over a real HostPool and a FakeClock: Park batches, Fetch
bindings, leases, the reaper, tombstones, KeepAlive intents, Release and shutdown (spec §3).

Every scenario goes through `Rig`, whose `lot` runs `check_invariants()` after every call, and
which copies a ReadyChunk's bytes before the next lot call (as the servicer does). A hypothesis
state machine at the end drives random operations and checks that no Fetch ever sees a byte
other than the ones parked under that id and chunk_id."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from conftest import FakeClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb
from kvpark.producer.lot import (
    ALREADY_BOUND,
    ALREADY_CONSUMED,
    CHECKSUM_MISMATCH,
    CHUNK_CONFLICT,
    EPOCH_MISMATCH,
    POOL_FULL,
    REAPED,
    RELEASED,
    SHUTTING_DOWN,
    TOO_LARGE,
    UNKNOWN_ID,
    WAIT_TIMEOUT,
    FetchBinding,
    FetchEnd,
    FetchWait,
    IdStatus,
    Lot,
    LotSettings,
    MalformedRequest,
    ParkBatch,
    ParkDone,
    ReadyChunk,
    Refusal,
)
from kvpark.producer.pool import HostPool

PAGE = 64
EPOCH = 0x5EED_1234
SETTINGS = LotSettings(
    unbound_store_timeout_s=60.0,
    tombstone_retention_s=120.0,
    max_lease_s=600.0,
    max_fetch_wait_s=30.0,
    max_tombstones=1000,
    reap_interval_s=0.25,
)


def blob(kid: str, chunk_id: int, nbytes: int = 3 * PAGE + 5, variant: int = 0) -> bytes:
    """Deterministic random bytes for one chunk, different for every (id, chunk, variant)."""
    seed = [*kid.encode(), chunk_id, nbytes, variant]
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class CheckedLot:
    """The real Lot, with `check_invariants()` run after every call a test makes on it."""

    def __init__(self, lot: Lot) -> None:
        self._lot = lot

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._lot, name)
        if not callable(attr):
            return attr

        def checked(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self._lot.check_invariants()
            return result

        return checked


class Rig:
    """A Lot over a real pool and a FakeClock. `lot` checks invariants after every call;
    `raw` is the same Lot unchecked, for the large-scale test."""

    def __init__(self, pool_pages: int = 256, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.pool = HostPool(pool_pages * PAGE, page_bytes=PAGE)
        self.settings = dataclasses.replace(SETTINGS, **overrides)
        self.raw = Lot(self.pool, self.settings, epoch=EPOCH, clock=self.clock)
        self.lot: Any = CheckedLot(self.raw)
        self.notified: dict[str, int] = {}

    def check(self) -> None:
        self.raw.check_invariants()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def reap(self) -> list[str]:
        reaped: list[str] = self.lot.reap()
        return reaped

    def begin(self, kid: str, total: int = 0, batch_bytes: int = 0) -> ParkBatch:
        batch = self.lot.begin_park(kid, total, batch_bytes)
        assert isinstance(batch, ParkBatch), batch
        return batch

    def chunk(self, batch: ParkBatch, chunk_id: int, data: bytes, crc: int | None = None) -> None:
        """Parks one chunk that must be accepted."""
        refused = self.lot.park_chunk(
            batch, chunk_id, memoryview(data), crc32c_of(data) if crc is None else crc
        )
        assert refused is None, refused

    def park(
        self,
        kid: str,
        chunks: dict[int, bytes] | Iterable[int],
        total: int = 0,
        batch_bytes: int = 0,
        crcs: dict[int, int] | None = None,
    ) -> ParkDone | Refusal:
        """One whole Park call: header, chunks, end of stream. Stops at the first refusal."""
        if not isinstance(chunks, dict):
            chunks = {cid: blob(kid, cid) for cid in chunks}
        opened = self.lot.begin_park(kid, total, batch_bytes)
        if isinstance(opened, Refusal):
            return opened
        for cid, data in chunks.items():
            crc = (crcs or {}).get(cid, crc32c_of(data))
            refused = self.lot.park_chunk(opened, cid, memoryview(data), crc)
            if refused is not None:
                return refused
        done: ParkDone | Refusal = self.lot.finish_park(opened)
        return done

    def parked(
        self, kid: str, chunks: dict[int, bytes] | Iterable[int], total: int = 0
    ) -> ParkDone:
        done = self.park(kid, chunks, total)
        assert isinstance(done, ParkDone), done
        return done

    def bind(
        self,
        kid: str,
        chunk_ids: Sequence[int] = (),
        epoch: int = 0,
        wait_s: float = 0.0,
    ) -> FetchBinding | Refusal:
        self.notified.setdefault(kid, 0)

        def notify() -> None:
            self.notified[kid] += 1

        bound: FetchBinding | Refusal = self.lot.bind_fetch(kid, chunk_ids, epoch, wait_s, notify)
        return bound

    def bound(self, kid: str, chunk_ids: Sequence[int] = (), wait_s: float = 0.0) -> FetchBinding:
        binding = self.bind(kid, chunk_ids, wait_s=wait_s)
        assert isinstance(binding, FetchBinding), binding
        return binding

    def next(self, binding: FetchBinding) -> tuple[int, bytes] | FetchWait | FetchEnd:
        """One next_for step; a ReadyChunk comes back as (chunk_id, bytes copied now)."""
        step = self.lot.next_for(binding)  # the views stay valid until the next lot call
        if isinstance(step, ReadyChunk):
            data = b"".join(bytes(v) for v in step.views)
            assert len(data) == step.nbytes and crc32c_of(data) == step.crc32c
            return step.chunk_id, data
        assert isinstance(step, FetchWait | FetchEnd)
        return step

    def drain(self, binding: FetchBinding) -> tuple[list[tuple[int, bytes]], FetchWait | FetchEnd]:
        """Steps a Fetch until it must wait or has ended."""
        sent: list[tuple[int, bytes]] = []
        while True:
            step = self.next(binding)
            if isinstance(step, tuple):
                sent.append(step)
            else:
                return sent, step

    def state(self, kid: str) -> IdStatus:
        (status,) = self.raw.lookup([kid])
        return status

    def assert_pool_empty(self) -> None:
        s = self.pool.statistics()
        assert (s.used_bytes, s.stored_bytes, s.reservations_open) == (0, 0, 0), s


def assert_refused(outcome: object, reason: int, late: bool | None = None) -> Refusal:
    assert isinstance(outcome, Refusal), outcome
    assert outcome.reason == reason, (pb.FailureReason.Name(outcome.reason), outcome.detail)
    if late is not None:
        assert outcome.late is late
    return outcome


def assert_tombstoned(rig: Rig, kid: str, reason: int) -> None:
    status = rig.state(kid)
    assert (status.state, status.reason) == (pb.STATE_TOMBSTONED, reason), status


@pytest.fixture
def rig() -> Rig:
    return Rig()


# === happy path ================================================================================


def test_parked_chunks_stream_in_requested_order_then_the_id_is_consumed(rig: Rig) -> None:
    data = {cid: blob("req", cid, 2 * PAGE + 7 * cid + 1) for cid in range(4)}
    done = rig.parked("req", data, total=4)
    assert done == ParkDone(chunks_parked=4, lease_remaining_s=60.0)
    binding = rig.bound("req", [2, 0, 3, 1])
    sent, end = rig.drain(binding)
    assert sent == [(cid, data[cid]) for cid in (2, 0, 3, 1)]
    assert end == FetchEnd(None, chunks_sent=4, bytes_sent=sum(map(len, data.values())))
    assert_tombstoned(rig, "req", ALREADY_CONSUMED)
    rig.assert_pool_empty()
    stats = rig.lot.statistics()
    assert (stats.consumed_total, stats.parked_ids, stats.bound_ids, stats.parked_bytes) == (
        1, 0, 0, 0,
    )  # fmt: skip


def test_fetch_without_chunk_ids_streams_all_chunks_in_order(rig: Rig) -> None:
    data = {cid: blob("all", cid) for cid in (2, 0, 1)}  # parked out of order
    rig.parked("all", data, total=3)
    sent, end = rig.drain(rig.bound("all"))
    assert sent == [(0, data[0]), (1, data[1]), (2, data[2])]
    assert isinstance(end, FetchEnd) and end.refusal is None


def test_fetch_of_a_subset_consumes_and_frees_the_whole_id(rig: Rig) -> None:
    rig.parked("sub", range(4), total=4)
    sent, end = rig.drain(rig.bound("sub", [3]))
    assert sent == [(3, blob("sub", 3))]
    assert isinstance(end, FetchEnd) and end.refusal is None
    assert_tombstoned(rig, "sub", ALREADY_CONSUMED)
    rig.assert_pool_empty()


def test_later_batches_add_chunks_to_the_same_id(rig: Rig) -> None:
    rig.parked("multi", [0, 1])
    assert rig.parked("multi", [2], total=3).chunks_parked == 3
    status = rig.state("multi")
    assert (status.chunks_parked, status.total_chunks) == (3, 3)
    assert status.nbytes == 3 * len(blob("multi", 0))


def test_an_acknowledged_retry_keeps_its_chunks_when_the_first_attempt_fails(rig: Rig) -> None:
    """Two batches of one id (a retry or a hedge) send the same bytes: the second finishes OK
    while the first, which stored them, is still open. The first then fails (a bad CRC): what
    the second was acknowledged for stays parked."""
    first = rig.begin("hedge", total=2)
    for cid in (0, 1):
        rig.chunk(first, cid, blob("hedge", cid))
    second = rig.begin("hedge", total=2)
    for cid in (0, 1):
        rig.chunk(second, cid, blob("hedge", cid))  # identical: idempotent
    assert rig.lot.finish_park(second) == ParkDone(2, 60.0)
    assert_refused(rig.lot.park_chunk(first, 1, memoryview(b"x"), 1), CHECKSUM_MISMATCH)
    sent, _ = rig.drain(rig.bound("hedge"))
    assert sent == [(0, blob("hedge", 0)), (1, blob("hedge", 1))]


def test_a_failing_batch_hands_chunks_to_an_open_batch_that_sent_them_too(rig: Rig) -> None:
    """The same two batches, the other way round: the first fails while the second is still
    open; the chunks pass to the second, which stands or falls with them."""
    first = rig.begin("hedge", total=2)
    rig.chunk(first, 0, blob("hedge", 0))
    second = rig.begin("hedge", total=2)
    rig.chunk(second, 0, blob("hedge", 0))  # identical: relies on the first's copy
    rig.lot.abort_park(first)  # the first attempt's client went away
    assert rig.state("hedge").chunks_parked == 1
    rig.chunk(second, 1, blob("hedge", 1))
    assert rig.lot.finish_park(second) == ParkDone(2, 60.0)
    sent, _ = rig.drain(rig.bound("hedge"))
    assert [cid for cid, _ in sent] == [0, 1]
    # And had the second failed as well, nothing would be left of the id.
    third = rig.begin("other", total=2)
    rig.chunk(third, 0, blob("other", 0))
    fourth = rig.begin("other", total=2)
    rig.chunk(fourth, 0, blob("other", 0))
    rig.lot.abort_park(third)
    rig.lot.abort_park(fourth)
    assert rig.state("other").state == pb.STATE_UNKNOWN


# === leases and the reaper =====================================================================


def test_lease_starts_at_the_first_chunk_not_at_the_header(rig: Rig) -> None:
    batch = rig.begin("slow")
    rig.advance(40)
    rig.chunk(batch, 0, blob("slow", 0))
    done = rig.lot.finish_park(batch)
    assert done == ParkDone(1, 60.0)
    rig.advance(59.9)
    assert rig.reap() == []
    assert rig.state("slow").lease_remaining_s == pytest.approx(0.1)
    rig.advance(0.1)
    assert rig.reap() == ["slow"]


def test_unfetched_id_is_reaped_after_its_lease_and_its_memory_freed(rig: Rig) -> None:
    rig.parked("lost", range(3))
    assert rig.pool.statistics().stored_bytes == 3 * len(blob("lost", 0))
    rig.advance(59.99)
    assert rig.reap() == []
    assert rig.state("lost").state == pb.STATE_PARKED
    rig.advance(0.01)
    assert rig.reap() == ["lost"]
    assert_tombstoned(rig, "lost", REAPED)
    rig.assert_pool_empty()
    assert rig.lot.statistics().reaped_total == 1
    assert rig.lot.next_lease_deadline() is None


def test_late_fetch_after_reap_is_refused_reaped_at_once_and_not_bound(rig: Rig) -> None:
    rig.parked("late", range(2))
    rig.advance(61)
    rig.reap()
    refusal = assert_refused(rig.bind("late"), REAPED, late=True)
    assert "REASON_REAPED" in refusal.detail
    stats = rig.lot.statistics()
    assert (stats.late_fetch_rejections_total, stats.bound_ids) == (1, 0)
    assert_tombstoned(rig, "late", REAPED)


def test_park_after_reap_is_refused_without_storing_and_the_late_fetch_still_says_reaped(
    rig: Rig,
) -> None:
    rig.parked("late", range(2))
    rig.advance(61)
    rig.reap()
    assert_refused(rig.park("late", range(2), total=2, batch_bytes=1000), REAPED, late=True)
    rig.assert_pool_empty()
    assert rig.lot.statistics().late_park_rejections_total == 1
    assert_refused(rig.bind("late"), REAPED, late=True)


def test_tombstones_are_pruned_after_retention_even_when_nothing_is_parked(rig: Rig) -> None:
    rig.parked("gone", [0])
    rig.advance(60)
    rig.reap()
    assert rig.lot.statistics().parked_ids == 0
    rig.advance(119.9)
    rig.reap()
    assert_tombstoned(rig, "gone", REAPED)
    assert rig.state("gone").age_s == pytest.approx(119.9)
    rig.advance(0.1)
    rig.reap()
    assert rig.state("gone") == IdStatus("gone", pb.STATE_UNKNOWN)
    assert rig.lot.statistics().tombstones == 0
    # The id is free again: a new life starts over.
    assert rig.parked("gone", [0]).chunks_parked == 1


def test_tombstones_are_capped_oldest_first() -> None:
    rig = Rig(max_tombstones=3)
    for i in range(5):
        rig.parked(f"id{i}", [0])
        assert rig.lot.release(f"id{i}") is None
        rig.advance(1)
    assert rig.lot.statistics().tombstones == 3
    assert [rig.state(f"id{i}").state for i in range(5)] == [
        pb.STATE_UNKNOWN, pb.STATE_UNKNOWN,
        pb.STATE_TOMBSTONED, pb.STATE_TOMBSTONED, pb.STATE_TOMBSTONED,
    ]  # fmt: skip


def test_one_pass_ends_plain_and_open_batch_ids_and_keeps_the_newest_tombstones() -> None:
    """A pass that ends more ids than `max_tombstones` keeps the same tombstones as ending them
    one at a time would: the newest, oldest dropped first. Ids with an open Park batch are
    ended in the same pass; bound and unexpired ids are left alone."""
    rig = Rig(max_tombstones=3)
    rig.parked("released", [0])
    assert rig.lot.release("released") is None
    busy = rig.bound("busy")  # a demand: bound before any chunk, so never on a lease
    for i in range(4):
        rig.parked(f"id{i}", [0, 1])
        rig.advance(1)
    batch = rig.begin("open", batch_bytes=3 * PAGE)
    rig.chunk(batch, 0, blob("open", 0, PAGE))
    rig.advance(30)
    rig.parked("young", [0])
    rig.advance(30)  # every lease but young's has run out

    assert rig.reap() == ["id0", "id1", "id2", "id3", "open"]

    assert rig.lot.statistics().tombstones == 3
    for kid in ("released", "id0", "id1"):
        assert rig.state(kid).state == pb.STATE_UNKNOWN
    for kid in ("id2", "id3", "open"):
        assert_tombstoned(rig, kid, REAPED)
        assert rig.state(kid).age_s == 0
    assert_refused(rig.lot.finish_park(batch), REAPED)
    assert rig.state("young").state == pb.STATE_PARKED
    assert rig.state("busy").state == pb.STATE_BOUND and busy.active
    stats = rig.lot.statistics()
    assert (stats.parked_ids, stats.bound_ids, stats.reaped_total) == (1, 1, 5)
    assert stats.parked_bytes == rig.pool.statistics().stored_bytes == len(blob("young", 0))
    assert rig.pool.statistics().reservations_open == 0


def test_bound_id_is_not_reaped_while_its_fetch_is_attached(rig: Rig) -> None:
    rig.parked("busy", [0, 1], total=2)
    binding = rig.bound("busy")
    rig.advance(1000)
    assert rig.reap() == []
    assert rig.state("busy").state == pb.STATE_BOUND
    sent, end = rig.drain(binding)
    assert [cid for cid, _ in sent] == [0, 1]
    assert isinstance(end, FetchEnd) and end.refusal is None


def test_reaper_pass_touches_only_expired_ids() -> None:
    """100k parked ids, 1k of them expired: a pass pops 1k lease items, not 100k (spec §3
    Reaper: O(expired · log n)). Counted, not timed."""
    rig = Rig(pool_pages=100_000)
    lot = rig.raw  # unchecked: 300k calls
    one = memoryview(b"\x01")
    for i in range(100_000):
        if i == 1_000:
            rig.advance(30)  # the rest are parked 30 s later, so their leases end later
        batch = lot.begin_park(f"id{i}", 1, 0)
        assert isinstance(batch, ParkBatch)
        assert lot.park_chunk(batch, 0, one, 0) is None
        assert isinstance(lot.finish_park(batch), ParkDone)
    rig.advance(31)
    before = len(lot._leases)
    pops_before = lot._leases.pops

    reaped = lot.reap()

    assert reaped == [f"id{i}" for i in range(1_000)]
    assert lot._leases.pops - pops_before == 1_000
    assert before - len(lot._leases) == 1_000
    stats = lot.statistics()
    assert (stats.parked_ids, stats.reaped_total, stats.parked_bytes) == (99_000, 1_000, 99_000)
    assert rig.pool.statistics().stored_bytes == 99_000
    pops_before = lot._leases.pops
    assert lot.reap() == [] and lot._leases.pops == pops_before  # the next pass touches nothing
    rig.check()


def test_lease_heap_stays_small_when_a_fetch_binds_and_cancels_over_and_over(rig: Rig) -> None:
    """Each cancel re-arms the lease; re-arming must not pile up live-looking duplicates that
    no rebuild can drop (the lot promises a heap of O(parked) items)."""
    rig.parked("retry", [0])
    for _ in range(5_000):
        rig.lot.cancel_fetch(rig.bound("retry"))
    rig.reap()
    assert len(rig.lot._leases) <= 10, len(rig.lot._leases)
    rig.advance(60)
    assert rig.reap() == ["retry"]
    assert rig.lot.reaped_total == 1


# === fetch before park, waiting, binding rules ===================================================


def test_fetch_before_park_gets_chunks_as_parks_deliver_them_and_is_notified(rig: Rig) -> None:
    binding = rig.bound("early", wait_s=10)
    assert rig.state("early").state == pb.STATE_BOUND
    assert rig.next(binding) == FetchWait(deadline=rig.clock.now + 10)
    batch = rig.begin("early", total=2)
    assert rig.notified["early"] == 1  # the total became known
    rig.chunk(batch, 1, blob("early", 1))
    assert rig.notified["early"] == 2
    assert isinstance(rig.next(binding), FetchWait)  # chunk 0 comes first and is not there
    rig.chunk(batch, 0, blob("early", 0))
    assert rig.notified["early"] == 3
    sent, end = rig.drain(binding)
    assert sent == [(0, blob("early", 0)), (1, blob("early", 1))]
    assert isinstance(end, FetchEnd) and end.refusal is None
    assert_tombstoned(rig, "early", ALREADY_CONSUMED)
    rig.assert_pool_empty()


def test_park_whose_chunks_were_all_consumed_before_its_stream_ended_still_succeeds(
    rig: Rig,
) -> None:
    """The Fetch may finish between the last chunk and the Park's end of stream: every chunk
    of the batch was delivered, so the Park succeeds (no FAILED for a handoff that worked)."""
    binding = rig.bound("race")
    batch = rig.begin("race", total=2)
    rig.chunk(batch, 0, blob("race", 0))
    rig.chunk(batch, 1, blob("race", 1))
    sent, end = rig.drain(binding)
    assert [cid for cid, _ in sent] == [0, 1]
    assert isinstance(end, FetchEnd) and end.refusal is None
    assert rig.lot.finish_park(batch) == ParkDone(chunks_parked=2, lease_remaining_s=0.0)
    rig.assert_pool_empty()
    assert_tombstoned(rig, "race", ALREADY_CONSUMED)


def test_chunks_parked_after_the_id_was_consumed_are_refused_and_not_stored(rig: Rig) -> None:
    binding = rig.bound("subset", [0])
    batch = rig.begin("subset", total=3)
    rig.chunk(batch, 0, blob("subset", 0))
    sent, end = rig.drain(binding)
    assert len(sent) == 1 and isinstance(end, FetchEnd) and end.refusal is None
    refused = rig.lot.park_chunk(batch, 1, memoryview(blob("subset", 1)), 0)
    assert_refused(refused, ALREADY_CONSUMED)
    rig.assert_pool_empty()


def test_wait_expiry_returns_an_id_holding_chunks_to_parked(rig: Rig) -> None:
    rig.parked("part", [0], total=2)
    rig.advance(5)
    binding = rig.bound("part", wait_s=4)
    sent, step = rig.drain(binding)
    assert sent == [(0, blob("part", 0))]
    assert step == FetchWait(deadline=rig.clock.now + 4)
    rig.advance(4)
    end = rig.lot.fetch_wait_expired(binding)
    assert end.refusal is not None and end.refusal.reason == WAIT_TIMEOUT
    assert "chunk 1" in end.refusal.detail
    assert (end.chunks_sent, end.bytes_sent) == (1, len(blob("part", 0)))
    status = rig.state("part")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 51.0,
    )  # fmt: skip
    # A retry after the missing chunk arrives gets everything.
    rig.parked("part", [1])
    sent, end = rig.drain(rig.bound("part"))
    assert [cid for cid, _ in sent] == [0, 1]
    assert isinstance(end, FetchEnd) and end.refusal is None


def test_wait_expiry_of_a_fetch_before_any_park_forgets_the_id(rig: Rig) -> None:
    binding = rig.bound("never", wait_s=3)
    assert isinstance(rig.next(binding), FetchWait)
    rig.advance(3)
    end = rig.lot.fetch_wait_expired(binding)
    assert end == FetchEnd(end.refusal, 0, 0)
    assert end.refusal is not None and end.refusal.reason == WAIT_TIMEOUT
    assert rig.state("never") == IdStatus("never", pb.STATE_UNKNOWN)
    stats = rig.lot.statistics()
    assert (stats.parked_ids, stats.bound_ids, stats.tombstones) == (0, 0, 0)


@pytest.mark.parametrize(("asked", "granted"), [(0.0, 30.0), (5.0, 5.0), (100.0, 30.0)])
def test_wait_is_the_smaller_of_the_request_and_max_fetch_wait(
    rig: Rig, asked: float, granted: float
) -> None:
    binding = rig.bound("w", wait_s=asked)
    assert binding.wait_deadline == rig.clock.now + granted


def test_second_fetch_is_refused_already_bound(rig: Rig) -> None:
    rig.parked("one", [0], total=1)
    first = rig.bound("one")
    assert_refused(rig.bind("one"), ALREADY_BOUND, late=False)
    sent, end = rig.drain(first)  # the first Fetch is unaffected
    assert len(sent) == 1 and isinstance(end, FetchEnd) and end.refusal is None
    rig.bound("demand")
    assert_refused(rig.bind("demand"), ALREADY_BOUND)


def test_cancelled_fetch_returns_the_id_to_parked_with_its_old_lease(rig: Rig) -> None:
    rig.parked("c", [0, 1], total=2)
    rig.advance(20)
    binding = rig.bound("c")
    assert rig.next(binding) == (0, blob("c", 0))
    rig.advance(10)
    rig.lot.cancel_fetch(binding)
    status = rig.state("c")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 2, 30.0,
    )  # fmt: skip
    rig.lot.cancel_fetch(binding)  # twice is harmless
    end = rig.next(binding)
    assert isinstance(end, FetchEnd) and end.refusal is not None
    # A retry within the lease works and sees every chunk again.
    sent, end = rig.drain(rig.bound("c"))
    assert [cid for cid, _ in sent] == [0, 1]
    assert isinstance(end, FetchEnd) and end.refusal is None


def test_cancel_after_the_old_lease_ran_out_is_reaped_on_the_next_pass(rig: Rig) -> None:
    rig.parked("c", [0])
    rig.advance(50)
    binding = rig.bound("c")
    rig.advance(20)  # past the old deadline, but bound: the lease is stopped
    assert rig.reap() == []
    rig.lot.cancel_fetch(binding)
    assert rig.state("c").lease_remaining_s == 0.0
    assert rig.reap() == ["c"]
    assert_tombstoned(rig, "c", REAPED)
    rig.assert_pool_empty()


def test_cancelled_demand_keeps_chunks_that_arrived_with_their_lease(rig: Rig) -> None:
    binding = rig.bound("d", [0, 1])
    rig.advance(5)
    rig.parked("d", [1])  # lease starts now, although the id is bound
    rig.advance(5)
    rig.lot.cancel_fetch(binding)
    status = rig.state("d")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 55.0,
    )  # fmt: skip
    rig.advance(55)
    assert rig.reap() == ["d"]


def test_cancelled_demand_without_chunks_leaves_nothing_behind(rig: Rig) -> None:
    rig.lot.cancel_fetch(rig.bound("nothing"))
    assert rig.state("nothing") == IdStatus("nothing", pb.STATE_UNKNOWN)
    assert rig.lot.statistics().tombstones == 0


# === KeepAlive ====================================================================================


def test_keepalive_extends_a_parked_lease_past_the_unbound_timeout(rig: Rig) -> None:
    rig.parked("k", [0])
    rig.advance(50)
    (status,) = rig.lot.keep_alive(["k"], 200)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_PARKED, 200.0)
    rig.advance(199.9)
    assert rig.reap() == []
    rig.advance(0.1)
    assert rig.reap() == ["k"]


def test_keepalive_never_extends_beyond_max_lease_after_the_first_chunk(rig: Rig) -> None:
    rig.parked("k", [0])
    rig.advance(500)
    assert rig.lot.keep_alive(["k"], 300)[0].lease_remaining_s == 100.0
    assert rig.lot.keep_alive(["k"], 10_000)[0].lease_remaining_s == 100.0
    rig.advance(100)
    assert rig.reap() == ["k"]


def test_keepalive_never_shortens_a_lease(rig: Rig) -> None:
    rig.parked("k", [0])
    assert rig.lot.keep_alive(["k"], 10)[0].lease_remaining_s == 60.0


def test_keepalive_without_extend_uses_the_unbound_store_timeout(rig: Rig) -> None:
    rig.parked("k", [0])
    rig.advance(30)
    assert rig.lot.keep_alive(["k"], 0)[0].lease_remaining_s == 60.0


def test_keepalive_answers_the_state_of_each_id(rig: Rig) -> None:
    rig.parked("parked", [0])
    rig.parked("gone", [0])
    assert rig.lot.release("gone") is None
    states = rig.lot.keep_alive(["parked", "gone", "new"], 100)
    assert [(s.kv_request_id, s.state) for s in states] == [
        ("parked", pb.STATE_PARKED),
        ("gone", pb.STATE_TOMBSTONED),
        ("new", pb.STATE_UNKNOWN),
    ]
    assert states[1].reason == RELEASED
    assert states[2].lease_remaining_s == 100.0
    assert rig.lot.statistics().intents == 1  # no intent for the tombstoned id


def test_keepalive_on_a_bound_id_takes_effect_when_the_fetch_is_cancelled(rig: Rig) -> None:
    rig.parked("k", [0])
    binding = rig.bound("k")
    (status,) = rig.lot.keep_alive(["k"], 300)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_BOUND, 0.0)
    rig.advance(100)
    rig.lot.cancel_fetch(binding)
    assert rig.state("k").lease_remaining_s == 200.0


def test_keepalive_before_park_makes_the_lease_start_from_the_intent(rig: Rig) -> None:
    (status,) = rig.lot.keep_alive(["early"], 200)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_UNKNOWN, 200.0)
    assert rig.lot.statistics().intents == 1
    rig.advance(50)
    assert rig.parked("early", [0]).lease_remaining_s == 150.0
    assert rig.lot.statistics().intents == 0  # consumed by the first chunk
    rig.advance(149.9)
    assert rig.reap() == []
    rig.advance(0.1)
    assert rig.reap() == ["early"]


def test_intent_shorter_than_the_unbound_timeout_does_not_shorten_the_lease(rig: Rig) -> None:
    rig.lot.keep_alive(["short"], 10)
    assert rig.parked("short", [0]).lease_remaining_s == 60.0


def test_intent_is_capped_at_max_lease(rig: Rig) -> None:
    (status,) = rig.lot.keep_alive(["far"], 1e9)
    assert status.lease_remaining_s == 600.0
    assert rig.parked("far", [0]).lease_remaining_s == 600.0


def test_intent_is_never_shortened_by_a_later_keepalive(rig: Rig) -> None:
    rig.lot.keep_alive(["i"], 100)
    assert rig.lot.keep_alive(["i"], 20)[0].lease_remaining_s == 100.0


def test_intents_expire_at_their_own_deadline(rig: Rig) -> None:
    rig.lot.keep_alive(["x"], 100)
    rig.advance(99)
    rig.reap()
    assert rig.lot.statistics().intents == 1
    rig.advance(1)
    rig.reap()
    assert rig.lot.statistics().intents == 0
    assert rig.state("x") == IdStatus("x", pb.STATE_UNKNOWN)
    assert rig.parked("x", [0]).lease_remaining_s == 60.0


def test_intents_are_capped_oldest_first() -> None:
    rig = Rig(max_tombstones=3)
    for i in range(5):
        rig.lot.keep_alive([f"i{i}"], 100)
    assert rig.lot.statistics().intents == 3
    assert [rig.state(f"i{i}").lease_remaining_s for i in range(5)] == [0, 0, 100, 100, 100]


def test_keepalive_intent_survives_a_failed_first_batch(rig: Rig) -> None:
    """The id is still not parked after its first batch failed: the intent must still hold."""
    rig.lot.keep_alive(["k"], 300)
    data = {0: blob("k", 0), 1: blob("k", 1)}
    refused = rig.park("k", data, crcs={1: crc32c_of(data[1]) ^ 1})
    assert_refused(refused, CHECKSUM_MISMATCH)
    assert rig.state("k") == IdStatus("k", pb.STATE_UNKNOWN, lease_remaining_s=300.0)
    rig.advance(10)
    assert rig.parked("k", data).lease_remaining_s == 290.0


def test_keepalive_intent_is_not_shortened_by_a_batch_that_parked_nothing(rig: Rig) -> None:
    rig.lot.keep_alive(["k"], 300)
    batch = rig.begin("k")  # the id now has an entry, but no chunk
    rig.lot.keep_alive(["k"], 100)
    assert isinstance(rig.lot.finish_park(batch), ParkDone)  # an empty batch
    assert rig.state("k").lease_remaining_s == 300.0
    assert rig.parked("k", [0]).lease_remaining_s == 300.0


# === Release =====================================================================================


def test_release_frees_a_parked_id_and_tombstones_it_released(rig: Rig) -> None:
    rig.parked("r", range(3))
    assert rig.lot.release("r") is None
    rig.assert_pool_empty()
    assert_tombstoned(rig, "r", RELEASED)
    assert rig.lot.statistics().released_total == 1
    assert_refused(rig.bind("r"), RELEASED, late=True)
    assert_refused(rig.lot.release("r"), RELEASED)


def test_release_of_a_bound_id_is_refused_already_bound(rig: Rig) -> None:
    rig.parked("r", [0], total=1)
    binding = rig.bound("r")
    assert_refused(rig.lot.release("r"), ALREADY_BOUND)
    sent, end = rig.drain(binding)
    assert sent == [(0, blob("r", 0))]
    assert isinstance(end, FetchEnd) and end.refusal is None


def test_release_of_an_unknown_id_is_refused_unknown_id(rig: Rig) -> None:
    assert_refused(rig.lot.release("who"), UNKNOWN_ID)


def test_release_of_a_reaped_id_answers_reaped(rig: Rig) -> None:
    rig.parked("r", [0])
    rig.advance(60)
    rig.reap()
    assert_refused(rig.lot.release("r"), REAPED)


def test_release_forgets_a_keepalive_intent(rig: Rig) -> None:
    rig.lot.keep_alive(["r"], 100)
    assert_refused(rig.lot.release("r"), UNKNOWN_ID)
    assert rig.lot.statistics().intents == 0
    assert rig.state("r").lease_remaining_s == 0.0


# === pool pressure and all-or-nothing batches ====================================================


def test_declared_batch_larger_than_free_memory_is_refused_pool_full_with_retry_after() -> None:
    rig = Rig(pool_pages=16)
    rig.parked("a", {0: blob("a", 0, 10 * PAGE)})
    rig.advance(20)
    refused = assert_refused(rig.park("b", [0], batch_bytes=7 * PAGE), POOL_FULL)
    assert refused.retry_after_s == 40.0  # when "a"'s lease runs out
    assert rig.state("b").state == pb.STATE_UNKNOWN
    assert rig.pool.statistics().stored_bytes == 10 * PAGE
    rig.advance(39.9)
    refused = assert_refused(rig.park("b", [0], batch_bytes=7 * PAGE), POOL_FULL)
    assert refused.retry_after_s == 0.25  # never less than one reaper interval


def test_pool_full_without_any_lease_still_says_when_to_retry() -> None:
    rig = Rig(pool_pages=16)
    rig.begin("holder", batch_bytes=16 * PAGE)  # the whole pool is reserved, nothing parked
    refused = assert_refused(rig.park("b", [0], batch_bytes=PAGE), POOL_FULL)
    assert refused.retry_after_s > 0


def test_declared_batch_larger_than_the_pool_is_refused_too_large() -> None:
    rig = Rig(pool_pages=16)
    assert_refused(rig.park("huge", [0], batch_bytes=16 * PAGE + 1), TOO_LARGE)
    rig.assert_pool_empty()
    assert rig.state("huge").state == pb.STATE_UNKNOWN
    assert isinstance(
        rig.park("whole", {0: blob("w", 0, 16 * PAGE)}, batch_bytes=16 * PAGE), ParkDone
    )


def test_undeclared_batch_that_runs_out_of_pool_frees_everything_it_stored() -> None:
    rig = Rig(pool_pages=16)
    a = {0: blob("a", 0, 6 * PAGE)}
    rig.parked("a", a)
    rig.parked("b", {0: blob("b", 0, PAGE)})  # an earlier batch of b: it must survive
    batch = rig.begin("b")
    rig.chunk(batch, 1, blob("b", 1, 4 * PAGE))
    rig.chunk(batch, 2, blob("b", 2, 4 * PAGE))
    assert rig.pool.statistics().free_bytes == PAGE
    refused = rig.lot.park_chunk(batch, 3, memoryview(blob("b", 3, 2 * PAGE)), 0)
    assert_refused(refused, POOL_FULL)
    assert refused is not None and refused.retry_after_s > 0
    assert rig.pool.statistics().stored_bytes == 7 * PAGE
    assert rig.state("b").chunks_parked == 1
    # The failed batch stays failed, whatever comes after.
    assert rig.lot.park_chunk(batch, 4, memoryview(b"x"), 0) is refused
    assert rig.lot.finish_park(batch) is refused
    rig.lot.abort_park(batch)
    # Other ids' data and b's earlier batch are intact.
    assert rig.drain(rig.bound("a", [0]))[0] == [(0, a[0])]
    assert rig.drain(rig.bound("b", [0]))[0] == [(0, blob("b", 0, PAGE))]
    rig.assert_pool_empty()


def test_failed_first_batch_leaves_no_trace_of_the_id() -> None:
    rig = Rig(pool_pages=4)
    refused = rig.park("big", {0: blob("big", 0, 3 * PAGE), 1: blob("big", 1, 3 * PAGE)})
    assert_refused(refused, POOL_FULL)
    rig.assert_pool_empty()
    assert rig.state("big") == IdStatus("big", pb.STATE_UNKNOWN)
    assert rig.lot.statistics().tombstones == 0  # nothing was lost: a retry may start over


def test_declared_batch_cannot_be_starved_by_an_undeclared_one() -> None:
    rig = Rig(pool_pages=16)
    declared = rig.begin("decl", batch_bytes=8 * PAGE)
    assert_refused(rig.park("greedy", {0: blob("g", 0, 9 * PAGE)}), POOL_FULL)
    rig.chunk(declared, 0, blob("decl", 0, 4 * PAGE))
    rig.chunk(declared, 1, blob("decl", 1, 4 * PAGE))
    assert rig.lot.finish_park(declared) == ParkDone(2, 60.0)
    assert rig.pool.statistics().reservations_open == 0


def test_unused_reserved_pages_return_when_the_batch_ends(rig: Rig) -> None:
    batch = rig.begin("over", batch_bytes=10 * PAGE)
    assert rig.pool.statistics().reserved_bytes == 10 * PAGE
    rig.chunk(batch, 0, blob("over", 0, 2 * PAGE))
    assert isinstance(rig.lot.finish_park(batch), ParkDone)
    s = rig.pool.statistics()
    assert (s.reserved_bytes, s.used_bytes, s.reservations_open) == (0, 2 * PAGE, 0)


def test_aborted_batch_is_undone(rig: Rig) -> None:
    batch = rig.begin("cut", batch_bytes=4 * PAGE)
    rig.chunk(batch, 0, blob("cut", 0))
    rig.lot.abort_park(batch)
    rig.assert_pool_empty()
    assert rig.state("cut").state == pb.STATE_UNKNOWN


# === chunk rules ================================================================================


def test_same_chunk_again_with_identical_bytes_is_idempotent(rig: Rig) -> None:
    rig.parked("i", range(2))
    stored = rig.pool.statistics().stored_bytes
    assert rig.parked("i", {0: blob("i", 0)}) == ParkDone(2, 60.0)
    assert rig.pool.statistics().stored_bytes == stored


def test_same_chunk_with_other_bytes_is_a_conflict_and_undoes_the_batch(rig: Rig) -> None:
    rig.parked("i", {0: blob("i", 0)})
    other = {1: blob("i", 1), 0: blob("i", 0, variant=1)}
    assert_refused(rig.park("i", other), CHUNK_CONFLICT)
    status = rig.state("i")
    assert (status.chunks_parked, status.nbytes) == (1, len(blob("i", 0)))
    assert rig.drain(rig.bound("i", [0]))[0] == [(0, blob("i", 0))]


def test_same_chunk_with_other_bytes_of_the_same_length_and_crc_field_zero_conflicts(
    rig: Rig,
) -> None:
    rig.parked("i", {0: b"a" * 100})
    batch = rig.begin("i")
    assert_refused(rig.lot.park_chunk(batch, 0, memoryview(b"b" * 100), 0), CHUNK_CONFLICT)


def test_checksum_mismatch_undoes_the_batch(rig: Rig) -> None:
    data = {0: blob("crc", 0), 1: blob("crc", 1)}
    refused = rig.park("crc", data, crcs={1: crc32c_of(data[1]) ^ 0xDEAD})
    assert_refused(refused, CHECKSUM_MISMATCH)
    rig.assert_pool_empty()
    assert rig.state("crc").state == pb.STATE_UNKNOWN


def test_crc_zero_means_not_given_and_the_fetch_carries_the_real_crc(rig: Rig) -> None:
    data = blob("nocrc", 0)
    batch = rig.begin("nocrc", total=1)
    rig.chunk(batch, 0, data, crc=0)
    rig.lot.finish_park(batch)
    step = rig.lot.next_for(rig.bound("nocrc"))
    assert isinstance(step, ReadyChunk) and step.crc32c == crc32c_of(data)


def test_conflicting_total_chunks_is_refused(rig: Rig) -> None:
    rig.parked("t", [0], total=4)
    assert_refused(rig.lot.begin_park("t", 5, 0), CHUNK_CONFLICT)
    assert isinstance(rig.park("t", [1], total=4), ParkDone)  # the same total again is fine
    assert isinstance(rig.park("t", [2], total=0), ParkDone)  # and so is not saying it


def test_total_chunks_below_a_parked_chunk_is_refused(rig: Rig) -> None:
    rig.parked("u", [5])
    refusal = assert_refused(rig.lot.begin_park("u", 3, 0), CHUNK_CONFLICT)
    assert "chunk 5" in refusal.detail
    assert rig.state("u").total_chunks == 0


def test_total_chunks_below_a_chunk_a_bound_fetch_asks_for_is_refused(rig: Rig) -> None:
    rig.bound("v", [7])
    assert_refused(rig.lot.begin_park("v", 4, 0), CHUNK_CONFLICT)


def test_chunk_id_at_or_beyond_total_chunks_is_malformed_and_undoes_the_batch(rig: Rig) -> None:
    batch = rig.begin("m", total=2, batch_bytes=8 * PAGE)
    rig.chunk(batch, 0, blob("m", 0))
    with pytest.raises(MalformedRequest, match="out of range"):
        rig.lot.park_chunk(batch, 2, memoryview(blob("m", 2)), 0)
    rig.assert_pool_empty()
    assert rig.state("m").state == pb.STATE_UNKNOWN
    assert isinstance(rig.lot.finish_park(batch), Refusal)


def test_empty_chunk_is_malformed(rig: Rig) -> None:
    batch = rig.begin("e")
    with pytest.raises(MalformedRequest, match="no data"):
        rig.lot.park_chunk(batch, 0, memoryview(b""), 0)
    rig.assert_pool_empty()


def test_fetch_repeating_a_chunk_id_is_malformed_and_binds_nothing(rig: Rig) -> None:
    rig.parked("dup", [0, 1])
    with pytest.raises(MalformedRequest, match="repeats"):
        rig.bind("dup", [0, 1, 0])
    assert rig.state("dup").state == pb.STATE_PARKED
    with pytest.raises(MalformedRequest):
        rig.bind("nobody", [3, 3])
    assert rig.state("nobody").state == pb.STATE_UNKNOWN


def test_fetch_of_a_chunk_beyond_total_chunks_is_malformed(rig: Rig) -> None:
    rig.parked("range", [0, 1], total=2)
    with pytest.raises(MalformedRequest, match="out of range"):
        rig.bind("range", [0, 2])
    assert rig.state("range").state == pb.STATE_PARKED


def test_fetch_naming_another_epoch_is_refused_epoch_mismatch(rig: Rig) -> None:
    rig.parked("e", [0], total=1)
    assert_refused(rig.bind("e", epoch=EPOCH + 1), EPOCH_MISMATCH, late=False)
    assert rig.state("e").state == pb.STATE_PARKED
    assert_refused(rig.bind("unknown", epoch=EPOCH + 1), EPOCH_MISMATCH)
    assert rig.state("unknown").state == pb.STATE_UNKNOWN
    binding = rig.bind("e", epoch=EPOCH)
    assert isinstance(binding, FetchBinding)
    rig.lot.cancel_fetch(binding)
    assert isinstance(rig.bind("e", epoch=0), FetchBinding)  # 0 = any epoch


# === ids ending while a Park is open =============================================================


def test_reaping_an_id_while_a_park_batch_is_open_fails_the_batch_without_double_free(
    rig: Rig,
) -> None:
    batch = rig.begin("open", batch_bytes=10 * PAGE)
    rig.chunk(batch, 0, blob("open", 0))
    rig.advance(60)
    assert rig.reap() == ["open"]
    rig.assert_pool_empty()  # the chunk and the unused reservation are both back
    refused = rig.lot.park_chunk(batch, 1, memoryview(blob("open", 1)), 0)
    assert_refused(refused, REAPED)
    rig.assert_pool_empty()  # nothing stored for a dead id
    assert_refused(rig.lot.finish_park(batch), REAPED)
    rig.lot.abort_park(batch)  # what the servicer does in `finally`: a no-op now
    rig.assert_pool_empty()
    assert_tombstoned(rig, "open", REAPED)


def test_release_while_a_park_batch_is_open_fails_the_batch_released(rig: Rig) -> None:
    rig.parked("rel", [0])
    batch = rig.begin("rel", batch_bytes=4 * PAGE)
    rig.chunk(batch, 1, blob("rel", 1))
    assert rig.lot.release("rel") is None
    rig.assert_pool_empty()
    assert_refused(rig.lot.finish_park(batch), RELEASED)


# === shutdown ====================================================================================


def test_shutdown_refuses_new_parks_and_fetches(rig: Rig) -> None:
    rig.parked("p", [0], total=1)
    rig.parked("t", [0])
    assert rig.lot.release("t") is None
    rig.lot.begin_shutdown()
    assert rig.lot.statistics().shutting_down
    assert_refused(rig.park("new", [0]), SHUTTING_DOWN)
    assert_refused(rig.park("p", [1]), SHUTTING_DOWN)
    assert_refused(rig.bind("p"), SHUTTING_DOWN)
    assert_refused(rig.bind("new"), SHUTTING_DOWN)
    assert_refused(rig.bind("t"), RELEASED, late=True)  # a tombstone still answers its reason
    assert rig.state("p").state == pb.STATE_PARKED


def test_bound_fetches_are_served_during_shutdown_then_fail_all_ends_the_rest(rig: Rig) -> None:
    rig.parked("served", [0, 1], total=2)
    rig.parked("waiting", [0], total=2)
    rig.parked("idle", [0])
    served, waiting = rig.bound("served"), rig.bound("waiting")
    open_batch = rig.begin("parking")
    rig.lot.begin_shutdown()
    sent, end = rig.drain(served)
    assert [cid for cid, _ in sent] == [0, 1]
    assert isinstance(end, FetchEnd) and end.refusal is None
    sent, step = rig.drain(waiting)
    assert len(sent) == 1 and isinstance(step, FetchWait)

    assert rig.lot.fail_all() == 3
    assert rig.notified["waiting"] == 1  # the waiting Fetch is woken up to see it
    end = rig.next(waiting)
    assert isinstance(end, FetchEnd) and end.refusal is not None
    assert (end.refusal.reason, end.chunks_sent) == (SHUTTING_DOWN, 1)
    assert_refused(rig.lot.finish_park(open_batch), SHUTTING_DOWN)
    for kid in ("waiting", "idle", "parking"):
        assert_tombstoned(rig, kid, SHUTTING_DOWN)
    assert_tombstoned(rig, "served", ALREADY_CONSUMED)
    rig.assert_pool_empty()
    assert rig.lot.bound_count == 0


def test_wait_expiry_after_fail_all_reports_shutting_down(rig: Rig) -> None:
    binding = rig.bound("w", wait_s=1)
    rig.lot.begin_shutdown()
    rig.lot.fail_all()
    rig.advance(1)  # the Fetch's wait timer and the shutdown race; the shutdown is the cause
    end = rig.lot.fetch_wait_expired(binding)
    assert end.refusal is not None and end.refusal.reason == SHUTTING_DOWN


# === lookup ======================================================================================


def test_lookup_reports_every_state(rig: Rig) -> None:
    rig.parked("p", {0: b"x" * 100, 1: b"y" * 50}, total=3)
    rig.parked("b", [0], total=2)
    rig.parked("t", [0])
    rig.advance(10)
    rig.bound("b")
    rig.bound("demand")
    assert rig.lot.release("t") is None
    rig.advance(2.5)
    p, b, demand, t, u = rig.lot.lookup(["p", "b", "demand", "t", "u"])
    assert p == IdStatus("p", pb.STATE_PARKED, 0, 2, 3, 150, age_s=12.5, lease_remaining_s=47.5)
    assert b == IdStatus("b", pb.STATE_BOUND, 0, 1, 2, len(blob("b", 0)), 12.5, 0.0)
    assert demand == IdStatus("demand", pb.STATE_BOUND, age_s=2.5)
    assert t == IdStatus("t", pb.STATE_TOMBSTONED, RELEASED, age_s=2.5)
    assert u == IdStatus("u", pb.STATE_UNKNOWN)


def test_next_lease_deadline_is_the_earliest_live_one(rig: Rig) -> None:
    assert rig.lot.next_lease_deadline() is None
    start = rig.clock.now
    rig.parked("first", [0])
    rig.advance(10)
    rig.parked("second", [0])
    assert rig.lot.next_lease_deadline() == start + 60
    rig.lot.keep_alive(["first"], 100)
    assert rig.lot.next_lease_deadline() == start + 70
    rig.bound("second")
    assert rig.lot.next_lease_deadline() == start + 110


# === random operations ===========================================================================

IDS = ("a", "b")
CHUNK_IDS = st.integers(0, 3)
SIZES = (1, PAGE + 6, 2 * PAGE, 3 * PAGE - 1)  # by chunk_id: under, on and over page edges
VARIANTS = st.sampled_from([0, 0, 0, 1])  # 1: other bytes than before under the same chunk_id
BAD_CRC = st.sampled_from([False] * 15 + [True])


def sometimes(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in `one_in` draws (Hypothesis favours the first element)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


@dataclass
class ModelBatch:
    """The model's view of one Park batch: chunks it newly stored, and chunks it sent again
    with the bytes already held (it relies on those too)."""

    kid: str
    batch: ParkBatch
    new: set[int] = field(default_factory=set)
    matched: set[int] = field(default_factory=set)


class LotMachine(RuleBasedStateMachine):
    """Random park / open batch / fetch / next / wait expiry / cancel / release / keepalive /
    clock / reap / shutdown steps. After every step the lot's own invariants hold and the
    model agrees with the lot on what each live id holds; every ReadyChunk's bytes must be
    exactly the bytes parked under that id and chunk_id.

    As in the servicer, a Fetch's notify wakes it up: woken Fetches are stepped between Park
    chunks, so chunks stream to bound Fetches while batches are still open."""

    @initialize()
    def start(self) -> None:
        self.rig = Rig(
            pool_pages=32,
            unbound_store_timeout_s=10,
            tombstone_retention_s=30,
            max_lease_s=40,
            max_fetch_wait_s=5,
            max_tombstones=4,
        )
        self.lot = self.rig.lot
        # id -> chunk_id -> the bytes the lot holds for it (live ids only).
        self.expected: dict[str, dict[int, bytes]] = {}
        # batches left open across rules (the `park_batch` rule's own batch never is)
        self.batches: list[ModelBatch] = []
        # id -> (binding, chunk_ids already received)
        self.fetches: dict[str, tuple[FetchBinding, list[int]]] = {}
        self.woken: set[str] = set()  # ids whose Fetch was notified
        self.waiting: set[str] = set()  # ids whose Fetch was last told FetchWait

    # --- park ---------------------------------------------------------------------------
    def _park_chunk(self, mb: ModelBatch, cid: int, variant: int, bad_crc: bool) -> Refusal | None:
        kid, batch = mb.kid, mb.batch
        data = blob(kid, cid, SIZES[cid] + variant, variant)
        crc = crc32c_of(data) ^ 1 if bad_crc else crc32c_of(data)
        held = self.expected.get(kid, {}).get(cid)
        ended = batch.failed is not None  # the id ended while the batch was open
        refused = self.lot.park_chunk(batch, cid, memoryview(data), crc)
        if refused is None:
            assert held is None or held == data, "a conflicting chunk was accepted"
            if held is None:
                self.expected.setdefault(kid, {})[cid] = data
                mb.new.add(cid)
            else:
                mb.matched.add(cid)  # relies on a copy some batch (maybe still open) stored
            self._serve_woken()
        else:
            self._undo(mb)
            if ended:
                assert refused is batch.failed
            elif bad_crc:
                assert refused.reason == CHECKSUM_MISMATCH
            elif held is not None and held != data:
                assert refused.reason == CHUNK_CONFLICT
        return refused

    def _undo(self, mb: ModelBatch) -> None:
        """A batch failed: what it stored goes, except chunks another open batch of the id
        sent again identically, which pass to the first such batch."""
        for cid in mb.new:
            heir = next(
                (o for o in self.batches if o is not mb and o.kid == mb.kid and cid in o.matched),
                None,
            )
            if heir is not None:
                heir.matched.discard(cid)
                heir.new.add(cid)
            else:
                self.expected.get(mb.kid, {}).pop(cid, None)
        mb.new.clear()

    def _commit(self, mb: ModelBatch) -> None:
        """A batch succeeded: the chunks it relied on are no other open batch's to undo."""
        for other in self.batches:
            if other is not mb and other.kid == mb.kid:
                other.new -= mb.matched

    # Parks and Fetches draw their arguments inside: Hypothesis favours rules with fewer
    # arguments, and these are the ones the machine should run most.
    @rule(data=st.data())
    def park_batch(self, data: st.DataObject) -> None:
        kid = data.draw(st.sampled_from(IDS))
        order = data.draw(st.permutations(range(4)))
        count = data.draw(st.sampled_from([4, 1, 2, 3]))
        chunks = [(cid, data.draw(VARIANTS), data.draw(BAD_CRC)) for cid in order[:count]]
        total = data.draw(st.sampled_from([4, 0]))
        batch_bytes = data.draw(st.sampled_from([0, 0, 4 * PAGE, 30 * PAGE]))
        opened = self.lot.begin_park(kid, total, batch_bytes)
        if isinstance(opened, Refusal):
            return
        mb = ModelBatch(kid, opened)
        for cid, variant, bad in chunks:
            if self._park_chunk(mb, cid, variant, bad) is not None:
                return
        if isinstance(self.lot.finish_park(opened), Refusal):
            self._undo(mb)
        else:
            self._commit(mb)
        self._serve_woken()

    @rule(kid=st.sampled_from(IDS), batch_bytes=st.sampled_from([0, 6 * PAGE]))
    def open_batch(self, kid: str, batch_bytes: int) -> None:
        opened = self.lot.begin_park(kid, 4, batch_bytes)
        if isinstance(opened, ParkBatch):
            self.batches.append(ModelBatch(kid, opened))

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), cid=CHUNK_IDS, variant=VARIANTS, bad_crc=BAD_CRC)
    def park_into_open_batch(
        self, data: st.DataObject, cid: int, variant: int, bad_crc: bool
    ) -> None:
        index = data.draw(st.integers(0, len(self.batches) - 1))
        if self._park_chunk(self.batches[index], cid, variant, bad_crc) is not None:
            del self.batches[index]

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), abort=st.booleans())
    def end_open_batch(self, data: st.DataObject, abort: bool) -> None:
        mb = self.batches.pop(data.draw(st.integers(0, len(self.batches) - 1)))
        if abort:
            self.lot.abort_park(mb.batch)
            self._undo(mb)
        elif isinstance(self.lot.finish_park(mb.batch), Refusal):
            self._undo(mb)
        else:
            self._commit(mb)
        self._serve_woken()

    # --- fetch ----------------------------------------------------------------------------
    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        kid = data.draw(st.sampled_from(IDS))
        chunk_ids = data.draw(st.one_of(st.just([]), st.lists(CHUNK_IDS, unique=True, max_size=4)))
        epoch = data.draw(st.sampled_from([0, 0, 0, EPOCH, EPOCH, EPOCH + 1]))
        wait_s = data.draw(st.sampled_from([10.0, 1.0, 0.0]))
        steps = data.draw(st.sampled_from([8, 1, 0]))
        current = self.fetches.get(kid)
        bound = self.lot.bind_fetch(kid, chunk_ids, epoch, wait_s, lambda: self.woken.add(kid))
        if isinstance(bound, FetchBinding):
            assert current is None or not current[0].active, "two Fetches bound to one id"
            assert epoch in (0, EPOCH)
            self.fetches[kid] = (bound, [])
            self.waiting.discard(kid)
            self._step(kid, steps)
        elif bound.reason == ALREADY_BOUND:
            assert current is not None and current[0].active

    @precondition(lambda self: self.fetches)
    @rule(data=st.data())
    def next_chunks(self, data: st.DataObject) -> None:
        self._step(data.draw(st.sampled_from(sorted(self.fetches))), 8)

    def _serve_woken(self) -> None:
        woken, self.woken = self.woken, set()
        for kid in sorted(woken):
            if kid in self.fetches:
                self._step(kid, 8)

    def _step(self, kid: str, steps: int) -> None:
        """Up to `steps` next_for calls on the id's Fetch, checking every byte it is given."""
        binding, received = self.fetches[kid]
        for _ in range(steps):
            step = self.lot.next_for(binding)
            if isinstance(step, ReadyChunk):
                got = b"".join(bytes(v) for v in step.views)  # before any other lot call
                assert got == self.expected[kid][step.chunk_id], "served bytes not parked there"
                assert step.crc32c == crc32c_of(got) and step.nbytes == len(got)
                order = binding.requested if binding.requested is not None else range(99)
                assert step.chunk_id == order[len(received)], "out of the requested order"
                received.append(step.chunk_id)
                self.waiting.discard(kid)
            elif isinstance(step, FetchEnd):
                del self.fetches[kid]
                self.waiting.discard(kid)
                if step.refusal is None:
                    assert binding.requested in (None, received)
                return
            else:
                self.waiting.add(kid)
                return

    # As in the servicer: a wait expires only for a Fetch that was told to wait.
    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), act=sometimes(2))
    def wait_expires(self, data: st.DataObject, act: bool) -> None:
        if not act:
            return
        kid = data.draw(st.sampled_from(sorted(self.waiting)))
        binding, _ = self.fetches[kid]
        if self.rig.clock.now >= binding.wait_deadline:
            end = self.lot.fetch_wait_expired(binding)
            assert end.refusal is not None
            del self.fetches[kid]
            self.waiting.discard(kid)

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), act=sometimes(4))
    def cancel(self, data: st.DataObject, act: bool) -> None:
        if not act:  # consumers mostly stay: let chunks arrive
            return
        kid = data.draw(st.sampled_from(sorted(self.fetches)))
        binding, _ = self.fetches.pop(kid)
        self.waiting.discard(kid)
        self.lot.cancel_fetch(binding)

    # --- the rest ---------------------------------------------------------------------------
    @rule(kid=st.sampled_from(IDS), act=sometimes(3))
    def release(self, kid: str, act: bool) -> None:
        if not act:
            return
        refused = self.lot.release(kid)
        if refused is None:
            assert kid not in self.fetches or not self.fetches[kid][0].active

    @rule(kids=st.lists(st.sampled_from(IDS), max_size=3), extend_s=st.sampled_from([0, 5, 100]))
    def keep_alive(self, kids: list[str], extend_s: float) -> None:
        states = self.lot.keep_alive(kids, extend_s)
        assert [s.kv_request_id for s in states] == kids

    @rule(seconds=st.sampled_from([6.0, 0.5, 2.0, 11.0, 31.0]), reap=st.sampled_from([True, False]))
    def time_passes(self, seconds: float, reap: bool) -> None:
        self.rig.advance(seconds)
        if reap:  # or not yet: a Fetch may bind an expired id before the reaper's next pass
            self.lot.reap()

    @precondition(lambda self: not self.lot.statistics().shutting_down)
    @rule(act=sometimes(20), fail_all=st.booleans())
    def shutdown(self, act: bool, fail_all: bool) -> None:
        if not act:  # rare: after a shutdown every Park and Fetch is refused
            return
        self.lot.begin_shutdown()
        if fail_all:
            self.lot.fail_all()
            self._serve_woken()

    # --- after every step ---------------------------------------------------------------------
    @invariant()
    def lot_and_model_agree(self) -> None:
        if not hasattr(self, "lot"):
            return
        self.lot.check_invariants()
        for kid in IDS:
            status = self.rig.state(kid)
            if status.state not in (pb.STATE_PARKED, pb.STATE_BOUND):
                self.expected.pop(kid, None)  # the id ended: a new life starts empty
                for mb in self.batches:
                    if mb.kid == kid:
                        mb.new.clear()
                        mb.matched.clear()
                continue
            held = self.expected.get(kid, {})
            assert status.chunks_parked == len(held), (kid, status, sorted(held))
            assert status.nbytes == sum(map(len, held.values()))
        pool = self.rig.pool.statistics()
        assert pool.stored_bytes == sum(len(d) for c in self.expected.values() for d in c.values())
        if not self.batches:
            assert pool.reservations_open == 0


LotMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_lot_state_machine = LotMachine.TestCase
