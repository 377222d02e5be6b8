"""Tests of producer_service.lot.Lot over a real HostPool and a FakeClock: Park batches isolated
until their commit, Fetch bindings and deliveries, confirmations, eviction under pool pressure,
leases, idle batches, the reaper, tombstones, KeepAlive intents, Release and shutdown.

Every scenario goes through `Rig`, whose `lot` runs `check_invariants()` after every call, and
which copies a ReadyChunk's bytes before the next lot call (as the servicer does). A hypothesis
state machine at the end (`LotMachine`) drives random operations against a small model of the
contract and checks, after every step, that the lot agrees with it on every id's state, bytes,
timers and tombstone, on every open batch, on the pool and on every statistic."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import OrderedDict
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
    COMMIT_MISMATCH,
    EPOCH_MISMATCH,
    EVICTED,
    NOT_COMMITTED,
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
    LotStatistics,
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
    park_idle_timeout_s=10.0,
    delivery_grace_s=30.0,
    max_batch_bytes=0,
)
SIZE = 3 * PAGE + 5  # blob()'s default size: four pages
UNSPECIFIED = pb.REASON_UNSPECIFIED
GOOD_CRC = -1  # Rig.send: the chunk carries its real CRC


def blob(kid: str, chunk_id: int, nbytes: int = SIZE, variant: int = 0) -> bytes:
    """Deterministic random bytes for one chunk, different for every (id, chunk, variant)."""
    seed = [*kid.encode(), chunk_id, nbytes, variant]
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def four_pages(kid: str) -> dict[int, bytes]:
    """One chunk of exactly four pages."""
    return {0: blob(kid, 0, 4 * PAGE)}


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
    `raw` is the same Lot unchecked, for the large-scale test.

    The rig counts what each batch sent (so that `commit` names it without asking the lot),
    records every batch woken from outside its own call (`woken`, in order) and every Fetch
    notification (`notified`, by id)."""

    def __init__(self, pool_pages: int = 256, **overrides: Any) -> None:
        self.clock = FakeClock()
        self.pool = HostPool(pool_pages * PAGE, page_bytes=PAGE)
        self.settings = dataclasses.replace(SETTINGS, **overrides)
        self.raw = Lot(self.pool, self.settings, epoch=EPOCH, clock=self.clock)
        self.lot: Any = CheckedLot(self.raw)
        self.notified: dict[str, int] = {}
        self.woken: list[ParkBatch] = []
        self.sent: dict[ParkBatch, tuple[int, int]] = {}

    def check(self) -> None:
        self.raw.check_invariants()

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def reap(self) -> list[str]:
        reaped: list[str] = self.lot.reap()
        return reaped

    def stats(self) -> LotStatistics:
        stats: LotStatistics = self.lot.statistics()
        return stats

    # --- Park ---------------------------------------------------------------------------
    def open(self, kid: str, total: int = 0, batch_bytes: int = 0) -> ParkBatch | Refusal:
        opened: ParkBatch | Refusal = self.lot.begin_park(kid, total, batch_bytes)
        if isinstance(opened, ParkBatch):
            batch = opened
            batch.wake = lambda: self.woken.append(batch)
            self.sent[batch] = (0, 0)
        return opened

    def begin(self, kid: str, total: int = 0, batch_bytes: int = 0) -> ParkBatch:
        batch = self.open(kid, total, batch_bytes)
        assert isinstance(batch, ParkBatch), batch
        return batch

    def send(
        self, batch: ParkBatch, chunk_id: int, data: bytes, crc: int | None = GOOD_CRC
    ) -> Refusal | None:
        """One Chunk message; `crc` GOOD_CRC = the real one, None = not given, else that."""
        chunks, nbytes = self.sent.get(batch, (0, 0))
        self.sent[batch] = (chunks + 1, nbytes + len(data))
        crc = crc32c_of(data) if crc == GOOD_CRC else crc
        refused: Refusal | None = self.lot.park_chunk(batch, chunk_id, memoryview(data), crc)
        return refused

    def chunk(
        self, batch: ParkBatch, chunk_id: int, data: bytes, crc: int | None = GOOD_CRC
    ) -> None:
        """One Chunk message that must be accepted."""
        refused = self.send(batch, chunk_id, data, crc)
        assert refused is None, refused

    def commit(self, batch: ParkBatch, extra_chunks: int = 0, extra_bytes: int = 0) -> Any:
        """A ParkCommit naming what the batch sent (off by the extras, to test the check)."""
        chunks, nbytes = self.sent.get(batch, (0, 0))
        return self.lot.commit_park(batch, chunks + extra_chunks, nbytes + extra_bytes)

    def committed(self, batch: ParkBatch) -> ParkDone:
        done = self.commit(batch)
        assert isinstance(done, ParkDone), done
        return done

    def park(
        self,
        kid: str,
        chunks: dict[int, bytes] | Iterable[int],
        total: int = 0,
        batch_bytes: int = 0,
        crcs: dict[int, int | None] | None = None,
    ) -> ParkDone | Refusal:
        """One whole Park call: header, chunks, commit. Stops at the first refusal."""
        if not isinstance(chunks, dict):
            chunks = {cid: blob(kid, cid) for cid in chunks}
        opened = self.open(kid, total, batch_bytes)
        if isinstance(opened, Refusal):
            return opened
        for cid, data in chunks.items():
            refused = self.send(opened, cid, data, (crcs or {}).get(cid, GOOD_CRC))
            if refused is not None:
                return refused
        done: ParkDone | Refusal = self.commit(opened)
        return done

    def parked(
        self, kid: str, chunks: dict[int, bytes] | Iterable[int], total: int = 0
    ) -> ParkDone:
        done = self.park(kid, chunks, total)
        assert isinstance(done, ParkDone), done
        return done

    # --- Fetch --------------------------------------------------------------------------
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

    def deliver(self, kid: str, chunk_ids: Sequence[int] = ()) -> int:
        """A whole Fetch that must deliver; returns its delivery id."""
        _, end = self.drain(self.bound(kid, chunk_ids))
        assert isinstance(end, FetchEnd) and end.refusal is None and end.delivery_id, end
        return end.delivery_id

    def peek(self, kid: str, chunk_ids: Sequence[int]) -> dict[int, bytes]:
        """The bytes of committed chunks, read by a Fetch cancelled before it delivers (the
        id goes back as it was, timer included)."""
        binding = self.bound(kid, chunk_ids)
        got = {}
        for _ in chunk_ids:
            step = self.next(binding)
            assert isinstance(step, tuple), step
            got[step[0]] = step[1]
        self.lot.cancel_fetch(binding)
        return got

    # --- state --------------------------------------------------------------------------
    def state(self, kid: str) -> IdStatus:
        (status,) = self.raw.lookup([kid])
        return status

    def assert_pool_empty(self) -> None:
        s = self.pool.statistics()
        assert (s.used_bytes, s.stored_bytes, s.reservations_open) == (0, 0, 0), s

    def assert_stored(self, nbytes: int) -> None:
        """The pool holds exactly `nbytes` of chunks, and no reservation."""
        s = self.pool.statistics()
        assert (s.stored_bytes, s.reserved_bytes) == (nbytes, 0), s


def assert_refused(outcome: object, reason: int, late: bool | None = None) -> Refusal:
    assert isinstance(outcome, Refusal), outcome
    assert outcome.reason == reason, (pb.FailureReason.Name(outcome.reason), outcome.detail)
    if late is not None:
        assert outcome.late is late
    return outcome


def assert_tombstoned(rig: Rig, kid: str, reason: int) -> None:
    status = rig.state(kid)
    assert (status.state, status.reason) == (pb.STATE_TOMBSTONED, reason), status


def assert_delivered(end: object) -> FetchEnd:
    assert isinstance(end, FetchEnd) and end.refusal is None and end.delivery_id != 0, end
    return end


@pytest.fixture
def rig() -> Rig:
    return Rig()


# === happy path ================================================================================


def test_committed_chunks_stream_in_requested_order_then_the_id_is_delivered_and_confirmed(
    rig: Rig,
) -> None:
    data = {cid: blob("req", cid, 2 * PAGE + 7 * cid + 1) for cid in range(4)}
    size = sum(map(len, data.values()))
    done = rig.parked("req", data, total=4)
    assert done == ParkDone(4, size, total_chunks=4, lease_remaining_s=60.0)
    binding = rig.bound("req", [2, 0, 3, 1])
    sent, end = rig.drain(binding)
    assert sent == [(cid, data[cid]) for cid in (2, 0, 3, 1)]
    end = assert_delivered(end)
    assert (end.chunks_sent, end.bytes_sent) == (4, size)
    # DELIVERED keeps every byte until the consumer confirms (or the grace runs out).
    assert rig.state("req") == IdStatus("req", pb.STATE_DELIVERED, 0, 4, 4, size, 0.0, 30.0)
    rig.assert_stored(size)
    assert rig.lot.release("req", end.delivery_id) is None
    assert_tombstoned(rig, "req", ALREADY_CONSUMED)
    rig.assert_pool_empty()
    stats = rig.stats()
    assert (stats.consumed_total, stats.confirmed_total, stats.delivered_total) == (1, 1, 1)
    assert (stats.delivered_ids, stats.parked_ids, stats.bound_ids, stats.parked_bytes) == (
        0, 0, 0, 0,
    )  # fmt: skip


def test_fetch_without_chunk_ids_streams_all_chunks_in_order(rig: Rig) -> None:
    data = {cid: blob("all", cid) for cid in (2, 0, 1)}  # parked out of order
    rig.parked("all", data, total=3)
    sent, end = rig.drain(rig.bound("all"))
    assert sent == [(0, data[0]), (1, data[1]), (2, data[2])]
    assert_delivered(end)


def test_confirming_the_delivery_of_a_subset_frees_the_whole_id(rig: Rig) -> None:
    rig.parked("sub", range(4), total=4)
    binding = rig.bound("sub", [3])
    sent, end = rig.drain(binding)
    assert sent == [(3, blob("sub", 3))]
    delivery = assert_delivered(end).delivery_id
    assert rig.state("sub").chunks_parked == 4  # the rest stays until the confirmation
    assert rig.lot.release("sub", delivery) is None
    assert_tombstoned(rig, "sub", ALREADY_CONSUMED)
    rig.assert_pool_empty()


def test_later_batches_add_chunks_to_the_same_id(rig: Rig) -> None:
    rig.parked("multi", [0, 1], total=3)
    assert rig.parked("multi", [2]) == ParkDone(3, 3 * SIZE, 3, 60.0)
    status = rig.state("multi")
    assert (status.chunks_parked, status.total_chunks, status.nbytes) == (3, 3, 3 * SIZE)
    assert rig.peek("multi", [0, 1, 2]) == {cid: blob("multi", cid) for cid in range(3)}


def test_a_committed_retry_keeps_its_chunks_when_the_first_attempt_fails(rig: Rig) -> None:
    """Two batches of one id (a retry or a hedge) send the same bytes; each holds its own
    copy until its commit. The second commits while the first is open; the first then fails
    (a bad CRC): what the second committed stays, and the first's copies go back."""
    first = rig.begin("hedge", total=2)
    for cid in (0, 1):
        rig.chunk(first, cid, blob("hedge", cid))
    second = rig.begin("hedge", total=2)
    for cid in (0, 1):
        rig.chunk(second, cid, blob("hedge", cid))
    rig.assert_stored(4 * SIZE)  # batches are isolated: two copies
    assert rig.committed(second) == ParkDone(2, 2 * SIZE, 2, 60.0)
    assert_refused(rig.send(first, 1, b"x", crc=1), CHECKSUM_MISMATCH)
    rig.assert_stored(2 * SIZE)
    assert rig.peek("hedge", [0, 1]) == {0: blob("hedge", 0), 1: blob("hedge", 1)}


# === Park batches are isolated until their commit ===============================================


def test_an_open_batch_is_invisible_to_lookup_until_its_commit(rig: Rig) -> None:
    batch = rig.begin("iso", total=3, batch_bytes=12 * PAGE)
    for cid in range(3):
        rig.chunk(batch, cid, blob("iso", cid))
    assert rig.state("iso") == IdStatus("iso", pb.STATE_UNKNOWN)
    stats = rig.stats()
    assert (stats.open_batches, stats.pending_bytes, stats.parked_bytes) == (1, 3 * SIZE, 0)
    assert (stats.parked_ids, stats.parked_bytes_total) == (0, 0)
    assert rig.pool.statistics().stored_bytes == 3 * SIZE
    rig.advance(5)
    assert rig.committed(batch) == ParkDone(3, 3 * SIZE, 3, 60.0)
    assert rig.state("iso") == IdStatus("iso", pb.STATE_PARKED, 0, 3, 3, 3 * SIZE, 0.0, 60.0)
    stats = rig.stats()
    assert (stats.open_batches, stats.pending_bytes, stats.parked_bytes) == (0, 0, 3 * SIZE)
    assert (stats.parked_ids, stats.parked_bytes_total) == (1, 3 * SIZE)
    rig.assert_stored(3 * SIZE)


def test_a_bound_fetch_sees_nothing_of_an_open_batch_and_is_notified_at_its_commit(
    rig: Rig,
) -> None:
    binding = rig.bound("early", wait_s=10)
    assert rig.state("early") == IdStatus("early", pb.STATE_BOUND)
    assert rig.next(binding) == FetchWait(deadline=rig.clock.now + 10)
    batch = rig.begin("early", total=2)
    assert rig.notified["early"] == 1  # the total became known
    rig.chunk(batch, 1, blob("early", 1))
    rig.chunk(batch, 0, blob("early", 0))
    assert rig.notified["early"] == 1  # nothing it could send yet
    assert isinstance(rig.next(binding), FetchWait)
    assert rig.state("early").chunks_parked == 0
    assert rig.committed(batch) == ParkDone(2, 2 * SIZE, 2, lease_remaining_s=0.0)  # bound
    assert rig.notified["early"] == 2
    sent, end = rig.drain(binding)
    assert sent == [(0, blob("early", 0)), (1, blob("early", 1))]
    assert_delivered(end)


def test_a_waiting_fetch_is_notified_by_every_commit_on_its_id(rig: Rig) -> None:
    rig.parked("n", [0], total=3)
    binding = rig.bound("n", wait_s=10)
    sent, step = rig.drain(binding)
    assert [cid for cid, _ in sent] == [0] and isinstance(step, FetchWait)
    assert rig.notified["n"] == 0
    rig.parked("n", [2])  # not what it waits for, but the id changed
    assert rig.notified["n"] == 1
    assert isinstance(rig.next(binding), FetchWait)
    rig.parked("n", [1])
    assert rig.notified["n"] == 2
    sent, end = rig.drain(binding)
    assert [cid for cid, _ in sent] == [1, 2]
    assert_delivered(end)


def test_aborting_one_batch_leaves_another_open_batch_of_the_id_intact(rig: Rig) -> None:
    """No hand-over between batches: each holds its own copy of what it sent."""
    first = rig.begin("pair", total=2)
    rig.chunk(first, 0, blob("pair", 0))
    second = rig.begin("pair", total=2)
    rig.chunk(second, 0, blob("pair", 0))
    rig.assert_stored(2 * SIZE)
    rig.lot.abort_park(first)
    rig.assert_stored(SIZE)
    assert rig.stats().pending_bytes == SIZE
    rig.chunk(second, 1, blob("pair", 1))
    assert rig.committed(second) == ParkDone(2, 2 * SIZE, 2, 60.0)
    assert rig.peek("pair", [0, 1]) == {0: blob("pair", 0), 1: blob("pair", 1)}
    # Both aborted: nothing is left of the id, not even a tombstone.
    third, fourth = rig.begin("other", total=2), rig.begin("other", total=2)
    rig.chunk(third, 0, blob("other", 0))
    rig.chunk(fourth, 0, blob("other", 0))
    rig.lot.abort_park(third)
    rig.lot.abort_park(fourth)
    assert rig.state("other") == IdStatus("other", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0
    rig.assert_stored(2 * SIZE)
    assert rig.woken == []  # both ended by their own calls


def test_a_stream_that_ends_without_a_commit_is_undone_not_committed(rig: Rig) -> None:
    rig.parked("s", [0], total=4)
    rig.advance(10)
    batch = rig.begin("s", batch_bytes=8 * PAGE)
    rig.chunk(batch, 1, blob("s", 1))
    rig.chunk(batch, 2, blob("s", 2))
    refusal = assert_refused(rig.lot.end_park_stream(batch), NOT_COMMITTED)
    rig.assert_stored(SIZE)
    assert rig.pool.statistics().reservations_open == 0
    status = rig.state("s")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 50.0,
    )  # fmt: skip
    # The batch stays failed, whatever comes after.
    assert rig.lot.end_park_stream(batch) is refusal
    assert rig.commit(batch) is refusal
    assert rig.send(batch, 3, blob("s", 3)) is refusal
    rig.assert_stored(SIZE)
    # A first batch that never commits leaves nothing behind.
    lone = rig.begin("lone")
    rig.chunk(lone, 0, blob("lone", 0))
    assert_refused(rig.lot.end_park_stream(lone), NOT_COMMITTED)
    assert rig.state("lone") == IdStatus("lone", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0


def test_abort_is_idempotent_and_leaves_a_committed_batch_alone(rig: Rig) -> None:
    batch = rig.begin("cut", batch_bytes=4 * PAGE)
    rig.chunk(batch, 0, blob("cut", 0))
    rig.lot.abort_park(batch)
    rig.assert_pool_empty()
    assert rig.state("cut").state == pb.STATE_UNKNOWN
    rig.lot.abort_park(batch)
    rig.assert_pool_empty()
    kept = rig.begin("kept")
    rig.chunk(kept, 0, blob("kept", 0))
    rig.committed(kept)
    rig.lot.abort_park(kept)  # what the servicer's `finally` does after a commit
    assert rig.state("kept").chunks_parked == 1
    rig.assert_stored(SIZE)


# === commit: counts, conflicts, all or nothing ==================================================


@pytest.mark.parametrize(("extra_chunks", "extra_bytes"), [(1, 0), (-1, 0), (0, 1), (0, -1)])
def test_a_commit_naming_other_counts_is_refused_commit_mismatch_and_undoes_the_batch(
    rig: Rig, extra_chunks: int, extra_bytes: int
) -> None:
    rig.parked("m", [0], total=3)
    batch = rig.begin("m", batch_bytes=8 * PAGE)
    rig.chunk(batch, 1, blob("m", 1))
    rig.chunk(batch, 2, blob("m", 2))
    refusal = assert_refused(rig.commit(batch, extra_chunks, extra_bytes), COMMIT_MISMATCH)
    assert "2 chunks" in refusal.detail and f"{2 * SIZE} bytes" in refusal.detail
    rig.assert_stored(SIZE)
    assert rig.state("m").chunks_parked == 1
    assert rig.commit(batch) is refusal  # the honest commit comes too late
    assert rig.stats().pending_bytes == 0


def test_every_chunk_message_counts_toward_the_commit_repeats_included(rig: Rig) -> None:
    data = blob("rep", 0)
    short = rig.begin("rep")
    rig.chunk(short, 0, data)
    rig.chunk(short, 0, data)  # the same bytes again: nothing more stored
    rig.assert_stored(SIZE)
    assert_refused(rig.lot.commit_park(short, 1, SIZE), COMMIT_MISMATCH)
    rig.assert_pool_empty()
    batch = rig.begin("rep")
    rig.chunk(batch, 0, data)
    rig.chunk(batch, 0, data)
    assert rig.lot.commit_park(batch, 2, 2 * SIZE) == ParkDone(1, SIZE, 1, 60.0)
    rig.assert_stored(SIZE)


def test_an_empty_commit_of_an_empty_batch_succeeds_and_leaves_nothing(rig: Rig) -> None:
    """The id is forgotten with the declared total, so the answer reports none: the next
    header may declare another."""
    batch = rig.begin("empty", total=4)
    assert rig.committed(batch) == ParkDone(0, 0, 0, 0.0)
    assert rig.state("empty") == IdStatus("empty", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0
    rig.assert_pool_empty()
    assert rig.parked("empty", [0], total=5).total_chunks == 5


def test_an_empty_batch_on_an_id_kept_by_something_else_reports_the_total_it_keeps(
    rig: Rig,
) -> None:
    """Another open batch, or a Fetch waiting for the id, keeps it and its declared total."""
    other = rig.begin("open", total=4)
    assert rig.committed(rig.begin("open", total=4)) == ParkDone(0, 0, 4, 0.0)
    assert_refused(rig.lot.begin_park("open", 5, 0), CHUNK_CONFLICT)
    rig.lot.abort_park(other)
    rig.bound("demand")
    assert rig.committed(rig.begin("demand", total=3)) == ParkDone(0, 0, 3, 0.0)
    assert rig.state("demand").total_chunks == 3


def test_resending_committed_bytes_stores_nothing_extra(rig: Rig) -> None:
    rig.parked("i", range(2), total=3)
    batch = rig.begin("i")
    rig.chunk(batch, 0, blob("i", 0))
    rig.chunk(batch, 2, blob("i", 2))
    assert rig.stats().pending_bytes == SIZE  # only chunk 2 is new
    rig.assert_stored(3 * SIZE)
    assert rig.committed(batch) == ParkDone(3, 3 * SIZE, 3, 60.0)
    rig.assert_stored(3 * SIZE)


def test_resending_a_committed_chunk_with_other_bytes_is_a_conflict_and_undoes_the_batch(
    rig: Rig,
) -> None:
    rig.parked("i", {0: blob("i", 0)}, total=2)
    other = {1: blob("i", 1), 0: blob("i", 0, variant=1)}
    refusal = assert_refused(rig.park("i", other), CHUNK_CONFLICT)
    assert "chunk 0" in refusal.detail
    status = rig.state("i")
    assert (status.chunks_parked, status.nbytes) == (1, SIZE)
    rig.assert_stored(SIZE)
    assert rig.peek("i", [0]) == {0: blob("i", 0)}


def test_other_bytes_of_the_same_length_conflict_even_without_a_crc(rig: Rig) -> None:
    rig.parked("i", {0: b"a" * 100})
    batch = rig.begin("i")
    assert_refused(rig.send(batch, 0, b"b" * 100, crc=None), CHUNK_CONFLICT)
    # And within one batch: a chunk sent twice with other bytes.
    twice = rig.begin("j")
    rig.chunk(twice, 0, b"a" * 100)
    assert_refused(rig.send(twice, 0, b"b" * 100), CHUNK_CONFLICT)
    rig.assert_stored(100)


def test_two_open_batches_with_the_same_chunk_the_second_commit_frees_its_copy(rig: Rig) -> None:
    first, second = rig.begin("dup", total=2), rig.begin("dup", total=2)
    rig.chunk(first, 0, blob("dup", 0))
    rig.chunk(second, 0, blob("dup", 0))  # the first's copy is invisible: a copy of its own
    rig.chunk(second, 1, blob("dup", 1))
    assert rig.committed(first) == ParkDone(1, SIZE, 2, 60.0)
    assert rig.stats().pending_bytes == 2 * SIZE
    rig.assert_stored(3 * SIZE)
    assert rig.committed(second) == ParkDone(2, 2 * SIZE, 2, 60.0)
    rig.assert_stored(2 * SIZE)  # the second copy of chunk 0 went back
    stats = rig.stats()
    assert (stats.pending_bytes, stats.parked_bytes, stats.parked_bytes_total) == (
        0, 2 * SIZE, 2 * SIZE,
    )  # fmt: skip
    assert rig.peek("dup", [0, 1]) == {0: blob("dup", 0), 1: blob("dup", 1)}


def test_two_open_batches_with_other_bytes_the_second_commit_is_refused_entirely(
    rig: Rig,
) -> None:
    """A commit is all-or-nothing: the conflict on chunk 0 is found before chunk 1 moves."""
    first, second = rig.begin("c", total=2), rig.begin("c", total=2)
    rig.chunk(first, 0, blob("c", 0))
    rig.chunk(second, 1, blob("c", 1))
    rig.chunk(second, 0, blob("c", 0, variant=1))
    rig.committed(first)
    refusal = assert_refused(rig.commit(second), CHUNK_CONFLICT)
    assert "chunk 0" in refusal.detail
    status = rig.state("c")
    assert (status.chunks_parked, status.nbytes) == (1, SIZE)
    rig.assert_stored(SIZE)
    assert rig.peek("c", [0]) == {0: blob("c", 0)}


# === total_chunks ================================================================================


def test_conflicting_total_chunks_is_refused(rig: Rig) -> None:
    rig.parked("t", [0], total=4)
    assert_refused(rig.lot.begin_park("t", 5, 0), CHUNK_CONFLICT)
    assert isinstance(rig.park("t", [1], total=4), ParkDone)  # the same total again is fine
    assert isinstance(rig.park("t", [2], total=0), ParkDone)  # and so is not saying it
    assert rig.state("t").total_chunks == 4


def test_the_first_header_that_declares_a_total_fixes_it_before_any_commit(rig: Rig) -> None:
    first = rig.begin("h", total=4)
    assert_refused(rig.lot.begin_park("h", 5, 0), CHUNK_CONFLICT)
    second = rig.begin("h")
    with pytest.raises(MalformedRequest, match="out of range"):
        rig.send(second, 4, blob("h", 4))
    rig.chunk(first, 3, blob("h", 3))
    assert rig.committed(first) == ParkDone(1, SIZE, 4, 60.0)


def test_the_first_commit_fixes_an_undeclared_total(rig: Rig) -> None:
    assert rig.parked("f", [2, 0]) == ParkDone(2, 2 * SIZE, 3, 60.0)
    assert rig.state("f").total_chunks == 3
    batch = rig.begin("f")
    with pytest.raises(MalformedRequest, match="total_chunks is 3"):
        rig.send(batch, 3, blob("f", 3))
    assert_refused(rig.lot.begin_park("f", 4, 0), CHUNK_CONFLICT)
    assert rig.parked("f", [1], total=3) == ParkDone(3, 3 * SIZE, 3, 60.0)
    rig.assert_stored(3 * SIZE)


def test_total_chunks_below_a_parked_chunk_is_refused(rig: Rig) -> None:
    rig.parked("u", [5], total=6)
    assert_refused(rig.lot.begin_park("u", 3, 0), CHUNK_CONFLICT)
    assert rig.state("u").total_chunks == 6


def test_total_chunks_below_a_chunk_a_bound_fetch_asks_for_is_refused(rig: Rig) -> None:
    rig.bound("v", [7])
    refusal = assert_refused(rig.lot.begin_park("v", 4, 0), CHUNK_CONFLICT)
    assert "chunk 7" in refusal.detail
    assert rig.state("v").total_chunks == 0


def test_a_commit_that_would_fix_a_total_below_a_bound_fetch_is_refused(rig: Rig) -> None:
    binding = rig.bound("w", [0, 3], wait_s=10)
    assert_refused(rig.park("w", [0, 1]), CHUNK_CONFLICT)  # would fix total_chunks at 2
    assert rig.state("w") == IdStatus("w", pb.STATE_BOUND)
    rig.assert_pool_empty()
    assert isinstance(rig.next(binding), FetchWait)
    assert rig.parked("w", [0, 1, 3]) == ParkDone(3, 3 * SIZE, 4, 0.0)
    sent, end = rig.drain(binding)
    assert [cid for cid, _ in sent] == [0, 3]
    assert_delivered(end)


def test_chunk_id_at_or_beyond_total_chunks_is_malformed_and_undoes_the_batch(rig: Rig) -> None:
    batch = rig.begin("m", total=2, batch_bytes=8 * PAGE)
    rig.chunk(batch, 0, blob("m", 0))
    with pytest.raises(MalformedRequest, match="out of range"):
        rig.send(batch, 2, blob("m", 2))
    rig.assert_pool_empty()
    assert rig.state("m").state == pb.STATE_UNKNOWN
    assert isinstance(rig.commit(batch), Refusal)


@pytest.mark.parametrize("fixed_by", ["commit", "header"])
def test_a_commit_is_refused_when_a_total_fixed_after_its_chunks_were_stored_excludes_them(
    rig: Rig, fixed_by: str
) -> None:
    late = rig.begin("x")
    rig.chunk(late, 3, blob("x", 3))  # no total known yet: accepted, invisible
    if fixed_by == "commit":
        rig.parked("x", [0, 1])  # this commit fixes total_chunks at 2
    else:
        header = rig.begin("x", total=2)
        rig.chunk(header, 0, blob("x", 0))
        rig.chunk(header, 1, blob("x", 1))
        rig.committed(header)
    done = rig.commit(late)
    # The id must never hold a chunk its total excludes: a whole-id Fetch would never send
    # it, a Fetch naming it is MalformedRequest, and Lookup would say 3 chunks of 2.
    assert_refused(done, CHUNK_CONFLICT)
    status = rig.state("x")
    assert (status.chunks_parked, status.total_chunks) == (2, 2)
    rig.assert_stored(2 * SIZE)


# === chunk rules ================================================================================


def test_checksum_mismatch_undoes_the_batch(rig: Rig) -> None:
    data = {0: blob("crc", 0), 1: blob("crc", 1)}
    refused = rig.park("crc", data, crcs={1: crc32c_of(data[1]) ^ 0xDEAD})
    assert_refused(refused, CHECKSUM_MISMATCH)
    rig.assert_pool_empty()
    assert rig.state("crc").state == pb.STATE_UNKNOWN


def test_a_crc_not_given_is_not_checked_and_the_fetch_carries_the_real_crc(rig: Rig) -> None:
    data = blob("nocrc", 0)
    batch = rig.begin("nocrc", total=1)
    rig.chunk(batch, 0, data, crc=None)
    rig.committed(batch)
    step = rig.lot.next_for(rig.bound("nocrc"))
    assert isinstance(step, ReadyChunk) and step.crc32c == crc32c_of(data)


def test_a_crc_of_zero_is_a_real_crc_and_is_checked(rig: Rig) -> None:
    data = blob("zero", 0)
    assert crc32c_of(data) != 0
    refusal = assert_refused(rig.park("zero", {0: data}, crcs={0: 0}), CHECKSUM_MISMATCH)
    assert "0x00000000" in refusal.detail
    rig.assert_pool_empty()


def test_empty_chunk_is_malformed(rig: Rig) -> None:
    batch = rig.begin("e")
    with pytest.raises(MalformedRequest, match="no data"):
        rig.send(batch, 0, b"")
    rig.assert_pool_empty()
    assert rig.state("e") == IdStatus("e", pb.STATE_UNKNOWN)
    assert rig.stats().open_batches == 0


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


# === batch size, pool pressure and reservations ==================================================


def test_a_declared_batch_larger_than_free_memory_is_refused_pool_full_with_retry_after() -> None:
    rig = Rig(pool_pages=16)
    rig.parked("a", {0: blob("a", 0, 10 * PAGE)})
    rig.advance(20)
    refused = assert_refused(rig.park("b", [0], batch_bytes=7 * PAGE), POOL_FULL)
    # When "a"'s lease runs out (in 40 s), but no later than an open batch may go idle.
    assert refused.retry_after_s == 10.0
    assert rig.state("b").state == pb.STATE_UNKNOWN
    rig.assert_stored(10 * PAGE)
    rig.advance(35)
    refused = assert_refused(rig.park("b", [0], batch_bytes=7 * PAGE), POOL_FULL)
    assert refused.retry_after_s == 5.0
    rig.advance(4.9)
    refused = assert_refused(rig.park("b", [0], batch_bytes=7 * PAGE), POOL_FULL)
    assert refused.retry_after_s == 0.25  # never less than one reaper interval


def test_pool_full_without_any_timer_still_says_when_to_retry() -> None:
    rig = Rig(pool_pages=16)
    rig.begin("holder", batch_bytes=16 * PAGE)  # the whole pool is reserved, nothing parked
    refused = assert_refused(rig.park("b", [0], batch_bytes=PAGE), POOL_FULL)
    assert refused.retry_after_s == 1.0


def test_a_declared_batch_larger_than_the_pool_is_refused_too_large() -> None:
    rig = Rig(pool_pages=16)
    assert_refused(rig.park("huge", [0], batch_bytes=16 * PAGE + 1), TOO_LARGE)
    rig.assert_pool_empty()
    assert rig.state("huge").state == pb.STATE_UNKNOWN
    whole = {0: blob("w", 0, 16 * PAGE)}
    assert isinstance(rig.park("whole", whole, batch_bytes=16 * PAGE), ParkDone)


def test_max_batch_bytes_bounds_what_a_batch_declares_and_what_it_stores() -> None:
    rig = Rig(pool_pages=16, max_batch_bytes=4 * PAGE)
    refusal = assert_refused(rig.lot.begin_park("big", 0, 4 * PAGE + 1), TOO_LARGE)
    assert "max_batch_bytes 256" in refusal.detail
    assert rig.stats().open_batches == 0
    batch = rig.begin("big", batch_bytes=4 * PAGE)
    rig.chunk(batch, 0, blob("big", 0, 3 * PAGE))
    assert_refused(rig.send(batch, 1, blob("big", 1, PAGE + 1)), TOO_LARGE)
    rig.assert_pool_empty()
    assert rig.state("big").state == pb.STATE_UNKNOWN
    # Exactly the limit is fine, and bytes already committed are not stored again.
    rig.parked("ok", {0: blob("ok", 0, 3 * PAGE), 1: blob("ok", 1, PAGE)}, total=3)
    again = rig.begin("ok")
    rig.chunk(again, 0, blob("ok", 0, 3 * PAGE))
    rig.chunk(again, 2, blob("ok", 2, 4 * PAGE))
    assert rig.committed(again).chunks_parked == 3


def test_max_batch_bytes_counts_the_whole_pages_of_many_small_chunks() -> None:
    """A chunk takes whole pages however few its bytes: a batch of 1-byte chunks may hold no
    more pages than max_batch_bytes makes, or one batch could hold the whole pool."""
    rig = Rig(pool_pages=16, max_batch_bytes=4 * PAGE)
    batch = rig.begin("small")
    for chunk_id in range(4):
        rig.chunk(batch, chunk_id, blob("small", chunk_id, 1))
    refusal = assert_refused(rig.send(batch, 4, blob("small", 4, 1)), TOO_LARGE)
    assert f"whole {PAGE}-byte pages" in refusal.detail, refusal.detail
    rig.assert_pool_empty()
    assert rig.state("small").state == pb.STATE_UNKNOWN


def test_max_batch_bytes_zero_means_the_whole_pool_and_it_is_capped_at_the_pool() -> None:
    assert Rig(pool_pages=16).raw.max_batch_bytes == 16 * PAGE
    assert Rig(pool_pages=16, max_batch_bytes=100 * PAGE).raw.max_batch_bytes == 16 * PAGE
    rig = Rig(pool_pages=16, max_batch_bytes=100 * PAGE)
    assert_refused(rig.lot.begin_park("big", 0, 16 * PAGE + 1), TOO_LARGE)
    assert isinstance(rig.lot.begin_park("big", 0, 16 * PAGE), ParkBatch)


def test_an_undeclared_batch_that_runs_out_of_pool_frees_everything_it_stored() -> None:
    rig = Rig(pool_pages=16)
    a = {0: blob("a", 0, 6 * PAGE)}
    rig.parked("a", a)
    rig.parked("b", {0: blob("b", 0, PAGE)}, total=4)  # an earlier batch of b: it must survive
    batch = rig.begin("b")
    rig.chunk(batch, 1, blob("b", 1, 4 * PAGE))
    rig.chunk(batch, 2, blob("b", 2, 4 * PAGE))
    assert rig.pool.statistics().free_bytes == PAGE
    refused = assert_refused(rig.send(batch, 3, blob("b", 3, 2 * PAGE)), POOL_FULL)
    assert refused.retry_after_s > 0
    rig.assert_stored(7 * PAGE)
    assert rig.state("b").chunks_parked == 1
    # The failed batch stays failed, whatever comes after.
    assert rig.send(batch, 4, b"x") is refused
    assert rig.commit(batch) is refused
    rig.lot.abort_park(batch)
    # Other ids' data and b's earlier batch are intact.
    assert rig.peek("a", [0]) == a
    assert rig.peek("b", [0]) == {0: blob("b", 0, PAGE)}
    assert rig.stats().evicted_total == 0


def test_a_failed_first_batch_leaves_no_trace_of_the_id() -> None:
    rig = Rig(pool_pages=8)
    rig.parked("other", four_pages("other"))
    refused = rig.park("big", {0: blob("big", 0, 3 * PAGE), 1: blob("big", 1, 3 * PAGE)})
    assert_refused(refused, POOL_FULL)
    rig.assert_stored(4 * PAGE)
    assert rig.state("big") == IdStatus("big", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0  # nothing was lost: a retry may start over


def test_a_declared_batch_cannot_be_starved_by_an_undeclared_one() -> None:
    rig = Rig(pool_pages=16)
    declared = rig.begin("decl", batch_bytes=8 * PAGE)
    assert_refused(rig.park("greedy", {0: blob("g", 0, 9 * PAGE)}), POOL_FULL)
    rig.chunk(declared, 0, blob("decl", 0, 4 * PAGE))
    rig.chunk(declared, 1, blob("decl", 1, 4 * PAGE))
    assert rig.committed(declared) == ParkDone(2, 8 * PAGE, 2, 60.0)
    assert rig.pool.statistics().reservations_open == 0


def test_a_declared_batch_reserves_only_what_exceeds_the_ids_committed_bytes() -> None:
    """A batch sent again after a broken call declares what it declared the first time, but
    the chunks the id holds take no pages: only the rest is set aside, so a re-send on a full
    pool is neither refused POOL_FULL nor a cause to evict a delivered id."""
    rig = Rig(pool_pages=16)
    a = {0: blob("a", 0, 4 * PAGE), 1: blob("a", 1, 4 * PAGE)}
    assert isinstance(rig.park("a", a, total=3, batch_bytes=8 * PAGE), ParkDone)
    rig.parked("b", four_pages("b"))
    rig.parked("c", four_pages("c"))
    rig.deliver("c")  # not confirmed: evicted only to make room a Park needs
    assert rig.pool.statistics().free_bytes == 0
    again = rig.park("a", a, total=3, batch_bytes=8 * PAGE)
    assert again == ParkDone(2, 8 * PAGE, 3, 60.0), again
    assert rig.state("c").state == pb.STATE_DELIVERED
    assert rig.stats().evicted_total == 0
    # A batch declaring more than the id holds sets the difference aside, evicting for it.
    more = rig.begin("a", batch_bytes=12 * PAGE)
    assert rig.pool.statistics().reserved_bytes == 4 * PAGE
    assert_tombstoned(rig, "c", EVICTED)
    rig.chunk(more, 0, a[0])
    rig.chunk(more, 2, blob("a", 2, 4 * PAGE))
    assert rig.committed(more) == ParkDone(3, 12 * PAGE, 3, 60.0)
    rig.assert_stored(16 * PAGE)
    rig.lot.check_invariants()


def test_unused_reserved_pages_return_when_the_batch_ends(rig: Rig) -> None:
    batch = rig.begin("over", batch_bytes=10 * PAGE)
    assert rig.pool.statistics().reserved_bytes == 10 * PAGE
    rig.chunk(batch, 0, blob("over", 0, 2 * PAGE))
    assert isinstance(rig.commit(batch), ParkDone)
    s = rig.pool.statistics()
    assert (s.reserved_bytes, s.used_bytes, s.reservations_open) == (0, 2 * PAGE, 0)


# === idle batches, shutdown, and ids ending under an open batch =================================


def test_a_batch_silent_for_park_idle_timeout_is_undone_not_committed_and_woken(
    rig: Rig,
) -> None:
    rig.parked("p", [0], total=3)
    batch = rig.begin("p", batch_bytes=8 * PAGE)
    rig.chunk(batch, 1, blob("p", 1))
    rig.advance(9.5)
    rig.reap()
    rig.chunk(batch, 2, blob("p", 2))  # every chunk restarts the idle timer
    rig.advance(9.5)
    assert rig.reap() == []
    assert rig.stats().open_batches == 1 and rig.woken == []
    rig.advance(0.5)
    assert rig.reap() == []  # an idle batch is not an id: nothing is reaped
    assert rig.woken == [batch]
    refusal = assert_refused(rig.commit(batch), NOT_COMMITTED)
    assert "park_idle_timeout_s" in refusal.detail
    rig.assert_stored(SIZE)  # the committed chunk stays, the batch's chunks and pages are back
    stats = rig.stats()
    assert (stats.idle_batches_total, stats.open_batches, stats.pending_bytes) == (1, 0, 0)
    status = rig.state("p")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 40.5,
    )  # fmt: skip
    # A first batch going idle leaves nothing behind, not even a tombstone.
    lone = rig.begin("lone")
    rig.advance(10)
    rig.reap()
    assert rig.woken == [batch, lone]
    assert rig.state("lone") == IdStatus("lone", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0


def test_a_batch_that_re_sends_a_chunk_forever_is_undone_after_max_lease(rig: Rig) -> None:
    """A Park stream that is never silent (it sends the same chunk again every 9 s, which
    takes no pages) is still undone once it has been open for max_lease_s without a commit:
    its reservation goes back to the pool."""
    batch = rig.begin("r", batch_bytes=8 * PAGE)
    rig.chunk(batch, 0, blob("r", 0))
    for _ in range(66):  # 594 s
        rig.advance(9)
        assert rig.chunk(batch, 0, blob("r", 0)) is None
        rig.reap()
    assert rig.woken == [] and rig.stats().open_batches == 1
    rig.advance(6)
    rig.reap()
    assert rig.woken == [batch]
    refusal = assert_refused(rig.commit(batch), NOT_COMMITTED)
    assert "max_lease_s" in refusal.detail
    stats = rig.stats()
    assert (stats.idle_batches_total, stats.open_batches, stats.pending_bytes) == (1, 0, 0)
    rig.assert_stored(0)


def test_a_batch_waiting_for_its_copies_is_not_silent_yet_ends_after_max_lease(
    rig: Rig,
) -> None:
    """A Park by reference whose call waits for the copies it started reads none of the
    client's messages meanwhile: however long the copies take, that is not the client's
    silence, and once the wait ends the client has a whole park_idle_timeout_s again. A batch
    open max_lease_s is undone all the same."""
    batch = rig.begin("c", total=1)
    data = blob("c", 0)
    filled = rig.lot.begin_fill(batch, 0, len(data))
    assert isinstance(filled, tuple), filled
    handle, views = filled
    rig.lot.begin_copy_wait(batch)
    rig.advance(50)  # five idle bounds of copying
    assert rig.reap() == []
    assert rig.woken == [] and rig.stats().open_batches == 1
    at = 0
    for view in views:  # what the data thread does
        view[:] = data[at : at + len(view)]
        at += len(view)
    rig.lot.end_copy_wait(batch)
    crc = crc32c_of(data)
    assert rig.lot.end_fill(batch, 0, handle, crc, crc) is None
    rig.advance(9.5)
    rig.reap()
    assert rig.woken == []
    rig.advance(0.5)
    rig.reap()
    assert rig.woken == [batch]
    assert "park_idle_timeout_s" in assert_refused(rig.commit(batch), NOT_COMMITTED).detail
    rig.assert_pool_empty()

    long = rig.begin("l", total=1)
    filled = rig.lot.begin_fill(long, 0, SIZE)
    assert isinstance(filled, tuple), filled
    rig.lot.begin_copy_wait(long)
    rig.advance(599)
    rig.reap()
    assert rig.woken == [batch]
    rig.advance(1)
    rig.reap()
    assert rig.woken == [batch, long]
    rig.lot.end_copy_wait(long)
    refusal = assert_refused(rig.lot.end_fill(long, 0, filled[0], None, 0), NOT_COMMITTED)
    assert "max_lease_s" in refusal.detail
    rig.assert_pool_empty()
    assert rig.stats().idle_batches_total == 2


def test_keepalive_does_not_renew_an_open_batch(rig: Rig) -> None:
    batch = rig.begin("k")
    rig.chunk(batch, 0, blob("k", 0))
    rig.advance(9)
    (status,) = rig.lot.keep_alive(["k"], 100)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_UNKNOWN, 100.0)
    rig.advance(1)
    rig.reap()
    assert rig.woken == [batch]
    assert_refused(rig.commit(batch), NOT_COMMITTED)
    # The intent outlives the batch: a retry gets the lease it asked for.
    assert rig.state("k").lease_remaining_s == 99.0
    assert rig.parked("k", [0]).lease_remaining_s == 99.0


def test_shutdown_undoes_every_open_batch_shutting_down_and_wakes_it(rig: Rig) -> None:
    rig.parked("p", [0], total=3)
    on_parked = rig.begin("p", batch_bytes=8 * PAGE)
    rig.chunk(on_parked, 1, blob("p", 1))
    lone = rig.begin("lone")
    rig.chunk(lone, 0, blob("lone", 0))
    rig.lot.begin_shutdown()
    assert rig.woken == [on_parked, lone]
    refusal = assert_refused(rig.commit(on_parked), SHUTTING_DOWN)
    assert rig.send(on_parked, 2, blob("p", 2)) is refusal
    assert_refused(rig.commit(lone), SHUTTING_DOWN)
    rig.assert_stored(SIZE)
    assert rig.state("p").state == pb.STATE_PARKED  # committed ids wait for fail_all
    assert rig.state("lone") == IdStatus("lone", pb.STATE_UNKNOWN)
    stats = rig.stats()
    assert (stats.open_batches, stats.pending_bytes, stats.shutting_down) == (0, 0, True)


def test_reaping_an_id_undoes_its_open_batch_reaped_and_wakes_it() -> None:
    rig = Rig(park_idle_timeout_s=100)
    rig.parked("open", [0], total=3)
    batch = rig.begin("open", batch_bytes=10 * PAGE)
    rig.chunk(batch, 1, blob("open", 1))
    rig.advance(60)
    assert rig.reap() == ["open"]
    assert rig.woken == [batch]
    rig.assert_pool_empty()  # the chunks and the unused reservation are all back
    refused = assert_refused(rig.send(batch, 2, blob("open", 2)), REAPED)
    rig.assert_pool_empty()  # nothing stored for a dead id
    assert rig.commit(batch) is refused
    rig.lot.abort_park(batch)  # what the servicer does in `finally`: a no-op now
    rig.assert_pool_empty()
    assert_tombstoned(rig, "open", REAPED)
    assert rig.stats().idle_batches_total == 0


def test_release_while_a_park_batch_is_open_undoes_the_batch_released(rig: Rig) -> None:
    rig.parked("rel", [0], total=2)
    batch = rig.begin("rel", batch_bytes=4 * PAGE)
    rig.chunk(batch, 1, blob("rel", 1))
    assert rig.lot.release("rel") is None
    assert rig.woken == [batch]
    rig.assert_pool_empty()
    assert_refused(rig.commit(batch), RELEASED)


def test_release_of_an_id_with_only_open_batches_ends_them_released(rig: Rig) -> None:
    first, second = rig.begin("only"), rig.begin("only", batch_bytes=4 * PAGE)
    rig.chunk(first, 0, blob("only", 0))
    assert rig.lot.release("only") is None
    assert rig.woken == [first, second]
    assert_refused(rig.commit(first), RELEASED)
    assert_refused(rig.send(second, 0, blob("only", 0)), RELEASED)
    assert_tombstoned(rig, "only", RELEASED)
    rig.assert_pool_empty()
    stats = rig.stats()
    assert (stats.released_total, stats.open_batches, stats.pending_bytes) == (1, 0, 0)
    assert_refused(rig.lot.begin_park("only", 0, 0), RELEASED, late=True)


# === leases and the reaper =====================================================================


def test_the_lease_starts_at_the_first_commit_not_at_the_header_or_a_chunk(rig: Rig) -> None:
    batch = rig.begin("slow")
    rig.advance(40)
    rig.chunk(batch, 0, blob("slow", 0))
    rig.advance(5)
    assert rig.committed(batch) == ParkDone(1, SIZE, 1, 60.0)
    assert rig.state("slow").age_s == 0.0  # age counts from the first commit too
    # Later commits neither restart nor stretch it.
    rig.advance(30)
    assert rig.parked("slow", {0: blob("slow", 0)}).lease_remaining_s == 30.0
    rig.advance(29.5)
    assert rig.reap() == []
    assert rig.state("slow").lease_remaining_s == 0.5
    rig.advance(0.5)
    assert rig.reap() == ["slow"]


def test_an_unfetched_id_is_reaped_after_its_lease_and_its_memory_freed(rig: Rig) -> None:
    rig.parked("lost", range(3))
    rig.assert_stored(3 * SIZE)
    rig.advance(59.5)
    assert rig.reap() == []
    assert rig.state("lost").state == pb.STATE_PARKED
    rig.advance(0.5)
    assert rig.reap() == ["lost"]
    assert_tombstoned(rig, "lost", REAPED)
    rig.assert_pool_empty()
    assert rig.stats().reaped_total == 1
    assert rig.lot.next_deadline() is None


def test_a_late_fetch_after_reap_is_refused_reaped_at_once_and_not_bound(rig: Rig) -> None:
    rig.parked("late", range(2))
    rig.advance(61)
    rig.reap()
    refusal = assert_refused(rig.bind("late"), REAPED, late=True)
    assert "REASON_REAPED" in refusal.detail
    stats = rig.stats()
    assert (stats.late_fetch_rejections_total, stats.bound_ids) == (1, 0)
    assert_tombstoned(rig, "late", REAPED)


def test_a_park_after_reap_is_refused_without_storing_and_a_late_fetch_still_says_reaped(
    rig: Rig,
) -> None:
    rig.parked("late", range(2))
    rig.advance(61)
    rig.reap()
    assert_refused(rig.park("late", range(2), total=2, batch_bytes=1000), REAPED, late=True)
    rig.assert_pool_empty()
    assert rig.stats().late_park_rejections_total == 1
    assert_refused(rig.bind("late"), REAPED, late=True)


def test_tombstones_are_pruned_after_retention_even_when_nothing_is_parked(rig: Rig) -> None:
    rig.parked("gone", [0])
    rig.advance(60)
    rig.reap()
    assert rig.stats().parked_ids == 0
    rig.advance(119.5)
    rig.reap()
    assert_tombstoned(rig, "gone", REAPED)
    assert rig.state("gone").age_s == 119.5
    rig.advance(0.5)
    rig.reap()
    assert rig.state("gone") == IdStatus("gone", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0
    # The id is free again: a new life starts over.
    assert rig.parked("gone", [0]).chunks_parked == 1


def test_tombstones_are_capped_oldest_first() -> None:
    rig = Rig(max_tombstones=3)
    for i in range(5):
        rig.parked(f"id{i}", [0])
        assert rig.lot.release(f"id{i}") is None
        rig.advance(1)
    assert rig.stats().tombstones == 3
    assert [rig.state(f"id{i}").state for i in range(5)] == [
        pb.STATE_UNKNOWN, pb.STATE_UNKNOWN,
        pb.STATE_TOMBSTONED, pb.STATE_TOMBSTONED, pb.STATE_TOMBSTONED,
    ]  # fmt: skip


def test_one_pass_ends_ids_before_idle_batches_and_keeps_the_newest_tombstones() -> None:
    """A pass that ends more ids than `max_tombstones` keeps the same tombstones as ending them
    one at a time would: the newest, oldest dropped first. An id's open batch ends with its id
    (REAPED, not as an idle batch); a batch of an id with nothing committed only goes idle; bound
    and unexpired ids are left alone."""
    rig = Rig(max_tombstones=3)
    rig.parked("released", [0])
    assert rig.lot.release("released") is None
    busy = rig.bound("busy")  # a demand: bound before any commit, so never on a lease
    for i in range(4):
        rig.parked(f"id{i}", [0, 1])
        rig.advance(1)
    rig.parked("withbatch", [0], total=2)
    batch = rig.begin("withbatch")
    rig.chunk(batch, 1, blob("withbatch", 1))
    idle = rig.begin("idle")
    rig.chunk(idle, 0, blob("idle", 0))
    rig.advance(30)
    rig.parked("young", [0])
    rig.advance(30)  # every lease but young's has run out, and both batches are idle

    assert rig.reap() == ["id0", "id1", "id2", "id3", "withbatch"]

    assert rig.stats().tombstones == 3
    for kid in ("released", "id0", "id1"):
        assert rig.state(kid).state == pb.STATE_UNKNOWN
    for kid in ("id2", "id3", "withbatch"):
        assert_tombstoned(rig, kid, REAPED)
        assert rig.state(kid).age_s == 0
    assert rig.woken == [batch, idle]
    assert_refused(rig.commit(batch), REAPED)
    assert_refused(rig.commit(idle), NOT_COMMITTED)
    assert rig.state("idle") == IdStatus("idle", pb.STATE_UNKNOWN)
    assert rig.state("young").state == pb.STATE_PARKED
    assert rig.state("busy").state == pb.STATE_BOUND and busy.active
    stats = rig.stats()
    assert (stats.parked_ids, stats.bound_ids, stats.reaped_total) == (1, 1, 5)
    assert (stats.idle_batches_total, stats.open_batches) == (1, 0)
    assert stats.parked_bytes == SIZE
    rig.assert_stored(SIZE)
    assert rig.pool.statistics().reservations_open == 0


def test_a_bound_id_is_not_reaped_while_its_fetch_is_attached(rig: Rig) -> None:
    rig.parked("busy", [0, 1], total=2)
    binding = rig.bound("busy")
    rig.advance(1000)
    assert rig.reap() == []
    assert rig.state("busy").state == pb.STATE_BOUND
    sent, end = rig.drain(binding)
    assert [cid for cid, _ in sent] == [0, 1]
    assert_delivered(end)


def test_a_reaper_pass_touches_only_expired_ids() -> None:
    """100k parked ids, 1k of them expired: a pass pops 1k timer items, not 100k (the reaper
    costs O(expired), never O(parked)). Counted, not timed."""
    rig = Rig(pool_pages=100_000)
    lot = rig.raw  # unchecked: 300k calls
    one = memoryview(b"\x01")
    for i in range(100_000):
        if i == 1_000:
            rig.advance(30)  # the rest are parked 30 s later, so their leases end later
        batch = lot.begin_park(f"id{i}", 1, 0)
        assert isinstance(batch, ParkBatch)
        assert lot.park_chunk(batch, 0, one, None) is None
        assert isinstance(lot.commit_park(batch, 1, 1), ParkDone)
    rig.advance(31)
    before = len(lot._timers)
    pops_before = lot._timers.pops

    reaped = lot.reap()

    assert reaped == [f"id{i}" for i in range(1_000)]
    assert lot._timers.pops - pops_before == 1_000
    assert before - len(lot._timers) == 1_000
    stats = lot.statistics()
    assert (stats.parked_ids, stats.reaped_total, stats.parked_bytes) == (99_000, 1_000, 99_000)
    assert rig.pool.statistics().stored_bytes == 99_000
    pops_before = lot._timers.pops
    assert lot.reap() == [] and lot._timers.pops == pops_before  # the next pass touches nothing
    rig.check()


def test_the_timer_queue_stays_small_when_a_fetch_binds_and_cancels_over_and_over(
    rig: Rig,
) -> None:
    """Each cancel re-arms the timer; re-arming must not pile up live-looking duplicates that
    no rebuild can drop (the lot promises a queue of O(ids) items)."""
    rig.parked("retry", [0])
    for _ in range(5_000):
        rig.lot.cancel_fetch(rig.bound("retry"))
    rig.reap()
    assert len(rig.lot._timers) <= 10, len(rig.lot._timers)
    rig.advance(60)
    assert rig.reap() == ["retry"]
    assert rig.lot.reaped_total == 1


# === KeepAlive ====================================================================================


def test_keepalive_extends_a_parked_lease_past_the_unbound_timeout(rig: Rig) -> None:
    rig.parked("k", [0])
    rig.advance(50)
    (status,) = rig.lot.keep_alive(["k"], 200)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_PARKED, 200.0)
    rig.advance(199.5)
    assert rig.reap() == []
    rig.advance(0.5)
    assert rig.reap() == ["k"]


def test_keepalive_never_extends_beyond_max_lease_after_the_first_commit(rig: Rig) -> None:
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
    rig.parked("delivered", [0])
    rig.deliver("delivered")
    states = rig.lot.keep_alive(["parked", "gone", "new", "delivered"], 100)
    assert [(s.kv_request_id, s.state) for s in states] == [
        ("parked", pb.STATE_PARKED),
        ("gone", pb.STATE_TOMBSTONED),
        ("new", pb.STATE_UNKNOWN),
        ("delivered", pb.STATE_DELIVERED),
    ]
    assert states[1].reason == RELEASED
    assert states[2].lease_remaining_s == 100.0
    assert rig.stats().intents == 1  # no intent for the tombstoned id


def test_keepalive_reads_a_generator_of_ids_once(rig: Rig) -> None:
    rig.parked("a", [0])
    states = rig.lot.keep_alive((kid for kid in ["a", "b"]), 100)
    assert [(s.kv_request_id, s.state, s.lease_remaining_s) for s in states] == [
        ("a", pb.STATE_PARKED, 100.0),
        ("b", pb.STATE_UNKNOWN, 100.0),
    ]
    assert rig.state("a").lease_remaining_s == 100.0
    assert rig.stats().intents == 1


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
    assert rig.stats().intents == 1
    rig.advance(50)
    assert rig.parked("early", [0]).lease_remaining_s == 150.0
    assert rig.stats().intents == 0  # consumed by the first commit
    rig.advance(149.5)
    assert rig.reap() == []
    rig.advance(0.5)
    assert rig.reap() == ["early"]


def test_keepalive_on_an_id_with_only_an_open_batch_is_used_by_its_first_commit(
    rig: Rig,
) -> None:
    batch = rig.begin("k")
    rig.chunk(batch, 0, blob("k", 0))
    (status,) = rig.lot.keep_alive(["k"], 200)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_UNKNOWN, 200.0)
    assert rig.stats().intents == 0  # held by the id, not by the intent table
    rig.advance(5)
    assert rig.committed(batch).lease_remaining_s == 195.0


def test_keepalive_on_an_id_whose_batch_is_undone_keeps_the_intent(rig: Rig) -> None:
    batch = rig.begin("k")
    rig.lot.keep_alive(["k"], 300)
    rig.lot.abort_park(batch)
    assert rig.state("k") == IdStatus("k", pb.STATE_UNKNOWN, lease_remaining_s=300.0)
    assert rig.stats().intents == 1
    rig.advance(10)
    assert rig.parked("k", [0]).lease_remaining_s == 290.0


def test_keepalive_on_a_demand_is_used_when_its_first_commit_arrives(rig: Rig) -> None:
    binding = rig.bound("k", [0])
    (status,) = rig.lot.keep_alive(["k"], 200)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_BOUND, 0.0)
    rig.advance(10)
    assert rig.parked("k", [0]).lease_remaining_s == 0.0  # bound: no lease runs
    rig.lot.cancel_fetch(binding)
    assert rig.state("k").lease_remaining_s == 190.0


def test_an_intent_shorter_than_the_unbound_timeout_does_not_shorten_the_lease(rig: Rig) -> None:
    rig.lot.keep_alive(["short"], 10)
    assert rig.parked("short", [0]).lease_remaining_s == 60.0


def test_an_intent_is_capped_at_max_lease(rig: Rig) -> None:
    (status,) = rig.lot.keep_alive(["far"], 1e9)
    assert status.lease_remaining_s == 600.0
    assert rig.parked("far", [0]).lease_remaining_s == 600.0


def test_an_intent_is_never_shortened_by_a_later_keepalive(rig: Rig) -> None:
    rig.lot.keep_alive(["i"], 100)
    assert rig.lot.keep_alive(["i"], 20)[0].lease_remaining_s == 100.0


def test_intents_expire_at_their_own_deadline(rig: Rig) -> None:
    rig.lot.keep_alive(["x"], 100)
    rig.advance(99)
    rig.reap()
    assert rig.stats().intents == 1
    rig.advance(1)
    rig.reap()
    assert rig.stats().intents == 0
    assert rig.state("x") == IdStatus("x", pb.STATE_UNKNOWN)
    assert rig.parked("x", [0]).lease_remaining_s == 60.0


def test_intents_are_capped_oldest_first() -> None:
    rig = Rig(max_tombstones=3)
    for i in range(5):
        rig.lot.keep_alive([f"i{i}"], 100)
    assert rig.stats().intents == 3
    assert [rig.state(f"i{i}").lease_remaining_s for i in range(5)] == [0, 0, 100, 100, 100]


def test_a_keepalive_intent_survives_a_failed_first_batch(rig: Rig) -> None:
    """The id is still not parked after its first batch failed: the intent must still hold."""
    rig.lot.keep_alive(["k"], 300)
    data = {0: blob("k", 0), 1: blob("k", 1)}
    refused = rig.park("k", data, crcs={1: crc32c_of(data[1]) ^ 1})
    assert_refused(refused, CHECKSUM_MISMATCH)
    assert rig.state("k") == IdStatus("k", pb.STATE_UNKNOWN, lease_remaining_s=300.0)
    rig.advance(10)
    assert rig.parked("k", data).lease_remaining_s == 290.0


def test_a_keepalive_intent_is_not_shortened_by_a_batch_that_committed_nothing(
    rig: Rig,
) -> None:
    rig.lot.keep_alive(["k"], 300)
    batch = rig.begin("k")  # the id now has an entry, but no chunk
    rig.lot.keep_alive(["k"], 100)
    assert rig.committed(batch) == ParkDone(0, 0, 0, 0.0)  # an empty batch
    assert rig.state("k").lease_remaining_s == 300.0
    assert rig.parked("k", [0]).lease_remaining_s == 300.0


# === Fetch: waiting, stalls, cancels ============================================================


def test_the_wait_bounds_a_stall_and_moves_on_with_every_chunk_sent(rig: Rig) -> None:
    rig.parked("w", [0, 1], total=3)
    binding = rig.bound("w", wait_s=4)
    assert binding.wait_deadline == rig.clock.now + 4
    rig.advance(3)
    assert rig.next(binding) == (0, blob("w", 0))
    assert binding.wait_deadline == rig.clock.now + 4
    rig.advance(3)  # longer than the wait since the bind, but not since the last chunk
    assert rig.next(binding) == (1, blob("w", 1))
    rig.advance(1)
    assert rig.next(binding) == FetchWait(deadline=rig.clock.now + 3)
    rig.advance(3)
    end = rig.lot.fetch_wait_expired(binding)
    assert end.refusal is not None and end.refusal.reason == WAIT_TIMEOUT
    assert "chunk 2 not committed within 4s" in end.refusal.detail


def test_the_wait_counts_from_the_end_of_a_long_write(rig: Rig) -> None:
    """A batch handed out takes longer to write than the wait (a whole TCP batch to a slow
    reader): once it went out, the wait for the next chunk starts again."""
    rig.parked("l", [0], total=2)
    binding = rig.bound("l", wait_s=2)
    assert rig.next(binding) == (0, blob("l", 0))
    rig.advance(5)  # the write of chunk 0
    rig.lot.sent(binding)
    assert rig.next(binding) == FetchWait(deadline=rig.clock.now + 2)


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
    assert (end.chunks_sent, end.bytes_sent, end.delivery_id) == (1, SIZE, 0)
    status = rig.state("part")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 51.0,
    )  # fmt: skip
    # A retry after the missing chunk arrives gets everything.
    rig.parked("part", [1])
    sent, end = rig.drain(rig.bound("part"))
    assert [cid for cid, _ in sent] == [0, 1]
    assert_delivered(end)


def test_wait_expiry_of_a_fetch_before_any_park_forgets_the_id(rig: Rig) -> None:
    binding = rig.bound("never", wait_s=3)
    assert binding.time_to_fetch_s is None
    assert isinstance(rig.next(binding), FetchWait)
    rig.advance(3)
    end = rig.lot.fetch_wait_expired(binding)
    assert end == FetchEnd(end.refusal, 0, 0)
    assert end.refusal is not None and end.refusal.reason == WAIT_TIMEOUT
    assert rig.state("never") == IdStatus("never", pb.STATE_UNKNOWN)
    stats = rig.stats()
    assert (stats.parked_ids, stats.bound_ids, stats.tombstones) == (0, 0, 0)


@pytest.mark.parametrize(("asked", "granted"), [(0.0, 30.0), (5.0, 5.0), (100.0, 30.0)])
def test_the_wait_is_the_smaller_of_the_request_and_max_fetch_wait(
    rig: Rig, asked: float, granted: float
) -> None:
    binding = rig.bound("w", wait_s=asked)
    assert binding.wait_deadline == rig.clock.now + granted


def test_a_second_fetch_is_refused_already_bound(rig: Rig) -> None:
    rig.parked("one", [0], total=1)
    first = rig.bound("one")
    assert_refused(rig.bind("one"), ALREADY_BOUND, late=False)
    sent, end = rig.drain(first)  # the first Fetch is unaffected
    assert len(sent) == 1
    assert_delivered(end)
    rig.bound("demand")
    assert_refused(rig.bind("demand"), ALREADY_BOUND)


def test_a_cancelled_fetch_returns_the_id_to_parked_with_its_old_lease(rig: Rig) -> None:
    rig.parked("c", [0, 1], total=2)
    rig.advance(20)
    binding = rig.bound("c")
    assert binding.time_to_fetch_s == 20.0
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
    assert_delivered(end)


def test_a_cancel_after_the_old_lease_ran_out_is_reaped_on_the_next_pass(rig: Rig) -> None:
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


def test_a_cancelled_demand_keeps_chunks_committed_meanwhile_with_their_lease(rig: Rig) -> None:
    binding = rig.bound("d", [0, 1])
    rig.advance(5)
    assert rig.parked("d", [1]).lease_remaining_s == 0.0  # the lease starts, but is stopped
    rig.advance(5)
    rig.lot.cancel_fetch(binding)
    status = rig.state("d")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 1, 55.0,
    )  # fmt: skip
    rig.advance(55)
    assert rig.reap() == ["d"]


def test_a_cancelled_demand_without_chunks_leaves_nothing_behind(rig: Rig) -> None:
    rig.lot.cancel_fetch(rig.bound("nothing"))
    assert rig.state("nothing") == IdStatus("nothing", pb.STATE_UNKNOWN)
    assert rig.stats().tombstones == 0


def test_a_stalled_fetch_returns_the_id_to_parked_with_a_fresh_lease(rig: Rig) -> None:
    rig.parked("s", [0, 1], total=2)
    rig.advance(50)
    binding = rig.bound("s")
    assert rig.next(binding) == (0, blob("s", 0))
    rig.advance(5)
    rig.lot.stall_fetch(binding)
    status = rig.state("s")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_PARKED, 2, 60.0,
    )  # fmt: skip
    rig.lot.stall_fetch(binding)  # already detached: not counted twice
    assert rig.stats().stalled_fetches_total == 1
    end = rig.next(binding)
    assert isinstance(end, FetchEnd) and end.refusal is not None
    rig.advance(59.5)
    assert rig.reap() == []
    rig.advance(0.5)
    assert rig.reap() == ["s"]


def test_a_stall_never_shortens_a_longer_lease(rig: Rig) -> None:
    rig.parked("s", [0])
    rig.lot.keep_alive(["s"], 300)
    binding = rig.bound("s")
    rig.advance(10)
    rig.lot.stall_fetch(binding)
    assert rig.state("s").lease_remaining_s == 290.0
    assert rig.stats().stalled_fetches_total == 1


def test_stalls_never_keep_an_id_past_max_lease(rig: Rig) -> None:
    """A consumer that binds and stalls again and again: each stall gives a fresh lease, but
    none runs past max_lease_s (600 s) from the first commit."""
    rig.parked("s", [0])
    for _ in range(11):
        rig.advance(50)
        rig.lot.stall_fetch(rig.bound("s"))
    # At 550 s a fresh lease would run to 610 s; the cap ends it at 600.
    assert rig.state("s").lease_remaining_s == 50.0
    rig.advance(49.5)
    assert rig.reap() == []
    rig.advance(0.5)
    assert rig.reap() == ["s"]


def test_a_stalled_demand_leaves_nothing_behind(rig: Rig) -> None:
    rig.lot.stall_fetch(rig.bound("nothing"))
    assert rig.state("nothing") == IdStatus("nothing", pb.STATE_UNKNOWN)
    stats = rig.stats()
    assert (stats.stalled_fetches_total, stats.bound_ids, stats.tombstones) == (1, 0, 0)


# === delivery, confirmation and redelivery ======================================================


def test_a_delivered_id_keeps_its_bytes_for_the_grace_then_ends_already_consumed(
    rig: Rig,
) -> None:
    rig.parked("d", [0, 1], total=2)
    rig.deliver("d")
    rig.advance(29.5)
    assert rig.reap() == []
    status = rig.state("d")
    assert (status.state, status.chunks_parked, status.lease_remaining_s) == (
        pb.STATE_DELIVERED, 2, 0.5,
    )  # fmt: skip
    rig.assert_stored(2 * SIZE)
    rig.advance(0.5)
    assert rig.reap() == []  # not reaped: delivered and never confirmed
    assert_tombstoned(rig, "d", ALREADY_CONSUMED)
    rig.assert_pool_empty()
    stats = rig.stats()
    assert (stats.consumed_total, stats.confirmed_total, stats.reaped_total) == (1, 0, 0)
    assert (stats.delivered_total, stats.delivered_ids) == (1, 0)


def test_a_wrong_delivery_id_is_refused_unknown_id_and_changes_nothing(rig: Rig) -> None:
    rig.parked("d", [0])
    delivery = rig.deliver("d")
    rig.advance(10)
    assert_refused(rig.lot.release("d", delivery ^ 1), UNKNOWN_ID)
    assert rig.state("d") == IdStatus("d", pb.STATE_DELIVERED, 0, 1, 1, SIZE, 10.0, 20.0)
    rig.assert_stored(SIZE)
    rig.parked("p", [0])
    assert_refused(rig.lot.release("p", delivery), UNKNOWN_ID)  # never delivered
    assert rig.state("p").state == pb.STATE_PARKED
    assert_refused(rig.lot.release("nobody", delivery), UNKNOWN_ID)
    stats = rig.stats()
    assert (stats.consumed_total, stats.confirmed_total, stats.released_total) == (0, 0, 0)
    assert rig.lot.release("d", delivery) is None
    assert_refused(rig.lot.release("d", delivery), ALREADY_CONSUMED)  # confirmed already


def test_delivery_ids_differ_between_ids_and_deliveries(rig: Rig) -> None:
    for kid in ("a", "b", "c"):
        rig.parked(kid, [0])
    ids = {rig.deliver(kid) for kid in ("a", "b", "c")}
    ids.add(rig.deliver("a"))  # a redelivery
    assert len(ids) == 4 and 0 not in ids


def test_a_fetch_of_a_delivered_id_sends_it_again_with_a_new_delivery_id(rig: Rig) -> None:
    data = {0: blob("r", 0), 1: blob("r", 1)}
    rig.parked("r", data)
    first = rig.deliver("r")
    rig.advance(10)
    binding = rig.bound("r")
    assert binding.redelivery and binding.time_to_fetch_s == 10.0
    assert rig.state("r").state == pb.STATE_BOUND
    stats = rig.stats()
    assert (stats.delivered_ids, stats.bound_ids, stats.parked_ids) == (0, 1, 0)
    sent, end = rig.drain(binding)
    assert sent == [(0, data[0]), (1, data[1])]
    second = assert_delivered(end).delivery_id
    assert second != first
    assert rig.state("r").lease_remaining_s == 30.0  # a fresh grace for the new delivery
    stats = rig.stats()
    assert (stats.delivered_total, stats.redelivered_total, stats.delivered_ids) == (2, 1, 1)
    assert_refused(rig.lot.release("r", first), UNKNOWN_ID)  # the old delivery is over
    assert rig.lot.release("r", second) is None
    assert rig.stats().confirmed_total == 1


def test_a_cancelled_redelivery_returns_the_id_to_delivered_with_its_old_grace(
    rig: Rig,
) -> None:
    rig.parked("r", [0, 1])
    delivery = rig.deliver("r")
    rig.advance(10)
    binding = rig.bound("r")
    assert rig.next(binding) == (0, blob("r", 0))
    assert_refused(rig.lot.release("r", delivery), UNKNOWN_ID)  # being sent again
    assert_refused(rig.lot.release("r"), ALREADY_BOUND)
    rig.advance(5)
    rig.lot.cancel_fetch(binding)
    status = rig.state("r")
    assert (status.state, status.lease_remaining_s) == (pb.STATE_DELIVERED, 15.0)
    stats = rig.stats()
    assert (stats.delivered_ids, stats.delivered_total, stats.redelivered_total) == (1, 1, 0)
    assert rig.lot.release("r", delivery) is None  # the old delivery still confirms
    assert_tombstoned(rig, "r", ALREADY_CONSUMED)


def test_a_stalled_redelivery_returns_the_id_to_delivered_with_a_fresh_grace(rig: Rig) -> None:
    rig.parked("r", [0, 1])
    delivery = rig.deliver("r")
    rig.advance(20)
    binding = rig.bound("r")
    rig.advance(5)
    rig.lot.stall_fetch(binding)
    status = rig.state("r")
    assert (status.state, status.lease_remaining_s) == (pb.STATE_DELIVERED, 30.0)
    assert rig.stats().stalled_fetches_total == 1
    rig.advance(29.5)
    rig.reap()
    assert rig.lot.release("r", delivery) is None


def test_a_redelivery_that_times_out_returns_the_id_to_delivered(rig: Rig) -> None:
    """A subset was delivered; a whole-id Fetch then waits for a chunk no Park may add."""
    rig.parked("part", [0], total=2)
    delivery = rig.deliver("part", [0])
    binding = rig.bound("part", wait_s=3)
    sent, step = rig.drain(binding)
    assert sent == [(0, blob("part", 0))] and isinstance(step, FetchWait)
    rig.advance(3)
    end = rig.lot.fetch_wait_expired(binding)
    assert end.refusal is not None and end.refusal.reason == WAIT_TIMEOUT
    status = rig.state("part")
    assert (status.state, status.lease_remaining_s) == (pb.STATE_DELIVERED, 27.0)
    assert rig.lot.release("part", delivery) is None


def test_a_park_on_a_delivered_id_is_refused_already_consumed(rig: Rig) -> None:
    rig.parked("d", [0], total=2)
    rig.deliver("d", [0])
    assert_refused(rig.lot.begin_park("d", 0, 0), ALREADY_CONSUMED, late=False)
    binding = rig.bound("d")  # being sent again: still delivered
    assert_refused(rig.lot.begin_park("d", 2, 4 * PAGE), ALREADY_CONSUMED)
    rig.lot.cancel_fetch(binding)
    stats = rig.stats()
    assert (stats.open_batches, stats.late_park_rejections_total) == (0, 0)
    rig.assert_stored(SIZE)


def test_an_open_batch_of_an_id_that_got_delivered_is_refused_at_its_next_chunk_or_commit(
    rig: Rig,
) -> None:
    rig.parked("x", [0], total=3)
    first = rig.begin("x")
    rig.chunk(first, 1, blob("x", 1))
    second = rig.begin("x")
    rig.chunk(second, 2, blob("x", 2))
    rig.deliver("x", [0])
    assert rig.stats().pending_bytes == 2 * SIZE  # held until each batch's next call
    assert_refused(rig.send(first, 2, blob("x", 2)), ALREADY_CONSUMED)
    assert rig.stats().pending_bytes == SIZE
    assert_refused(rig.commit(second), ALREADY_CONSUMED)
    assert rig.woken == []  # both answered in their own calls
    rig.assert_stored(SIZE)
    status = rig.state("x")
    assert (status.state, status.chunks_parked) == (pb.STATE_DELIVERED, 1)


def test_keepalive_does_not_stretch_a_delivery_grace(rig: Rig) -> None:
    rig.parked("d", [0])
    rig.deliver("d")
    rig.advance(10)
    (status,) = rig.lot.keep_alive(["d"], 500)
    assert (status.state, status.lease_remaining_s) == (pb.STATE_DELIVERED, 20.0)
    assert rig.stats().intents == 0
    rig.advance(20)
    rig.reap()
    assert_tombstoned(rig, "d", ALREADY_CONSUMED)


# === eviction under pool pressure ===============================================================


def test_pool_pressure_evicts_delivered_ids_oldest_delivery_first() -> None:
    rig = Rig(pool_pages=16)
    for kid in ("p", "a", "b", "c"):
        rig.parked(kid, four_pages(kid))
    rig.deliver("b")
    rig.deliver("a")
    assert rig.pool.statistics().free_bytes == 0
    # A chunk that needs pages evicts the oldest delivery, and only that one.
    assert isinstance(rig.park("new", four_pages("new")), ParkDone)
    assert_tombstoned(rig, "b", EVICTED)
    assert rig.state("a").state == pb.STATE_DELIVERED
    assert rig.stats().evicted_total == 1
    assert_refused(rig.bind("b"), EVICTED, late=True)
    # So does a reservation.
    rig.begin("reserving", batch_bytes=4 * PAGE)
    assert_tombstoned(rig, "a", EVICTED)
    # Nothing delivered is left: parked ids are never evicted.
    refused = assert_refused(rig.lot.begin_park("more", 0, PAGE), POOL_FULL)
    assert refused.retry_after_s > 0
    for kid in ("p", "c", "new"):
        assert rig.state(kid).state == pb.STATE_PARKED
    assert rig.peek("p", [0]) == four_pages("p")
    stats = rig.stats()
    assert (stats.evicted_total, stats.delivered_ids, stats.consumed_total) == (2, 0, 0)


def test_eviction_goes_on_until_the_request_fits() -> None:
    rig = Rig(pool_pages=16)
    for kid in ("a", "b", "c", "p"):
        rig.parked(kid, four_pages(kid))
        if kid != "p":
            rig.deliver(kid)
    rig.begin("big", batch_bytes=8 * PAGE)
    assert_tombstoned(rig, "a", EVICTED)
    assert_tombstoned(rig, "b", EVICTED)
    assert rig.state("c").state == pb.STATE_DELIVERED
    assert rig.stats().evicted_total == 2
    assert rig.pool.statistics().free_bytes == 0


def test_parked_and_bound_ids_are_never_evicted() -> None:
    rig = Rig(pool_pages=8)
    rig.parked("p", four_pages("p"))
    rig.parked("r", four_pages("r"))
    rig.deliver("r")
    binding = rig.bound("r")  # being delivered again: BOUND, not evictable
    assert_refused(rig.lot.begin_park("x", 0, PAGE), POOL_FULL)
    batch = rig.begin("y")
    assert_refused(rig.send(batch, 0, blob("y", 0, PAGE)), POOL_FULL)
    assert rig.stats().evicted_total == 0
    assert rig.state("r").state == pb.STATE_BOUND
    rig.lot.cancel_fetch(binding)  # DELIVERED again: evictable
    assert isinstance(rig.lot.begin_park("x", 0, PAGE), ParkBatch)
    assert_tombstoned(rig, "r", EVICTED)
    assert rig.state("p").state == pb.STATE_PARKED


def test_evicting_an_id_undoes_its_open_batch_evicted_and_wakes_it() -> None:
    rig = Rig(pool_pages=12)
    rig.parked("x", four_pages("x"), total=2)
    batch = rig.begin("x")
    rig.chunk(batch, 1, blob("x", 1, 4 * PAGE))
    rig.deliver("x", [0])
    assert rig.parked("y", {0: blob("y", 0, 8 * PAGE)}).chunks_parked == 1
    assert rig.woken == [batch]
    assert_tombstoned(rig, "x", EVICTED)
    assert_refused(rig.commit(batch), EVICTED)
    rig.assert_stored(8 * PAGE)


def two_deliveries() -> Rig:
    """A full pool of 12 pages: "old" delivered, then "new" a second later, "p" parked."""
    rig = Rig(pool_pages=12)
    for kid in ("old", "new", "p"):
        rig.parked(kid, four_pages(kid))
    rig.deliver("old")
    rig.advance(1)
    rig.deliver("new")
    return rig


@pytest.mark.parametrize("how", ["cancelled", "stalled"])
def test_a_redelivery_that_ends_short_keeps_its_place_in_the_eviction_order(how: str) -> None:
    rig = two_deliveries()
    binding = rig.bound("old")
    if how == "cancelled":
        rig.lot.cancel_fetch(binding)  # back to DELIVERED: still the older delivery
    else:
        assert isinstance(rig.next(binding), tuple)
        rig.lot.stall_fetch(binding)  # a fresh grace, but the delivery is as old as it was
    rig.parked("n", four_pages("n"))
    assert_tombstoned(rig, "old", EVICTED)
    assert rig.state("new").state == pb.STATE_DELIVERED
    rig.check()


def test_a_completed_redelivery_is_the_newest_delivery() -> None:
    rig = two_deliveries()
    rig.deliver("old")
    rig.parked("n", four_pages("n"))
    assert_tombstoned(rig, "new", EVICTED)
    assert rig.state("old").state == pb.STATE_DELIVERED
    rig.check()


def test_a_park_that_eviction_cannot_fit_evicts_nothing() -> None:
    rig = Rig(pool_pages=16)
    rig.parked("p", four_pages("p"))
    for kid in ("a", "b"):
        rig.parked(kid, four_pages(kid))
    a_delivery = rig.deliver("a")
    rig.deliver("b")
    redelivery = rig.bound("b")  # BOUND: its pages are not eviction's to free
    # 4 free pages and a's 4 make 8: 9 cannot be had, by a reservation or by a chunk.
    refused = assert_refused(rig.lot.begin_park("x", 0, 9 * PAGE), POOL_FULL)
    assert refused.retry_after_s > 0
    batch = rig.begin("y")
    assert_refused(rig.send(batch, 0, blob("y", 0, 9 * PAGE)), POOL_FULL)
    assert rig.stats().evicted_total == 0
    assert rig.state("a").state == pb.STATE_DELIVERED
    rig.check()
    # 8 pages can be had: a is evicted for them, and only a.
    assert isinstance(rig.lot.begin_park("x", 0, 8 * PAGE), ParkBatch)
    assert_tombstoned(rig, "a", EVICTED)
    assert_refused(rig.lot.release("a", a_delivery), EVICTED)
    assert rig.state("b").state == pb.STATE_BOUND
    assert rig.stats().evicted_total == 1
    assert redelivery.active
    rig.check()


# === Release =====================================================================================


def test_release_frees_a_parked_id_and_tombstones_it_released(rig: Rig) -> None:
    rig.parked("r", range(3))
    assert rig.lot.release("r") is None
    rig.assert_pool_empty()
    assert_tombstoned(rig, "r", RELEASED)
    assert rig.stats().released_total == 1
    assert_refused(rig.bind("r"), RELEASED, late=True)
    assert_refused(rig.lot.release("r"), RELEASED)


def test_release_gives_up_a_delivered_id_released(rig: Rig) -> None:
    rig.parked("d", [0])
    rig.deliver("d")
    assert rig.lot.release("d") is None
    assert_tombstoned(rig, "d", RELEASED)
    rig.assert_pool_empty()
    stats = rig.stats()
    assert (stats.released_total, stats.consumed_total, stats.delivered_ids) == (1, 0, 0)


def test_release_of_a_bound_id_is_refused_already_bound(rig: Rig) -> None:
    rig.parked("r", [0], total=1)
    binding = rig.bound("r")
    assert_refused(rig.lot.release("r"), ALREADY_BOUND)
    sent, end = rig.drain(binding)
    assert sent == [(0, blob("r", 0))]
    assert_delivered(end)
    rig.bound("demand")
    assert_refused(rig.lot.release("demand"), ALREADY_BOUND)
    assert rig.stats().released_total == 0


def test_release_of_an_unknown_id_is_refused_unknown_id(rig: Rig) -> None:
    assert_refused(rig.lot.release("who"), UNKNOWN_ID)


def test_release_of_a_reaped_id_answers_reaped(rig: Rig) -> None:
    rig.parked("r", [0])
    rig.advance(60)
    rig.reap()
    assert_refused(rig.lot.release("r"), REAPED)
    assert_refused(rig.lot.release("r", 7), REAPED)


def test_release_forgets_a_keepalive_intent(rig: Rig) -> None:
    rig.lot.keep_alive(["r"], 100)
    assert_refused(rig.lot.release("r"), UNKNOWN_ID)
    assert rig.stats().intents == 0
    assert rig.state("r").lease_remaining_s == 0.0


# === Lookup, next_deadline and statistics =======================================================


def test_lookup_and_statistics_report_every_state(rig: Rig) -> None:
    rig.parked("p", {0: b"x" * 100, 1: b"y" * 50}, total=3)
    rig.parked("b", [0], total=2)
    rig.parked("t", [0])
    rig.parked("d", [0], total=1)
    rig.advance(10)
    rig.bound("b")
    rig.bound("demand")
    assert rig.lot.release("t") is None
    rig.deliver("d")
    batch = rig.begin("o", batch_bytes=8 * PAGE)
    rig.chunk(batch, 0, blob("o", 0))
    rig.advance(2.5)
    p, b, demand, d, t, o, u = rig.lot.lookup(["p", "b", "demand", "d", "t", "o", "u"])
    assert p == IdStatus("p", pb.STATE_PARKED, 0, 2, 3, 150, age_s=12.5, lease_remaining_s=47.5)
    assert b == IdStatus("b", pb.STATE_BOUND, 0, 1, 2, SIZE, 12.5, 0.0)
    assert demand == IdStatus("demand", pb.STATE_BOUND, age_s=2.5)
    assert d == IdStatus("d", pb.STATE_DELIVERED, 0, 1, 1, SIZE, 12.5, 27.5)
    assert t == IdStatus("t", pb.STATE_TOMBSTONED, RELEASED, age_s=2.5)
    assert o == IdStatus("o", pb.STATE_UNKNOWN)  # only an open batch: nothing visible
    assert u == IdStatus("u", pb.STATE_UNKNOWN)
    assert rig.stats() == LotStatistics(
        parked_ids=1,
        bound_ids=2,
        delivered_ids=1,
        open_batches=1,
        tombstones=1,
        intents=0,
        parked_bytes=150 + 2 * SIZE,
        pending_bytes=SIZE,
        reaped_total=0,
        consumed_total=0,
        confirmed_total=0,
        delivered_total=1,
        redelivered_total=0,
        evicted_total=0,
        released_total=1,
        late_fetch_rejections_total=0,
        late_park_rejections_total=0,
        parked_bytes_total=150 + 3 * SIZE,
        stalled_fetches_total=0,
        idle_batches_total=0,
        shutting_down=False,
    )


def test_next_deadline_is_the_earliest_live_lease_or_grace(rig: Rig) -> None:
    assert rig.lot.next_deadline() is None
    start = rig.clock.now
    rig.parked("first", [0])
    rig.advance(10)
    rig.parked("second", [0])
    assert rig.lot.next_deadline() == start + 60
    rig.lot.keep_alive(["first"], 100)
    assert rig.lot.next_deadline() == start + 70
    binding = rig.bound("second")
    assert rig.lot.next_deadline() == start + 110
    _, end = rig.drain(binding)
    assert_delivered(end)
    assert rig.lot.next_deadline() == start + 40  # second's delivery grace
    rig.begin("open")  # an open batch has no timer here (the reaper checks batches itself)
    assert rig.lot.next_deadline() == start + 40


# === shutdown ====================================================================================


def test_shutdown_refuses_new_parks_and_fetches(rig: Rig) -> None:
    rig.parked("p", [0], total=1)
    rig.parked("t", [0])
    assert rig.lot.release("t") is None
    rig.parked("d", [0])
    rig.deliver("d")
    rig.lot.begin_shutdown()
    assert rig.stats().shutting_down
    assert_refused(rig.park("new", [0]), SHUTTING_DOWN)
    assert_refused(rig.park("p", [1]), SHUTTING_DOWN)
    assert_refused(rig.bind("p"), SHUTTING_DOWN)
    assert_refused(rig.bind("new"), SHUTTING_DOWN)
    assert_refused(rig.bind("d"), SHUTTING_DOWN)
    assert_refused(rig.bind("t"), RELEASED, late=True)  # a tombstone still answers its reason
    assert rig.state("p").state == pb.STATE_PARKED
    assert rig.state("d").state == pb.STATE_DELIVERED


def test_bound_fetches_are_served_during_shutdown_then_fail_all_ends_the_rest(rig: Rig) -> None:
    """Bound Fetches get what is committed. Chunks no batch can commit any more end their
    id SHUTTING_DOWN: at once for a Fetch already waiting for one, when it reaches one for a
    Fetch still sending; neither holds the drain."""
    rig.parked("served", [0, 1], total=2)
    rig.parked("partial", [0], total=2)
    rig.parked("waiting", [0], total=2)
    rig.parked("idle", [0])
    served, partial, waiting = rig.bound("served"), rig.bound("partial"), rig.bound("waiting")
    sent, step = rig.drain(waiting)
    assert len(sent) == 1 and isinstance(step, FetchWait)
    open_batch = rig.begin("parking")
    rig.lot.begin_shutdown()
    assert rig.woken == [open_batch]
    assert_refused(rig.commit(open_batch), SHUTTING_DOWN)
    assert rig.notified["waiting"] == 1  # woken up to see its id ended
    assert_tombstoned(rig, "waiting", SHUTTING_DOWN)
    end = rig.next(waiting)
    assert isinstance(end, FetchEnd) and end.refusal is not None
    assert (end.refusal.reason, end.chunks_sent) == (SHUTTING_DOWN, 1)
    sent, end = rig.drain(served)
    assert [cid for cid, _ in sent] == [0, 1]
    assert_delivered(end)
    sent, end = rig.drain(partial)
    assert [cid for cid, _ in sent] == [0]  # what was committed, then the end
    assert isinstance(end, FetchEnd) and end.refusal is not None
    assert (end.refusal.reason, end.chunks_sent) == (SHUTTING_DOWN, 1)
    assert_tombstoned(rig, "partial", SHUTTING_DOWN)
    assert rig.lot.bound_count == 0  # nothing left for the drain to wait for

    assert rig.lot.fail_all() == 2  # served (delivered), idle
    for kid in ("served", "partial", "waiting", "idle"):
        assert_tombstoned(rig, kid, SHUTTING_DOWN)
    assert rig.state("parking") == IdStatus("parking", pb.STATE_UNKNOWN)
    rig.assert_pool_empty()
    assert rig.lot.bound_count == 0
    assert rig.stats().delivered_ids == 0


def test_wait_expiry_after_fail_all_reports_shutting_down(rig: Rig) -> None:
    binding = rig.bound("w", wait_s=1)
    rig.lot.begin_shutdown()
    rig.lot.fail_all()
    rig.advance(1)  # the Fetch's wait timer and the shutdown race; the shutdown is the cause
    end = rig.lot.fetch_wait_expired(binding)
    assert end.refusal is not None and end.refusal.reason == SHUTTING_DOWN


# === random operations against a model ===========================================================

IDS = ("a", "b", "c")
SIZES = (1, PAGE + 6, 2 * PAGE, 3 * PAGE - 1)  # by chunk_id: under, on and over page edges
MODEL_POOL_PAGES = 14  # an id's four chunks take 8-10 pages: pressure comes quickly
MODEL_SETTINGS: dict[str, Any] = {
    "unbound_store_timeout_s": 10.0,
    "tombstone_retention_s": 15.0,
    "max_lease_s": 40.0,
    "max_fetch_wait_s": 5.0,
    "max_tombstones": 2,  # fewer than IDS: the caps on tombstones and intents come into play
    "park_idle_timeout_s": 8.0,
    "delivery_grace_s": 12.0,
    # All four chunks fit, in the whole pages each takes, unless one is a longer variant.
    "max_batch_bytes": sum(-(-n // PAGE) for n in SIZES) * PAGE,
}
TOTALS = (
    "reaped_total",
    "consumed_total",
    "confirmed_total",
    "delivered_total",
    "redelivered_total",
    "evicted_total",
    "released_total",
    "late_fetch_rejections_total",
    "late_park_rejections_total",
    "parked_bytes_total",
    "stalled_fetches_total",
    "idle_batches_total",
)
CRC_MODES = ("good",) * 30 + ("none",) * 4 + ("bad", "zero")


def chunk_data(kid: str, chunk_id: int, variant: int) -> bytes:
    """Variant 1 is other bytes (one longer) under the same id and chunk_id."""
    return blob(kid, chunk_id, SIZES[chunk_id] + variant, variant)


def pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


def sometimes(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in `one_in` draws (Hypothesis favours the first element)."""
    return st.sampled_from([False] * (one_in - 1) + [True])


def lot_chunks(lot: Lot, kid: str) -> dict[int, bytes]:
    """The committed chunks the lot holds for `kid`, read from the pool (white-box)."""
    entry = lot._entries.get(kid)
    stored = {} if entry is None else entry.chunks
    return {cid: b"".join(map(bytes, lot.pool.views(s.handle))) for cid, s in stored.items()}


def batch_chunks(lot: Lot, batch: ParkBatch) -> dict[int, bytes]:
    """The chunks an open batch holds, invisible until its commit (white-box)."""
    return {cid: b"".join(map(bytes, lot.pool.views(s.handle))) for cid, s in batch.pending.items()}


@dataclass(eq=False)
class MFetch:
    """The model of one Fetch: what it asked for, how far it got, and how it ended."""

    kid: str
    entry: MEntry
    requested: list[int] | None
    wait_s: float
    wait_deadline: float
    redelivery: bool
    binding: Any = None  # the lot's FetchBinding, once bound
    cursor: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    failed: int | None = None  # the reason its id ended with, while it was attached
    notified: int = 0  # calls of its notify
    must_notify: bool = False  # something it waits for changed since the last check

    def __repr__(self) -> str:  # what Hypothesis prints for a drawn Fetch
        return f"<Fetch of {self.kid!r} for {self.requested}, {self.chunks_sent} sent>"


@dataclass(eq=False)
class MEntry:
    """The model of one life of an id: created by a header or a Fetch, gone when it ends (a
    tombstone) or is forgotten (nothing committed and nothing attached)."""

    kid: str
    created_at: float
    chunks: dict[int, bytes] = field(default_factory=dict)  # committed: what Fetch sees
    total: int = 0
    committed_at: float | None = None
    deadline: float | None = None  # the lease while PARKED, the grace while DELIVERED
    seq: int = 0  # when the timer was last armed: equal deadlines are reaped in this order
    intent: float = 0.0  # KeepAlive before the first commit
    delivery_id: int = 0
    fetch: MFetch | None = None


@dataclass(eq=False)
class MBatch:
    """The model of one Park batch: what it sent, what it holds, and how it ended."""

    entry: MEntry
    batch: ParkBatch
    reserved_pages: int  # reserved and not used by a chunk yet
    has_reservation: bool
    last_activity: float
    opened_at: float
    pending: dict[int, bytes] = field(default_factory=dict)
    sent_chunks: int = 0
    sent_bytes: int = 0
    held_pages: int = 0
    failed: int | None = None  # the reason it was undone with
    committed: bool = False
    wakes: int = 0  # calls of its wake
    expected_wakes: int = 0  # undone from outside its own call

    @property
    def open(self) -> bool:
        return self.failed is None and not self.committed

    def __repr__(self) -> str:  # what Hypothesis prints for a drawn batch
        state = "open" if self.open else "committed" if self.committed else "failed"
        return f"<{state} batch of {self.entry.kid!r} holding {sorted(self.pending)}>"


class LotMachine(RuleBasedStateMachine):
    """Random Parks (whole or step by step, two batches of an id open at once, commits that
    name the wrong counts, bad and missing CRCs, conflicting bytes), Fetches (subsets, whole
    ids, demands before any Park, redeliveries, stepped, cancelled, stalled, timed out),
    confirmations with right and wrong delivery ids, releases, KeepAlives (also as a
    generator), the clock with and without a reaper pass, pool pressure and shutdown.

    A model of the contract predicts every answer (state, refusal reason, ParkDone, each chunk
    a Fetch is given, FetchWait deadlines, delivery ids being fresh) and, after every step, the
    lot must agree with it on: check_invariants(); every id's Lookup (state, tombstone reason,
    chunks, total, bytes, age, lease or grace remaining); the bytes of every committed chunk and
    of every open batch's chunks; statistics() field by field; next_deadline(); the pool's
    stored, used and reserved pages; which batches were woken; and that every Fetch whose id
    changed under it was notified."""

    # --- set-up and model helpers -----------------------------------------------------------
    @initialize()
    def start(self) -> None:
        self.rig = Rig(pool_pages=MODEL_POOL_PAGES, **MODEL_SETTINGS)
        self.lot = self.rig.lot
        self.s = self.rig.settings
        self.entries: dict[str, MEntry] = {}  # live ids, in creation order (as the lot's)
        self.batches: list[MBatch] = []  # open batches, in opening order, and failed ones
        self.fetches: list[MFetch] = []  # bound Fetches, and failed ones not told yet
        self.tombs: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.intents: OrderedDict[str, float] = OrderedDict()
        # Ids with a delivery, oldest delivery first: the eviction order. A repeat Fetch
        # leaves its id in place; eviction passes over it while it is bound.
        self.delivered: OrderedDict[str, None] = OrderedDict()
        self.delivery_ids: set[int] = set()
        self.totals = dict.fromkeys(TOTALS, 0)
        self.shutting_down = False
        self.seq = itertools.count()
        self.steps = 0

    @property
    def now(self) -> float:
        return self.rig.clock.now

    def open_batches(self, entry: MEntry | None = None) -> list[MBatch]:
        return [b for b in self.batches if b.open and (entry is None or b.entry is entry)]

    def free_pages(self) -> int:
        used = sum(pages(len(d)) for e in self.entries.values() for d in e.chunks.values())
        for b in self.open_batches():
            used += b.reserved_pages + sum(pages(len(d)) for d in b.pending.values())
        return MODEL_POOL_PAGES - used

    def delivered_ids(self) -> list[str]:
        """DELIVERED ids (not bound again), oldest delivery first."""
        return [kid for kid in self.delivered if self.entries[kid].fetch is None]

    def make_room(self, free_pages_needed: int) -> bool:
        """Evicts DELIVERED ids, oldest delivery first, until the pages their chunks held and
        the free ones cover the need; evicts none and returns False if all of them would not."""
        short = free_pages_needed - self.free_pages()
        held = {
            kid: sum(pages(len(d)) for d in self.entries[kid].chunks.values())
            for kid in self.delivered_ids()
        }
        if short > sum(held.values()):
            return False
        for kid, kid_pages in held.items():
            if short <= 0:
                break
            self.end(self.entries[kid], EVICTED)
            self.totals["evicted_total"] += 1
            short -= kid_pages
        return True

    def next_deadline(self) -> float | None:
        unbound = [e for e in self.entries.values() if e.fetch is None]
        return min((e.deadline for e in unbound if e.deadline is not None), default=None)

    def retry_after(self) -> float:
        nxt = self.next_deadline()
        if nxt is None:
            return max(self.s.reap_interval_s, 1.0)
        return max(self.s.reap_interval_s, min(nxt - self.now, self.s.park_idle_timeout_s))

    def arm(self, entry: MEntry) -> None:
        entry.seq = next(self.seq)

    def notify(self, entry: MEntry) -> None:
        if entry.fetch is not None:
            entry.fetch.must_notify = True

    def total_conflict(self, entry: MEntry, total: int) -> bool:
        fetch = entry.fetch
        return bool(
            (entry.total and entry.total != total)
            or any(cid >= total for cid in entry.chunks)
            or (fetch is not None and fetch.requested and max(fetch.requested) >= total)
        )

    def fail(self, mb: MBatch, reason: int, outside: bool = False) -> None:
        mb.failed = reason
        mb.pending.clear()
        mb.reserved_pages = 0
        mb.expected_wakes += outside
        self.drop_if_idle(mb.entry)

    def end(self, entry: MEntry, reason: int) -> None:
        """The id ends: its batches and its Fetch fail with `reason`; it is tombstoned."""
        for mb in self.open_batches(entry):
            self.fail(mb, reason, outside=True)
        if entry.fetch is not None:
            entry.fetch.failed = reason
            entry.fetch.must_notify = True
            entry.fetch = None
        if self.entries.get(entry.kid) is entry:
            del self.entries[entry.kid]
        self.delivered.pop(entry.kid, None)
        self.intents.pop(entry.kid, None)
        self.tombs.pop(entry.kid, None)
        self.tombs[entry.kid] = (reason, self.now)
        while len(self.tombs) > self.s.max_tombstones:
            self.tombs.popitem(last=False)

    def drop_if_idle(self, entry: MEntry) -> None:
        """An id holding nothing committed and with nothing attached is forgotten; a KeepAlive
        it held goes back to the intent table."""
        if entry.chunks or entry.fetch or self.open_batches(entry):
            return
        if self.entries.get(entry.kid) is not entry:
            return
        del self.entries[entry.kid]
        self.delivered.pop(entry.kid, None)
        if entry.intent > max(self.now, self.intents.get(entry.kid, 0.0)):
            self.intents[entry.kid] = entry.intent
            self.cap_intents()

    def cap_intents(self) -> None:
        while len(self.intents) > self.s.max_tombstones:
            self.intents.popitem(last=False)

    def status(self, kid: str) -> IdStatus:
        now = self.now
        entry = self.entries.get(kid)
        if entry is not None and (entry.committed_at is not None or entry.fetch is not None):
            if entry.fetch is not None:
                state = pb.STATE_BOUND
            elif entry.delivery_id:
                state = pb.STATE_DELIVERED
            else:
                state = pb.STATE_PARKED
            since = entry.created_at if entry.committed_at is None else entry.committed_at
            remaining = 0.0
            if entry.fetch is None and entry.deadline is not None:
                remaining = max(0.0, entry.deadline - now)
            nbytes = sum(map(len, entry.chunks.values()))
            return IdStatus(
                kid, state, 0, len(entry.chunks), entry.total, nbytes, now - since, remaining
            )
        if kid in self.tombs:
            reason, at = self.tombs[kid]
            return IdStatus(kid, pb.STATE_TOMBSTONED, reason, age_s=now - at)
        intent = max(self.intents.get(kid, 0.0), entry.intent if entry else 0.0)
        return IdStatus(kid, pb.STATE_UNKNOWN, lease_remaining_s=max(0.0, intent - now))

    def woke(self, mb: MBatch) -> None:
        mb.wakes += 1

    def notified(self, mf: MFetch) -> None:
        mf.notified += 1

    # --- Park ---------------------------------------------------------------------------------
    def do_begin(self, kid: str, total: int, batch_bytes: int) -> MBatch | None:
        entry = self.entries.get(kid)
        # Chunks the id holds need no pages again: only what exceeds them is set aside.
        reserve = batch_bytes - (sum(map(len, entry.chunks.values())) if entry else 0)
        expected, late = None, False
        if self.shutting_down:
            expected = SHUTTING_DOWN
        elif kid in self.tombs:
            expected, late = self.tombs[kid][0], True
        elif entry is not None and entry.delivery_id:
            expected = ALREADY_CONSUMED
        elif batch_bytes > self.s.max_batch_bytes:
            expected = TOO_LARGE
        elif entry is not None and total and self.total_conflict(entry, total):
            expected = CHUNK_CONFLICT
        elif reserve > 0 and not self.make_room(pages(reserve)):
            expected = POOL_FULL
        opened = self.lot.begin_park(kid, total, batch_bytes)
        if expected is not None:
            refusal = assert_refused(opened, expected, late=late)
            if expected == POOL_FULL:
                assert refusal.retry_after_s == self.retry_after()
            self.totals["late_park_rejections_total"] += late
            return None
        assert isinstance(opened, ParkBatch), opened
        if entry is None:
            entry = self.entries[kid] = MEntry(kid, self.now)
        if total and entry.total != total:
            entry.total = total
            self.notify(entry)
        mb = MBatch(entry, opened, pages(max(0, reserve)), reserve > 0, self.now, self.now)
        opened.wake = functools.partial(self.woke, mb)
        self.batches.append(mb)
        return mb

    def do_send(self, mb: MBatch, cid: int, variant: int, crc_mode: str) -> bool:
        """One Chunk message; True if the batch is still open after it."""
        data = chunk_data(mb.entry.kid, cid, variant)
        crc = {"good": crc32c_of(data), "none": None, "bad": crc32c_of(data) ^ 1, "zero": 0}
        call = functools.partial(self.lot.park_chunk, mb.batch, cid, memoryview(data))
        if mb.failed is not None:
            assert_refused(call(crc[crc_mode]), mb.failed)
            return False
        entry = mb.entry
        mb.sent_chunks += 1
        mb.sent_bytes += len(data)
        mb.last_activity = self.now
        same = mb.pending[cid] if cid in mb.pending else entry.chunks.get(cid)
        expected, retry_after, malformed = None, 0.0, False
        if entry.delivery_id:
            expected = ALREADY_CONSUMED
        elif entry.total and cid >= entry.total:
            malformed = True
        elif crc[crc_mode] not in (None, crc32c_of(data)):
            expected = CHECKSUM_MISMATCH
        elif same is not None:
            expected = None if same == data else CHUNK_CONFLICT
        elif mb.held_pages + pages(len(data)) > pages(self.s.max_batch_bytes):
            expected = TOO_LARGE
        elif not self.make_room(pages(len(data)) - mb.reserved_pages):
            expected, retry_after = POOL_FULL, self.retry_after()
        if malformed:
            with pytest.raises(MalformedRequest, match="out of range"):
                call(crc[crc_mode])
            self.fail(mb, UNSPECIFIED)
            return False
        refused = call(crc[crc_mode])
        if expected is not None:
            assert assert_refused(refused, expected).retry_after_s == retry_after
            self.fail(mb, expected)
            return False
        assert refused is None, refused
        if same is None:
            mb.pending[cid] = data
            mb.held_pages += pages(len(data))
            mb.reserved_pages = max(0, mb.reserved_pages - pages(len(data)))
        return True

    def do_commit(self, mb: MBatch, extra: tuple[int, int] = (0, 0)) -> None:
        entry = mb.entry
        counts = (mb.sent_chunks + extra[0], mb.sent_bytes + extra[1])
        if mb.failed is not None:
            assert_refused(self.lot.commit_park(mb.batch, *counts), mb.failed)
            return
        expected = None
        if extra != (0, 0):
            expected = COMMIT_MISMATCH
        elif entry.delivery_id:
            expected = ALREADY_CONSUMED
        elif any(entry.chunks.get(cid, data) != data for cid, data in mb.pending.items()):
            expected = CHUNK_CONFLICT
        elif entry.total and any(cid >= entry.total for cid in mb.pending):
            expected = CHUNK_CONFLICT  # a total fixed after these chunks arrived excludes them
        elif not entry.total and mb.pending:
            total = max([*mb.pending, *entry.chunks]) + 1
            if self.total_conflict(entry, total):
                expected = CHUNK_CONFLICT
        done = self.lot.commit_park(mb.batch, *counts)
        if expected is not None:
            assert_refused(done, expected)
            self.fail(mb, expected)
            return
        for cid, data in mb.pending.items():
            if cid not in entry.chunks:
                entry.chunks[cid] = data
                self.totals["parked_bytes_total"] += len(data)
        mb.pending.clear()
        mb.reserved_pages = 0
        mb.committed = True
        self.batches.remove(mb)
        if not entry.total and entry.chunks:
            entry.total = max(entry.chunks) + 1
        if entry.committed_at is None and entry.chunks:  # the lease starts
            entry.committed_at = self.now
            entry.intent = max(entry.intent, self.intents.pop(entry.kid, 0.0))
            s = self.s
            entry.deadline = min(
                max(self.now + s.unbound_store_timeout_s, entry.intent), self.now + s.max_lease_s
            )
            if entry.fetch is None:
                self.arm(entry)
        self.notify(entry)
        lease = 0.0 if entry.committed_at is None else self.status(entry.kid).lease_remaining_s
        nbytes = sum(map(len, entry.chunks.values()))
        self.drop_if_idle(entry)
        total = entry.total if self.entries.get(entry.kid) is entry else 0  # forgotten: none
        assert done == ParkDone(len(entry.chunks), nbytes, total, lease), done

    def do_end_stream(self, mb: MBatch) -> None:
        refused = self.lot.end_park_stream(mb.batch)
        assert_refused(refused, NOT_COMMITTED if mb.failed is None else mb.failed)
        if mb.failed is None:
            self.fail(mb, NOT_COMMITTED)

    def do_abort(self, mb: MBatch) -> None:
        self.lot.abort_park(mb.batch)
        if mb.failed is None:
            self.fail(mb, UNSPECIFIED)

    def drop_batch(self, mb: MBatch) -> None:
        if mb in self.batches:
            self.batches.remove(mb)
        assert mb.wakes == mb.expected_wakes, "a batch ended from outside was not woken"

    # --- Fetch --------------------------------------------------------------------------------
    def do_fetch(self, kid: str, chunk_ids: list[int], epoch: int, wait_s: float) -> None:
        entry = self.entries.get(kid)
        expected, late, malformed = None, False, False
        if epoch not in (0, EPOCH):
            expected = EPOCH_MISMATCH
        elif kid in self.tombs:
            expected, late = self.tombs[kid][0], True
        elif self.shutting_down:
            expected = SHUTTING_DOWN
        elif entry is not None and entry.fetch is not None:
            expected = ALREADY_BOUND
        elif entry is not None and chunk_ids and entry.total:
            malformed = max(chunk_ids) >= entry.total
        wait = min(self.s.max_fetch_wait_s, wait_s) if wait_s > 0 else self.s.max_fetch_wait_s
        redelivery = entry is not None and bool(entry.delivery_id)
        mf = MFetch(kid, entry or MEntry(kid, self.now), chunk_ids or None, wait, 0.0, redelivery)
        call = functools.partial(
            self.lot.bind_fetch, kid, chunk_ids, epoch, wait_s, functools.partial(self.notified, mf)
        )
        if malformed:
            with pytest.raises(MalformedRequest):
                call()
            return
        bound = call()
        if expected is not None:
            assert_refused(bound, expected, late=late)
            self.totals["late_fetch_rejections_total"] += late
            return
        assert isinstance(bound, FetchBinding), bound
        if entry is None:
            self.entries[kid] = mf.entry
        ttf = None if mf.entry.committed_at is None else self.now - mf.entry.committed_at
        assert (bound.time_to_fetch_s, bound.redelivery) == (ttf, redelivery)
        assert bound.wait_deadline == self.now + wait
        mf.binding, mf.wait_deadline, mf.entry.fetch = bound, self.now + wait, mf
        self.fetches.append(mf)

    def next_chunk(self, mf: MFetch) -> int | None:
        """The chunk the Fetch sends next; None when everything it asked for was sent."""
        if mf.requested is not None:
            return mf.requested[mf.cursor] if mf.cursor < len(mf.requested) else None
        total = mf.entry.total
        return mf.cursor if not total or mf.cursor < total else None

    def waits_for_a_chunk(self, mf: MFetch) -> bool:
        next_id = self.next_chunk(mf)
        return next_id is not None and next_id not in mf.entry.chunks

    def do_step(self, mf: MFetch, steps: int) -> None:
        for _ in range(steps):
            step = self.lot.next_for(mf.binding)
            if mf.failed is not None:
                assert isinstance(step, FetchEnd) and step.refusal is not None, step
                assert step.refusal.reason == mf.failed
                assert (step.chunks_sent, step.bytes_sent) == (mf.chunks_sent, mf.bytes_sent)
                self.fetches.remove(mf)
                return
            entry, next_id = mf.entry, self.next_chunk(mf)
            if next_id is None:
                self.delivered_by(mf, step)
                return
            if next_id not in entry.chunks and self.shutting_down:
                # No batch can commit it any more: the id ends, and the Fetch with it.
                self.end(entry, SHUTTING_DOWN)
                assert isinstance(step, FetchEnd) and step.refusal is not None, step
                assert step.refusal.reason == SHUTTING_DOWN
                assert (step.chunks_sent, step.bytes_sent) == (mf.chunks_sent, mf.bytes_sent)
                mf.must_notify = False  # it ended in its own call: nobody to wake
                self.fetches.remove(mf)
                return
            if next_id not in entry.chunks:
                assert step == FetchWait(mf.wait_deadline), step
                return
            assert isinstance(step, ReadyChunk) and step.chunk_id == next_id, step
            data = b"".join(map(bytes, step.views))  # before any other lot call
            assert data == entry.chunks[next_id], "served bytes not committed there"
            assert (step.crc32c, step.nbytes) == (crc32c_of(data), len(data))
            mf.cursor += 1
            mf.chunks_sent += 1
            mf.bytes_sent += len(data)
            mf.wait_deadline = self.now + mf.wait_s  # the wait bounds a stall

    def delivered_by(self, mf: MFetch, step: object) -> None:
        end = assert_delivered(step)
        assert (end.chunks_sent, end.bytes_sent) == (mf.chunks_sent, mf.bytes_sent)
        assert end.delivery_id not in self.delivery_ids, "a delivery id was reused"
        self.delivery_ids.add(end.delivery_id)
        entry = mf.entry
        entry.fetch = None
        entry.delivery_id = end.delivery_id
        entry.deadline = self.now + self.s.delivery_grace_s
        self.arm(entry)
        self.delivered.pop(entry.kid, None)
        self.delivered[entry.kid] = None  # a completed repeat is the newest delivery
        self.totals["delivered_total"] += 1
        self.totals["redelivered_total"] += mf.redelivery
        self.fetches.remove(mf)

    def detach(self, mf: MFetch, fresh: bool) -> None:
        """A cancelled, stalled or timed-out Fetch: the id goes back where it was."""
        entry = mf.entry
        entry.fetch = None
        if fresh and entry.deadline is not None:
            s = self.s
            span = s.delivery_grace_s if entry.delivery_id else s.unbound_store_timeout_s
            fresh_deadline = self.now + span
            if not entry.delivery_id and entry.committed_at is not None:
                fresh_deadline = min(fresh_deadline, entry.committed_at + s.max_lease_s)
            entry.deadline = max(entry.deadline, fresh_deadline)
        if entry.deadline is not None:
            self.arm(entry)
        self.drop_if_idle(entry)

    def serve_notified(self) -> None:
        """As in the servicer: a notified Fetch wakes up and sends what it can."""
        for mf in [mf for mf in self.fetches if mf.notified]:
            if mf in self.fetches:
                self.do_step(mf, 8)

    def expire_waits(self) -> None:
        """As in the servicer: the wait timer of a Fetch told to wait fires at its deadline."""
        for mf in [mf for mf in self.fetches if mf.failed is None and self.can_expire(mf)]:
            self.do_wait_expired(mf)

    def do_wait_expired(self, mf: MFetch) -> None:
        end = self.lot.fetch_wait_expired(mf.binding)
        assert end.refusal is not None
        assert end.refusal.reason == (WAIT_TIMEOUT if mf.failed is None else mf.failed)
        assert (end.chunks_sent, end.bytes_sent) == (mf.chunks_sent, mf.bytes_sent)
        if mf.failed is None:
            self.detach(mf, fresh=False)
        self.fetches.remove(mf)

    def can_expire(self, mf: MFetch) -> bool:
        """What the servicer does: a wait expires for a Fetch told to wait, at its deadline
        (a Fetch whose id ended may see either its wake-up or its timer first)."""
        if mf.failed is not None:
            return True
        next_id = self.next_chunk(mf)
        waiting = next_id is not None and next_id not in mf.entry.chunks
        return waiting and self.now >= mf.wait_deadline

    # --- rules: Park ----------------------------------------------------------------------------
    # Parks and Fetches draw their arguments inside: Hypothesis favours rules with fewer
    # arguments, and these are the ones the machine should run most.
    @rule(data=st.data())
    def park(self, data: st.DataObject) -> None:
        """One whole Park call, ended by a commit (mostly), the end of its stream or a cancel."""
        kid = data.draw(st.sampled_from(IDS))
        order = data.draw(st.permutations(range(4)))
        count = data.draw(st.sampled_from([2, 1, 3, 4]))
        total = data.draw(st.sampled_from([4, 0]))
        batch_bytes = data.draw(st.sampled_from([0, 0, 0, 3 * PAGE, 6 * PAGE, 7 * PAGE]))
        chunk_ids = [*order[:count], *order[: data.draw(st.sampled_from([0] * 5 + [1]))]]
        mb = self.do_begin(kid, total, batch_bytes)
        if mb is None:
            return
        for cid in chunk_ids:  # the last one may repeat the first: every message counts
            variant = data.draw(st.sampled_from([0] * 7 + [1]))
            if not self.do_send(mb, cid, variant, data.draw(st.sampled_from(CRC_MODES))):
                break
        ending = data.draw(
            st.sampled_from(["commit"] * 6 + ["wrong counts", "end", "abort", "leave open"])
        )
        if ending == "leave open":  # for a later end_batch, or the reaper
            return
        if ending == "commit":
            self.do_commit(mb)
        elif ending == "wrong counts":
            self.do_commit(mb, data.draw(st.sampled_from([(1, 0), (0, -1), (-1, 0)])))
        elif ending == "end":
            self.do_end_stream(mb)
        else:
            self.do_abort(mb)
        self.drop_batch(mb)
        self.serve_notified()

    @rule(data=st.data())
    def racing_parks(self, data: st.DataObject) -> None:
        """Two Parks of one id at once (a hedge, or a retry while the first is open): they
        share a chunk, with the same or other bytes, and commit in either order, sometimes
        with a Fetch delivering the id in between."""
        kid = data.draw(st.sampled_from(IDS))
        total = data.draw(st.sampled_from([4, 0]))
        shared, own = data.draw(st.permutations(range(4)))[:2]
        variants = data.draw(st.sampled_from([(0, 0), (0, 0), (0, 1), (1, 0)]))
        first = self.do_begin(kid, total, 0)
        second = self.do_begin(kid, total, 0)
        if first is None or second is None:
            return
        self.do_send(first, shared, variants[0], "good")
        self.do_send(second, own, 0, "good")
        self.do_send(second, shared, variants[1], "good")
        deliver_between = data.draw(sometimes(3))
        for mb in (second, first) if data.draw(st.booleans()) else (first, second):
            self.do_commit(mb)
            self.drop_batch(mb)
            if deliver_between and kid in self.entries and self.entries[kid].chunks:
                # A consumer takes what is committed before the other commit arrives.
                self.do_fetch(kid, list(self.entries[kid].chunks), 0, 1.0)
                if self.entries[kid].fetch is not None:
                    self.do_step(self.entries[kid].fetch, 8)
                deliver_between = False
        self.serve_notified()

    @precondition(lambda self: len(self.open_batches()) < 3)
    @rule(
        kid=st.sampled_from(IDS),
        total=st.sampled_from([0, 4]),
        reserve=st.booleans(),
        act=sometimes(2),
    )
    def open_batch(self, kid: str, total: int, reserve: bool, act: bool) -> None:
        """A batch left open across other steps (a slow or concurrent Park)."""
        if act:
            self.do_begin(kid, total, 4 * PAGE if reserve else 0)

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), cid=st.integers(0, 3), variant=st.sampled_from([0, 0, 1]))
    def send_chunk(self, data: st.DataObject, cid: int, variant: int) -> None:
        mb = data.draw(st.sampled_from(self.batches))
        self.do_send(mb, cid, variant, data.draw(st.sampled_from(CRC_MODES)))

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), ending=st.sampled_from(["commit", "commit", "end", "abort"]))
    def end_batch(self, data: st.DataObject, ending: str) -> None:
        mb = data.draw(st.sampled_from(self.batches))
        if ending == "commit":
            self.do_commit(mb)
        elif ending == "end":
            self.do_end_stream(mb)
        else:
            self.do_abort(mb)
        self.drop_batch(mb)
        self.serve_notified()

    # --- rules: Fetch -------------------------------------------------------------------------
    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        # Mostly an id with committed chunks and no Fetch yet: those deliver.
        ready = [k for k, e in self.entries.items() if e.chunks and e.fetch is None]
        kid = data.draw(st.sampled_from(ready * 2 + list(IDS)))
        committed = list(self.entries[kid].chunks) if kid in self.entries else []
        chunk_ids = data.draw(
            # No repeats: the servicer refuses those before binding.
            st.sampled_from(["committed", "committed", "whole", "any"]).flatmap(
                lambda kind: {
                    "committed": st.lists(st.sampled_from(committed or [0]), unique=True),
                    "whole": st.just([]),
                    "any": st.lists(st.integers(0, 3), unique=True, min_size=1, max_size=4),
                }[kind]
            )
        )
        epoch = data.draw(st.sampled_from([0, 0, 0, EPOCH, EPOCH + 1]))
        wait_s = data.draw(st.sampled_from([10.0, 1.0, 0.0]))
        self.do_fetch(kid, chunk_ids, epoch, wait_s)
        current = self.entries.get(kid)
        if current is not None and current.fetch is not None:
            self.do_step(current.fetch, data.draw(st.sampled_from([8, 8, 8, 1])))

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), steps=st.sampled_from([8, 1]))
    def step(self, data: st.DataObject, steps: int) -> None:
        self.do_step(data.draw(st.sampled_from(self.fetches)), steps)

    @precondition(lambda self: any(self.can_expire(mf) for mf in self.fetches))
    @rule(data=st.data())
    def wait_expires(self, data: st.DataObject) -> None:
        expirable = [mf for mf in self.fetches if self.can_expire(mf)]
        self.do_wait_expired(data.draw(st.sampled_from(expirable)))

    @precondition(lambda self: self.fetches)
    @rule(data=st.data(), stall=st.booleans(), act=sometimes(2))
    def consumer_leaves(self, data: st.DataObject, stall: bool, act: bool) -> None:
        if not act:  # consumers mostly stay: let chunks arrive
            return
        mf = data.draw(st.sampled_from(self.fetches))
        if stall:
            self.lot.stall_fetch(mf.binding)
        else:
            self.lot.cancel_fetch(mf.binding)
        if mf.failed is None:
            self.totals["stalled_fetches_total"] += stall
            self.detach(mf, fresh=stall)
        self.fetches.remove(mf)

    # --- rules: the rest ------------------------------------------------------------------------
    def do_release(self, kid: str, delivery_id: int) -> None:
        entry = self.entries.get(kid)
        expected, reason, counters = None, RELEASED, ["released_total"]
        if entry is None or (entry.committed_at is None and entry.fetch is None):
            if delivery_id == 0:
                self.intents.pop(kid, None)
            if kid in self.tombs:
                expected = self.tombs[kid][0]
            elif entry is None or delivery_id:
                expected = UNKNOWN_ID
            # else: an id with only open batches is given up, and they end RELEASED
        elif delivery_id:
            if entry.delivery_id != delivery_id or entry.fetch is not None:
                expected = UNKNOWN_ID
            reason, counters = ALREADY_CONSUMED, ["consumed_total", "confirmed_total"]
        elif entry.fetch is not None:
            expected = ALREADY_BOUND
        refused = self.lot.release(kid, delivery_id)
        if expected is not None:
            assert_refused(refused, expected, late=False)
            return
        assert refused is None, refused
        assert entry is not None
        self.end(entry, reason)
        for counter in counters:
            self.totals[counter] += 1

    @rule(kid=st.sampled_from(IDS), which=st.sampled_from(["give up", "last", "wrong"]))
    def release(self, kid: str, which: str) -> None:
        """Release without a delivery id, or naming the id's last delivery or another one."""
        entry = self.entries.get(kid)
        last = entry.delivery_id if entry is not None else 0
        self.do_release(kid, {"give up": 0, "last": last or 77, "wrong": (last or 76) ^ 1}[which])

    @precondition(lambda self: self.delivered_ids())
    @rule(data=st.data(), act=sometimes(3))
    def confirm(self, data: st.DataObject, act: bool) -> None:
        """The consumer confirms a delivery it received (or not yet: let deliveries pile up)."""
        if not act:
            return
        kid = data.draw(st.sampled_from(self.delivered_ids()))
        self.do_release(kid, self.entries[kid].delivery_id)

    @rule(
        data=st.data(),
        extend_s=st.sampled_from([0.0, 5.0, 30.0, 100.0]),
        as_generator=st.booleans(),
    )
    def keep_alive(self, data: st.DataObject, extend_s: float, as_generator: bool) -> None:
        live = [kid for kid, e in self.entries.items() if e.committed_at is not None]
        kids = data.draw(st.lists(st.sampled_from(live * 2 + list(IDS)), max_size=3))
        s = self.s
        extend = min(extend_s if extend_s > 0 else s.unbound_store_timeout_s, s.max_lease_s)
        wanted = self.now + extend
        for kid in kids:
            entry = self.entries.get(kid)
            if entry is None:
                if kid not in self.tombs and wanted > self.intents.get(kid, 0.0):
                    self.intents[kid] = wanted
                    self.intents.move_to_end(kid)
                    self.cap_intents()
            elif entry.delivery_id:
                continue  # a delivery's grace is not stretched
            elif entry.committed_at is None:
                entry.intent = max(entry.intent, wanted)
            else:
                assert entry.deadline is not None
                new = min(wanted, entry.committed_at + s.max_lease_s)
                if new > entry.deadline:
                    entry.deadline = new
                    if entry.fetch is None:
                        self.arm(entry)
        ids: Iterable[str] = (kid for kid in kids) if as_generator else kids
        assert self.lot.keep_alive(ids, extend_s) == [self.status(kid) for kid in kids]

    @rule(
        seconds=st.sampled_from([0.5, 2.0, 4.0, 6.0, 8.0, 13.0, 31.0]),
        timers=st.booleans(),
        reap=st.booleans(),
    )
    def time_passes(self, seconds: float, timers: bool, reap: bool) -> None:
        self.rig.advance(seconds)
        if timers:  # or not yet: the wait_expires rule fires them one by one
            for mf in list(self.fetches):  # a Fetch sends what it can before it waits
                if mf in self.fetches:
                    self.do_step(mf, 8)
            self.expire_waits()
        if not reap:  # or not yet: a Fetch may bind an expired id before the next pass
            return
        now, s = self.now, self.s
        due = [e for e in self.entries.values() if e.fetch is None and e.deadline is not None]
        due = sorted((e for e in due if e.deadline <= now), key=lambda e: (e.deadline, e.seq))
        expired = [e for e in due if not e.delivery_id]
        unconfirmed = [e for e in due if e.delivery_id]
        assert self.lot.reap() == [e.kid for e in expired]
        for entry in expired:
            self.end(entry, REAPED)
        for entry in unconfirmed:
            self.end(entry, ALREADY_CONSUMED)
        self.totals["reaped_total"] += len(expired)
        self.totals["consumed_total"] += len(unconfirmed)
        idle = [
            b
            for b in self.open_batches()
            if now - b.last_activity >= s.park_idle_timeout_s or now - b.opened_at >= s.max_lease_s
        ]
        for mb in idle:
            self.fail(mb, NOT_COMMITTED, outside=True)
        self.totals["idle_batches_total"] += len(idle)
        while self.tombs and next(iter(self.tombs.values()))[1] <= now - s.tombstone_retention_s:
            self.tombs.popitem(last=False)
        for kid, deadline in list(self.intents.items()):
            if deadline <= now:
                del self.intents[kid]

    # After a shutdown every Park and Fetch is refused: it comes late in a run, if at all.
    @precondition(lambda self: not self.shutting_down and self.steps >= 30)
    @rule(act=sometimes(8), fail_all=st.booleans())
    def shutdown(self, act: bool, fail_all: bool) -> None:
        if not act:
            return
        self.lot.begin_shutdown()
        self.shutting_down = True
        for mb in self.open_batches():
            self.fail(mb, SHUTTING_DOWN, outside=True)
        # A Fetch waiting for a chunk no batch can commit any more ends its id at once.
        for entry in list(self.entries.values()):
            if entry.fetch is not None and self.waits_for_a_chunk(entry.fetch):
                self.end(entry, SHUTTING_DOWN)
        if fail_all:
            entries = list(self.entries.values())
            assert self.lot.fail_all() == len(entries)
            for entry in entries:
                self.end(entry, SHUTTING_DOWN)

    # --- after every step -----------------------------------------------------------------------
    @invariant()
    def lot_and_model_agree(self) -> None:
        if not hasattr(self, "lot"):
            return
        self.steps += 1
        raw = self.rig.raw
        raw.check_invariants()
        for kid in IDS:
            assert self.rig.state(kid) == self.status(kid), kid
            held = self.entries[kid].chunks if kid in self.entries else {}
            assert lot_chunks(raw, kid) == held, f"{kid}: the committed bytes differ"
        for mb in self.open_batches():
            assert batch_chunks(raw, mb.batch) == mb.pending, "a batch holds other bytes"
        for mb in self.batches:
            assert mb.wakes == mb.expected_wakes, "a batch ended from outside was not woken"
        for mf in self.fetches:
            assert mf.notified or not mf.must_notify, "a Fetch was not told its id changed"
            mf.notified, mf.must_notify = 0, False
        committed = sum(len(d) for e in self.entries.values() for d in e.chunks.values())
        pending = sum(len(d) for b in self.open_batches() for d in b.pending.values())
        assert raw.statistics() == LotStatistics(
            parked_ids=sum(
                1
                for e in self.entries.values()
                if e.committed_at is not None and e.fetch is None and not e.delivery_id
            ),
            bound_ids=sum(1 for e in self.entries.values() if e.fetch is not None),
            delivered_ids=len(self.delivered_ids()),
            open_batches=len(self.open_batches()),
            tombstones=len(self.tombs),
            intents=len(self.intents),
            parked_bytes=committed,
            pending_bytes=pending,
            shutting_down=self.shutting_down,
            **self.totals,
        )
        assert raw.next_deadline() == self.next_deadline()
        pool = self.rig.pool.statistics()
        reserved = sum(b.reserved_pages for b in self.open_batches())
        assert (pool.stored_bytes, pool.reserved_bytes) == (committed + pending, reserved * PAGE)
        assert pool.free_bytes == self.free_pages() * PAGE
        assert pool.reservations_open == sum(b.has_reservation for b in self.open_batches())


LotMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
test_lot_state_machine = LotMachine.TestCase
