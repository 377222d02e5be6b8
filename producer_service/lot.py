"""The parking lot: per-id state machine, leases, deliveries, reaper, tombstones and intents.

Pure logic with an injectable clock and no gRPC: the servicer translates RPCs into calls here
and answers with the decisions returned. Everything runs on one thread (the server's event
loop), so there are no locks; the only outward hooks are three callbacks: a bound Fetch's
`notify` (something it may wait for changed) and `cut_short` (the shutdown grace ended its id:
stop the batch being sent), and an open Park batch's `wake` (the batch was ended from outside
its own call, so its handler should answer now rather than at the client's next message).
docs/protocol.md states the contract this implements.

Life of an id:

    (unknown) --Park batch committed--> PARKED --Fetch--> BOUND --all sent--> DELIVERED
    (unknown) --Fetch--> BOUND (a demand: chunks stream as batches are committed)
    BOUND --cancel / wait timeout--> where it was (PARKED with its old lease, or DELIVERED)
    BOUND --consumer read nothing for fetch_stall_timeout_s--> where it was, with a fresh
        lease (PARKED) or grace (DELIVERED)
    DELIVERED --Release(delivery_id) / delivery_grace_s--> tombstone ALREADY_CONSUMED
    DELIVERED --pool pressure--> tombstone EVICTED;  DELIVERED --Fetch--> BOUND (sent again)
    PARKED --lease runs out--> tombstone REAPED;  PARKED/DELIVERED --Release--> RELEASED
    any --shutdown--> tombstone SHUTTING_DOWN

A Park batch is isolated until its commit: its chunks sit in pool pages it owns (`pending`),
invisible to every Fetch and Lookup, and the commit moves them into the id all at once, or the
batch is undone and its pages go back. Nothing depends on when a stream's end or cancel is
noticed.

The long-lived tables (who adds, who removes, what cleans up leftovers):

- `_entries: id -> _Entry`. Added by a Park header or a Fetch for an id nobody knows; removed
  when the id ends (consumed, reaped, released, evicted, shut down), or when it holds no
  committed chunk and nothing is attached (an undone first batch, a cancelled demand).
- `_timers: LeaseQueue of (deadline, seq, entry)`. One item per deadline ever set on an id:
  its lease while PARKED, its delivery grace while DELIVERED. Stale items (the id bound or
  ended, or a later push for it, see `_Entry.timer_seq`) are skipped when popped and compacted
  when they outnumber live ids, so a reaper pass costs O(expired) and the queue stays O(ids).
- `_delivered: id -> _Entry`, in delivery order. Added when a Fetch sent an id's last chunk;
  removed when the id is confirmed, expires, is evicted (oldest first, under pool pressure) or
  released. A repeat Fetch leaves the id in its place: eviction passes over it while it is
  bound, a cancel leaves it where its delivery put it, and a completed repeat moves it last.
- `_open_batches: ParkBatch -> None`. Added by `begin_park`; removed when the batch commits or
  is undone. The reaper undoes those silent for `park_idle_timeout_s`; shutdown undoes all.
- `_tombstones: id -> _Tombstone`, insertion-ordered = time-ordered. Added when an id ends;
  pruned from the front after `tombstone_retention_s` and past `max_tombstones`, on every
  reaper pass whether or not anything is parked.
- `_intents: id -> deadline` for KeepAlive on ids not committed yet, plus `_intent_heap` for
  expiry. Consumed by the id's first commit; pruned at their deadline and capped at
  `max_tombstones` (oldest first), so KeepAlive cannot grow memory without bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvpark.checksum import crc32c_of
from kvpark.fingerprints import shown as shown_fingerprint
from kvpark.ids import MAX_CHUNKS
from kvpark.pb import kvpark_pb2 as pb

from .leases import LeaseQueue
from .pool import HostPool, Reservation, SlotHandle

Clock = Callable[[], float]
Notify = Callable[[], None]
# A value of the contract's FailureReason enum.
Reason = pb.FailureReason

REAPED = pb.REASON_REAPED
UNKNOWN_ID = pb.REASON_UNKNOWN_ID
ALREADY_CONSUMED = pb.REASON_ALREADY_CONSUMED
RELEASED = pb.REASON_RELEASED
EVICTED = pb.REASON_EVICTED
ALREADY_BOUND = pb.REASON_ALREADY_BOUND
POOL_FULL = pb.REASON_POOL_FULL
TOO_LARGE = pb.REASON_TOO_LARGE
WAIT_TIMEOUT = pb.REASON_WAIT_TIMEOUT
EPOCH_MISMATCH = pb.REASON_EPOCH_MISMATCH
SHUTTING_DOWN = pb.REASON_SHUTTING_DOWN
CHUNK_CONFLICT = pb.REASON_CHUNK_CONFLICT
CHECKSUM_MISMATCH = pb.REASON_CHECKSUM_MISMATCH
NOT_COMMITTED = pb.REASON_NOT_COMMITTED
COMMIT_MISMATCH = pb.REASON_COMMIT_MISMATCH
FINGERPRINT_MISMATCH = pb.REASON_FINGERPRINT_MISMATCH

# Compaction threshold: stale timer items beyond live ids plus this slack trigger a rebuild.
_HEAP_SLACK = 1024


def reason_name(reason: Reason) -> str:
    return str(pb.FailureReason.Name(reason)) if reason else "REASON_UNSPECIFIED"


class MalformedRequest(ValueError):
    """A request that breaks the contract's shape (maps to INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class LotSettings:
    """The lot's share of the producer configuration (seconds, counts and bytes)."""

    unbound_store_timeout_s: float = 60.0
    tombstone_retention_s: float = 60.0
    max_lease_s: float = 600.0
    max_fetch_wait_s: float = 30.0
    max_tombstones: int = 1_000_000
    reap_interval_s: float = 0.25
    park_idle_timeout_s: float = 10.0
    delivery_grace_s: float = 30.0
    # Largest batch one Park may reserve or store; 0 = the whole pool.
    max_batch_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call answered FAILED with a reason, nothing stored or bound."""

    reason: Reason
    detail: str
    retry_after_s: float = 0.0
    # True when the refusal came from a tombstone (a late Park or Fetch).
    late: bool = False


@dataclass(slots=True)
class _Stored:
    handle: SlotHandle
    crc32c: int


@dataclass(frozen=True, slots=True)
class Resent:
    """A chunk an open batch sends by reference that the id already holds (committed, or
    pending in this batch): its bytes are compared with the stored ones (`stored_views`)
    instead of copied, and `end_compare` keeps nothing more."""

    stored: _Stored

    @property
    def nbytes(self) -> int:
        return self.stored.handle.nbytes


@dataclass(eq=False, slots=True)
class _Entry:
    kv_request_id: str
    created_at: float
    # Committed chunks: what Fetch and Lookup see.
    chunks: dict[int, _Stored] = field(default_factory=dict)
    total_chunks: int = 0
    nbytes: int = 0
    # What the KV was computed from (ParkHeader.fingerprint), fixed by the first commit; None
    # until then.
    fingerprint: bytes | None = None
    # First commit: the lease starts here; None while nothing was committed.
    committed_at: float | None = None
    # The id's one timer: its lease while PARKED, its delivery grace while DELIVERED.
    deadline: float | None = None
    # seq of the one `_timers` item that is live for this entry; older items are stale even
    # if their deadline matches (a cancelled Fetch re-arms the same deadline).
    timer_seq: int = -1
    intent_deadline: float = 0.0  # KeepAlive before the first commit
    binding: FetchBinding | None = None
    open_batches: list[ParkBatch] = field(default_factory=list)
    # Non-zero once every requested chunk was sent: names the delivery a consumer confirms.
    delivery_id: int = 0
    # Pool pages the committed chunks hold, counted at the first delivery (no chunk is added
    # after it): what evicting the id would give back.
    pages: int = 0


@dataclass(eq=False, slots=True)
class ParkBatch:
    """One Park call in progress. Its chunks stay in `pending`, invisible, until its commit."""

    entry: _Entry
    reservation: Reservation | None
    last_activity: float
    # When the Park call opened it: however busy, a batch never holds its pages for longer
    # than max_lease_s without a commit (a stream that re-sends the same chunk now and then
    # takes no pages and is never silent, and would otherwise hold its reservation for ever).
    opened_at: float
    fingerprint: bytes = b""
    pending: dict[int, _Stored] = field(default_factory=dict)
    # Every Chunk message counts, repeats included: the commit must name the same counts.
    chunks_received: int = 0
    bytes_received: int = 0
    # Pool pages this batch's chunks hold (bounded by max_batch_pages): whole pages, so that
    # many small chunks cannot hold more of the pool than their bytes suggest.
    held_pages: int = 0
    # Bytes of chunks re-sent by reference that the batch or the id already held: they take
    # no pages, but a comparison each on a data thread, which a few bytes of ChunkRef would
    # otherwise buy without end. Bounded by what one re-send of everything needs: the id's
    # committed bytes plus a batch's worth.
    compared_bytes: int = 0
    # Slots being filled from a lent buffer by a worker thread: the batch owns them, and they
    # are freed only by `end_fill`, never under the thread that writes them.
    filling: set[SlotHandle] = field(default_factory=set)
    # The call waits for its own copies from a lent buffer (`begin_copy_wait`) and reads no
    # message meanwhile: the client cannot be silent then, so the idle clock stands still.
    waiting_for_copies: bool = False
    failed: Refusal | None = None
    done: bool = False
    # Set by the servicer: called when the batch is undone from outside its own call.
    wake: Notify | None = None


@dataclass(eq=False, slots=True)
class FetchBinding:
    """A Fetch attached to an id. `requested` None = all chunks, in order 0..total-1."""

    entry: _Entry
    requested: list[int] | None
    wait_s: float
    # Give up when nothing became available to send by then; moved on by every chunk sent.
    wait_deadline: float
    notify: Notify
    bound_at: float
    # Seconds from the id's first commit to this bind; None for a fetch before any commit.
    time_to_fetch_s: float | None
    # True when the id was DELIVERED before and is being sent again.
    redelivery: bool = False
    # The fingerprint the consumer expects; empty: no check.
    expected_fingerprint: bytes = b""
    cursor: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    failed: Refusal | None = None
    active: bool = True
    # Set by the servicer once the Fetch sends: called when the shutdown grace ends the id.
    cut_short: Notify | None = None

    def remaining(self) -> int | None:
        """Requested chunks not handed out yet; None while "all chunks" has no known total."""
        if self.requested is not None:
            return len(self.requested) - self.cursor
        total = self.entry.total_chunks
        return total - self.cursor if total else None


@dataclass(frozen=True, slots=True)
class ReadyChunk:
    """The next chunk a Fetch may send: views into the pool, valid until the next lot call."""

    chunk_id: int
    crc32c: int
    views: list[memoryview]
    nbytes: int


@dataclass(frozen=True, slots=True)
class FetchWait:
    """Nothing to send yet; wait for `notify` or until `deadline` (clock seconds)."""

    deadline: float


@dataclass(frozen=True, slots=True)
class FetchEnd:
    """The stream is over: `refusal` None means every requested chunk was sent, and
    `delivery_id` names that delivery."""

    refusal: Refusal | None
    chunks_sent: int
    bytes_sent: int
    delivery_id: int = 0


@dataclass(frozen=True, slots=True)
class ParkDone:
    chunks_parked: int
    bytes_parked: int
    total_chunks: int
    lease_remaining_s: float


class IdStatus(NamedTuple):
    """One id's state as Lookup and KeepAlive answer it (a tuple: ~1 µs cheaper per id than a
    frozen dataclass, and a 1000-id Lookup builds a thousand of them on the event loop)."""

    kv_request_id: str
    state: pb.State
    reason: Reason = pb.REASON_UNSPECIFIED
    chunks_parked: int = 0
    total_chunks: int = 0
    nbytes: int = 0
    age_s: float = 0.0
    lease_remaining_s: float = 0.0
    fingerprint: bytes = b""


@dataclass(frozen=True, slots=True)
class _Tombstone:
    """Why and when an id ended. Immutable, so the ids ended together share one."""

    reason: Reason
    at: float


@dataclass(frozen=True, slots=True)
class LotStatistics:
    parked_ids: int
    bound_ids: int
    delivered_ids: int
    open_batches: int
    tombstones: int
    intents: int
    parked_bytes: int  # committed bytes of live ids
    pending_bytes: int  # bytes held by open batches, not visible yet
    reaped_total: int
    consumed_total: int
    confirmed_total: int
    delivered_total: int
    redelivered_total: int
    evicted_total: int
    released_total: int
    late_fetch_rejections_total: int
    late_park_rejections_total: int
    parked_bytes_total: int
    stalled_fetches_total: int
    idle_batches_total: int
    shutting_down: bool


class Lot:
    def __init__(self, pool: HostPool, settings: LotSettings, epoch: int, clock: Clock) -> None:
        self.pool = pool
        self.settings = settings
        self.epoch = epoch
        self.clock = clock
        # Whole pages, at least one: a batch's chunks are counted in the pages they take, so a
        # limit between two page counts would let an undeclared batch store up to a page more
        # than the `max_batch_bytes` it is told (and a declared one of the same size is refused).
        limit = min(settings.max_batch_bytes or pool.pool_bytes, pool.pool_bytes)
        self.max_batch_pages = max(1, limit // pool.page_bytes)
        self.max_batch_bytes = self.max_batch_pages * pool.page_bytes
        self._entries: dict[str, _Entry] = {}
        self._timers: LeaseQueue[_Entry] = LeaseQueue()
        self._seq = itertools.count()
        self._delivered: OrderedDict[str, _Entry] = OrderedDict()
        self._open_batches: dict[ParkBatch, None] = {}
        # Slots a worker thread is filling for a batch (begin_fill .. end_fill), whatever
        # became of the batch meanwhile: counted as pending until their fill ends.
        self._filling: set[SlotHandle] = set()
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._intents: OrderedDict[str, float] = OrderedDict()
        self._intent_heap: list[tuple[float, str]] = []
        self._bound = 0
        # Bound repeat Fetches: their ids stay in `_delivered` but are not DELIVERED meanwhile.
        self._redelivering = 0
        # Pages of the DELIVERED ids (bound ones excluded): all that eviction could free.
        self._evictable_pages = 0
        # Bound ids that hold committed chunks (the rest are demands: Fetches before any
        # commit), kept so that statistics() costs O(1).
        self._bound_committed = 0
        self._committed_ids = 0  # live ids with a commit: PARKED, BOUND or DELIVERED
        self._parked_bytes = 0
        self._pending_bytes = 0
        self._shutting_down = False
        self.reaped_total = 0
        self.consumed_total = 0
        self.confirmed_total = 0
        self.delivered_total = 0
        self.redelivered_total = 0
        self.evicted_total = 0
        self.released_total = 0
        self.late_fetch_rejections_total = 0
        self.late_park_rejections_total = 0
        self.parked_bytes_total = 0
        self.stalled_fetches_total = 0
        self.idle_batches_total = 0

    # =================================================================================== Park
    def begin_park(
        self, kv_request_id: str, total_chunks: int, batch_bytes: int, fingerprint: bytes = b""
    ) -> ParkBatch | Refusal:
        """Opens a batch for `kv_request_id`, or refuses it at once."""
        now = self.clock()
        if self._shutting_down:
            return Refusal(SHUTTING_DOWN, "producer is shutting down")
        tomb = self._tombstones.get(kv_request_id)
        if tomb is not None:
            self.late_park_rejections_total += 1
            return Refusal(tomb.reason, self._tomb_detail(tomb, now), late=True)
        entry = self._entries.get(kv_request_id)
        if entry is not None and entry.delivery_id:
            return Refusal(ALREADY_CONSUMED, "the id was delivered; it takes no more chunks")
        if batch_bytes > self.max_batch_bytes:
            return Refusal(TOO_LARGE, self._too_large_detail(batch_bytes))
        if entry is not None:
            mismatch = _fingerprint_mismatch(
                "the id's", entry.fingerprint, "this batch's", fingerprint
            )
            if mismatch:
                return Refusal(FINGERPRINT_MISMATCH, mismatch)
        if entry is not None and total_chunks:
            conflict = self._total_conflict(entry, total_chunks)
            if conflict:
                return Refusal(CHUNK_CONFLICT, conflict)
        # A batch sent again after a broken call carries the header it was first sent with, and
        # its chunks the id already holds take no pages: setting aside all it declares would
        # refuse it POOL_FULL, or evict a delivered id, for room it never uses. So only what
        # exceeds the id's committed bytes is set aside; a fresh id's batch reserves it all.
        reserve = batch_bytes - (entry.nbytes if entry is not None else 0)
        reservation = None
        if reserve > 0:
            reservation = self._reserve(reserve)
            if reservation is None:
                beyond = (
                    f" ({reserve} beyond the id's committed bytes)" if reserve < batch_bytes else ""
                )
                return Refusal(
                    POOL_FULL,
                    f"batch of {batch_bytes} bytes{beyond}, {self.pool.free_bytes} bytes free",
                    retry_after_s=self._retry_after(now),
                )
        if entry is None:
            entry = _Entry(kv_request_id, created_at=now)
            self._entries[kv_request_id] = entry
        if total_chunks:
            self._set_total(entry, total_chunks)
        batch = ParkBatch(
            entry, reservation, last_activity=now, opened_at=now, fingerprint=fingerprint
        )
        entry.open_batches.append(batch)
        self._open_batches[batch] = None
        return batch

    def park_chunk(
        self, batch: ParkBatch, chunk_id: int, data: memoryview, crc32c: int | None
    ) -> Refusal | None:
        """Stores one chunk of an open batch, invisibly; a refusal has already undone the
        whole batch. Raises MalformedRequest (after undoing the batch) for a chunk the contract
        forbids."""
        if batch.failed is not None:
            return batch.failed
        entry = batch.entry
        nbytes = len(data)
        batch.chunks_received += 1
        batch.bytes_received += nbytes
        batch.last_activity = self.clock()
        if entry.delivery_id:  # its commit would be refused: stop holding pages now
            detail = "the id was delivered while this batch was open"
            return self._undo(batch, Refusal(ALREADY_CONSUMED, detail))
        if not nbytes:
            self._undo(batch, Refusal(pb.REASON_UNSPECIFIED, "malformed chunk"))
            raise MalformedRequest(f"chunk {chunk_id} has no data")
        if chunk_id >= (entry.total_chunks or MAX_CHUNKS):
            self._undo(batch, Refusal(pb.REASON_UNSPECIFIED, "malformed chunk"))
            raise MalformedRequest(_out_of_range(chunk_id, entry.total_chunks))
        actual = crc32c_of(data)
        if crc32c is not None and actual != crc32c:
            detail = f"chunk {chunk_id}: crc32c {actual:#010x}, the chunk says {crc32c:#010x}"
            return self._undo(batch, Refusal(CHECKSUM_MISMATCH, detail))
        same = batch.pending.get(chunk_id) or entry.chunks.get(chunk_id)
        if same is not None:
            if same.crc32c == actual and self.pool.equals(same.handle, data):
                return None  # the same bytes again: nothing more to store
            detail = f"chunk {chunk_id} was parked with other bytes"
            return self._undo(batch, Refusal(CHUNK_CONFLICT, detail))
        if batch.held_pages + self.pool.pages_for(nbytes) > self.max_batch_pages:
            return self._undo(batch, Refusal(TOO_LARGE, self._too_large_detail(None)))
        handle = self._store(data, batch.reservation)
        if handle is None:
            detail = f"pool full at chunk {chunk_id} ({nbytes} bytes)"
            return self._undo(batch, Refusal(POOL_FULL, detail, self._retry_after(self.clock())))
        batch.pending[chunk_id] = _Stored(handle, actual)
        batch.held_pages += self.pool.pages_for(nbytes)
        self._pending_bytes += nbytes
        return None

    def begin_fill(
        self, batch: ParkBatch, chunk_id: int, nbytes: int
    ) -> tuple[SlotHandle, list[memoryview]] | Resent | Refusal:
        """The first half of storing a chunk that is copied in off the event loop (from a
        buffer a client lent): the checks `park_chunk` makes before its copy, and a slot whose
        views the caller fills. `end_fill` finishes it. A chunk the id already holds takes no
        pages, as inline: the caller compares it with the stored bytes (`Resent`) and
        `end_compare` finishes it."""
        if batch.failed is not None:
            return batch.failed
        entry = batch.entry
        batch.chunks_received += 1
        batch.bytes_received += nbytes
        batch.last_activity = self.clock()
        if entry.delivery_id:
            detail = "the id was delivered while this batch was open"
            return self._undo(batch, Refusal(ALREADY_CONSUMED, detail))
        if nbytes <= 0:
            self._undo(batch, Refusal(pb.REASON_UNSPECIFIED, "malformed chunk"))
            raise MalformedRequest(f"chunk {chunk_id} has no data")
        if chunk_id >= (entry.total_chunks or MAX_CHUNKS):
            self._undo(batch, Refusal(pb.REASON_UNSPECIFIED, "malformed chunk"))
            raise MalformedRequest(_out_of_range(chunk_id, entry.total_chunks))
        same = batch.pending.get(chunk_id) or entry.chunks.get(chunk_id)
        if same is not None:
            # Re-sent (a batch sent again after a broken call): it needs no room, so it must
            # neither count against the batch's size nor evict a delivered id for pages.
            if same.handle.nbytes != nbytes:
                detail = f"chunk {chunk_id} was parked with other bytes"
                return self._undo(batch, Refusal(CHUNK_CONFLICT, detail))
            batch.compared_bytes += nbytes
            if batch.compared_bytes > entry.nbytes + self.max_batch_bytes:
                detail = (
                    f"chunks re-sent by reference add up to more than the id holds plus "
                    f"max_batch_bytes {self.max_batch_bytes}: each is compared with its copy"
                )
                return self._undo(batch, Refusal(TOO_LARGE, detail))
            return Resent(same)
        if batch.held_pages + self.pool.pages_for(nbytes) > self.max_batch_pages:
            return self._undo(batch, Refusal(TOO_LARGE, self._too_large_detail(None)))
        handle = self._allocate(nbytes, batch.reservation)
        if handle is None:
            detail = f"pool full at chunk {chunk_id} ({nbytes} bytes)"
            return self._undo(batch, Refusal(POOL_FULL, detail, self._retry_after(self.clock())))
        batch.filling.add(handle)
        self._filling.add(handle)
        batch.held_pages += self.pool.pages_for(nbytes)
        self._pending_bytes += nbytes
        return handle, self.pool.views(handle)

    def end_fill(
        self, batch: ParkBatch, chunk_id: int, handle: SlotHandle, crc32c: int | None, actual: int
    ) -> Refusal | None:
        """The second half: the slot was filled and its CRC32C computed (`actual`). Checks the
        chunk as `park_chunk` does and keeps it in the batch, or frees it."""
        batch.filling.discard(handle)
        self._filling.discard(handle)
        batch.held_pages -= self.pool.pages_for(handle.nbytes)
        self._pending_bytes -= handle.nbytes
        if batch.failed is not None:  # undone while the thread wrote: its pages go now
            self.pool.free(handle)
            return batch.failed
        entry = batch.entry
        refusal = None
        if crc32c is not None and actual != crc32c:
            detail = f"chunk {chunk_id}: crc32c {actual:#010x}, the chunk says {crc32c:#010x}"
            refusal = Refusal(CHECKSUM_MISMATCH, detail)
        same = batch.pending.get(chunk_id) or entry.chunks.get(chunk_id)
        if refusal is None and same is not None:
            if same.crc32c == actual and self.pool.same_bytes(same.handle, handle):
                self.pool.free(handle)  # the same bytes again: nothing more to keep
                return None
            refusal = Refusal(CHUNK_CONFLICT, f"chunk {chunk_id} was parked with other bytes")
        if refusal is not None:
            self.pool.free(handle)
            return self._undo(batch, refusal)
        batch.pending[chunk_id] = _Stored(handle, actual)
        batch.held_pages += self.pool.pages_for(handle.nbytes)
        self._pending_bytes += handle.nbytes
        return None

    def begin_copy_wait(self, batch: ParkBatch) -> None:
        """The batch's call stops reading its stream to wait for copies it started
        (`begin_fill`): however long they take, the time is the producer's, not the client's
        silence, so `park_idle_timeout_s` does not run out meanwhile (`max_lease_s` still
        does)."""
        batch.waiting_for_copies = True

    def end_copy_wait(self, batch: ParkBatch) -> None:
        """The wait ended: the client's idle clock starts over, so it has a whole
        `park_idle_timeout_s` from when the producer reads its stream again."""
        batch.waiting_for_copies = False
        batch.last_activity = self.clock()

    def stored_views(self, resent: Resent) -> list[memoryview]:
        """The stored bytes a re-sent chunk is compared with."""
        return self.pool.views(resent.stored.handle)

    def end_compare(
        self, batch: ParkBatch, chunk_id: int, resent: Resent, crc32c: int | None, actual: int,
        same_bytes: bool,
    ) -> Refusal | None:  # fmt: skip
        """The second half for a re-sent chunk: its bytes were compared with the stored ones
        (`same_bytes`) and their CRC32C computed (`actual`). As `park_chunk`: the same bytes
        again are accepted and stored once; other bytes are a conflict."""
        if batch.failed is not None:
            return batch.failed
        if crc32c is not None and actual != crc32c:
            detail = f"chunk {chunk_id}: crc32c {actual:#010x}, the chunk says {crc32c:#010x}"
            return self._undo(batch, Refusal(CHECKSUM_MISMATCH, detail))
        if same_bytes and resent.stored.crc32c == actual:
            return None
        detail = f"chunk {chunk_id} was parked with other bytes"
        return self._undo(batch, Refusal(CHUNK_CONFLICT, detail))

    def commit_park(self, batch: ParkBatch, chunks: int, nbytes: int) -> ParkDone | Refusal:
        """Makes the batch visible, all at once, if `chunks` and `nbytes` name what it sent."""
        if batch.failed is not None:
            return batch.failed
        entry = batch.entry
        assert not batch.filling, "a commit waits for every fill to end"
        if (chunks, nbytes) != (batch.chunks_received, batch.bytes_received):
            detail = (
                f"commit names {chunks} chunks and {nbytes} bytes; the batch sent "
                f"{batch.chunks_received} chunks and {batch.bytes_received} bytes"
            )
            return self._undo(batch, Refusal(COMMIT_MISMATCH, detail))
        if entry.delivery_id:
            detail = "the id was delivered while this batch was open"
            return self._undo(batch, Refusal(ALREADY_CONSUMED, detail))
        refusal = self._commit_conflict(batch)
        if refusal is not None:
            return self._undo(batch, refusal)
        now = self.clock()
        for chunk_id, stored in batch.pending.items():
            nbytes_chunk = stored.handle.nbytes
            self._pending_bytes -= nbytes_chunk
            if chunk_id in entry.chunks:  # committed by another batch meanwhile, same bytes
                self.pool.free(stored.handle)
                continue
            entry.chunks[chunk_id] = stored
            entry.nbytes += nbytes_chunk
            self._parked_bytes += nbytes_chunk
            self.parked_bytes_total += nbytes_chunk
        batch.pending.clear()
        if entry.fingerprint is None and entry.chunks:
            # Fixed by the first commit that makes the id visible: an empty batch parks
            # nothing, so it fixes nothing either (a Fetch waiting for the id would be refused,
            # and the id's real batch too, for KV that is not there).
            entry.fingerprint = batch.fingerprint
        if not entry.total_chunks and entry.chunks:
            self._set_total(entry, max(entry.chunks) + 1)
        self._close_batch(batch)
        if entry.committed_at is None and entry.chunks:
            self._start_lease(entry, now)
        elif entry.binding is not None:
            entry.binding.notify()
        self._drop_if_idle(entry)
        # A batch that leaves the id with nothing committed and nothing attached (an empty
        # first batch) lets it be forgotten, its declared total with it: the answer must not
        # report a total that a later header is free to declare otherwise.
        total = entry.total_chunks if self._entries.get(entry.kv_request_id) is entry else 0
        return ParkDone(len(entry.chunks), entry.nbytes, total, self._timer_remaining(entry, now))

    def end_park_stream(self, batch: ParkBatch) -> Refusal:
        """The stream ended without a commit: nothing of the batch is kept."""
        if batch.failed is not None:
            return batch.failed
        detail = "the Park stream ended without a ParkCommit; the batch was undone"
        return self._undo(batch, Refusal(NOT_COMMITTED, detail))

    def abort_park(self, batch: ParkBatch) -> None:
        """Undoes a batch whose call broke (cancel, malformed message). Idempotent; a
        committed batch is left alone."""
        if batch.failed is None and not batch.done:
            self._undo(batch, Refusal(pb.REASON_UNSPECIFIED, "batch aborted"))

    def _commit_conflict(self, batch: ParkBatch) -> Refusal | None:
        """What stops this batch from being committed as it is, checked before anything moves
        so that a commit is all-or-nothing."""
        entry = batch.entry
        # Another batch may have been committed since this one's header was taken.
        mismatch = _fingerprint_mismatch(
            "the id's", entry.fingerprint, "this batch's", batch.fingerprint
        )
        if mismatch:
            return Refusal(FINGERPRINT_MISMATCH, mismatch)
        for chunk_id, stored in batch.pending.items():
            other = entry.chunks.get(chunk_id)
            if other is not None and not (
                other.crc32c == stored.crc32c and self.pool.same_bytes(other.handle, stored.handle)
            ):
                return Refusal(CHUNK_CONFLICT, f"chunk {chunk_id} was committed with other bytes")
        beyond = [c for c in batch.pending if entry.total_chunks and c >= entry.total_chunks]
        if beyond:
            # The total was fixed after these chunks arrived (by another batch's header or
            # commit): keeping them would give the id a chunk no whole-id Fetch ever sends.
            detail = f"chunk {max(beyond)} is beyond total_chunks {entry.total_chunks}"
            return Refusal(CHUNK_CONFLICT, f"{detail}, fixed by another batch")
        if not entry.total_chunks and batch.pending:
            total = max(max(batch.pending), max(entry.chunks, default=-1)) + 1
            conflict = self._total_conflict(entry, total)
            if conflict:
                return Refusal(CHUNK_CONFLICT, f"{conflict} (the commit fixes the total)")
        return None

    def _undo(self, batch: ParkBatch, refusal: Refusal) -> Refusal:
        """Fails a batch: its pending chunks and unused reservation go back to the pool (slots
        still being filled go when their fill ends: `end_fill`)."""
        for stored in batch.pending.values():
            self.pool.free(stored.handle)
            self._pending_bytes -= stored.handle.nbytes
        batch.pending.clear()
        batch.failed = refusal
        self._close_batch(batch)
        self._drop_if_idle(batch.entry)
        return refusal

    def _undo_from_outside(self, batch: ParkBatch, refusal: Refusal) -> None:
        """`_undo` for a batch ended by something other than its own call: its handler is
        woken to answer now."""
        self._undo(batch, refusal)
        if batch.wake is not None:
            batch.wake()

    def _close_batch(self, batch: ParkBatch) -> None:
        batch.done = True
        self._open_batches.pop(batch, None)
        if batch.reservation is not None:
            self.pool.close_reservation(batch.reservation)
        if batch in batch.entry.open_batches:
            batch.entry.open_batches.remove(batch)

    def _too_large_detail(self, batch_bytes: int | None) -> str:
        what = (
            f"the batch's chunks, each taking whole {self.pool.page_bytes}-byte pages, exceed"
            if batch_bytes is None
            else f"a batch of {batch_bytes} bytes exceeds"
        )
        return (
            f"{what} max_batch_bytes {self.max_batch_bytes} "
            f"(max_batch_share of the {self.pool.pool_bytes}-byte pool)"
        )

    def _total_conflict(self, entry: _Entry, total: int) -> str | None:
        if entry.total_chunks and entry.total_chunks != total:
            return f"total_chunks {total} conflicts with {entry.total_chunks} declared before"
        beyond = [c for c in entry.chunks if c >= total]
        if beyond:
            return f"total_chunks {total} but chunk {min(beyond)} is parked"
        binding = entry.binding
        if binding is not None and binding.requested and max(binding.requested) >= total:
            return (
                f"total_chunks {total} but the bound Fetch asks for chunk {max(binding.requested)}"
            )
        return None

    def _set_total(self, entry: _Entry, total: int) -> None:
        if entry.total_chunks != total:
            entry.total_chunks = total
            if entry.binding is not None:
                entry.binding.notify()

    def _start_lease(self, entry: _Entry, now: float) -> None:
        s = self.settings
        entry.committed_at = now
        self._committed_ids += 1
        if entry.binding is not None:
            self._bound_committed += 1
        intent = max(entry.intent_deadline, self._intents.pop(entry.kv_request_id, 0.0))
        entry.intent_deadline = intent
        entry.deadline = min(max(now + s.unbound_store_timeout_s, intent), now + s.max_lease_s)
        if entry.binding is None:
            self._push_timer(entry)
        else:
            entry.binding.notify()

    def _reserve(self, nbytes: int) -> Reservation | None:
        reservation = self.pool.reserve(nbytes)
        if reservation is None and self._make_room(self.pool.pages_for(nbytes)):
            reservation = self.pool.reserve(nbytes)
        return reservation

    def _allocate(self, nbytes: int, reservation: Reservation | None) -> SlotHandle | None:
        handle = self.pool.allocate(nbytes, reservation)
        if handle is None and self._make_room(self._free_pages_needed(nbytes, reservation)):
            handle = self.pool.allocate(nbytes, reservation)
        return handle

    def _store(self, data: memoryview, reservation: Reservation | None) -> SlotHandle | None:
        handle = self.pool.store(data, reservation)
        if handle is None and self._make_room(self._free_pages_needed(len(data), reservation)):
            handle = self.pool.store(data, reservation)
        return handle

    def _free_pages_needed(self, nbytes: int, reservation: Reservation | None) -> int:
        """Pages a chunk of `nbytes` takes from the free list: the pool fills it from the
        batch's reservation first."""
        reserved = len(reservation.pages) if reservation is not None and reservation.open else 0
        return self.pool.pages_for(nbytes) - reserved

    def _make_room(self, pages: int) -> bool:
        """Evicts DELIVERED ids, oldest delivery first, until the pages they held and the free
        ones come to `pages`. When even all of them would not, evicts none and returns False:
        the request fails anyway, and each eviction costs a consumer its chance to confirm or
        fetch again. Parked and bound ids are never evicted: only bytes their consumer already
        received."""
        short = pages - self.pool.free_bytes // self.pool.page_bytes
        if short > self._evictable_pages:
            return False
        victims = []
        for entry in self._delivered.values():
            if short <= 0:
                break
            if entry.binding is not None:
                continue  # a repeat Fetch is streaming it: BOUND, so not evictable
            victims.append(entry)
            short -= entry.pages
        self._end_entries(victims, EVICTED, self.clock())
        self.evicted_total += len(victims)
        return True

    def _retry_after(self, now: float) -> float:
        """When memory may free up: the next timer (a lease or a delivery grace ending), at
        least one reaper interval; open batches give theirs back within park_idle_timeout_s."""
        floor = self.settings.reap_interval_s
        nxt = self.next_deadline()
        if nxt is not None:
            return max(floor, min(nxt - now, self.settings.park_idle_timeout_s))
        return max(floor, 1.0)

    # ================================================================================== Fetch
    def bind_fetch(
        self,
        kv_request_id: str,
        chunk_ids: Sequence[int],
        expected_epoch: int,
        wait_timeout_s: float,
        notify: Notify,
        expected_fingerprint: bytes = b"",
    ) -> FetchBinding | Refusal:
        """Attaches a Fetch, or refuses it at once. Raises MalformedRequest for chunk_ids
        beyond the id's total; a list that repeats a chunk is the caller's to refuse first.
        With `expected_fingerprint`, an id parked with another is refused, untouched."""
        now = self.clock()
        if expected_epoch and expected_epoch != self.epoch:
            return Refusal(
                EPOCH_MISMATCH,
                f"expected epoch {expected_epoch}, this producer is epoch {self.epoch}",
            )
        tomb = self._tombstones.get(kv_request_id)
        if tomb is not None:
            self.late_fetch_rejections_total += 1
            return Refusal(tomb.reason, self._tomb_detail(tomb, now), late=True)
        if self._shutting_down:
            return Refusal(SHUTTING_DOWN, "producer is shutting down")
        requested = list(chunk_ids) if chunk_ids else None
        entry = self._entries.get(kv_request_id)
        if entry is not None and expected_fingerprint:
            mismatch = _fingerprint_mismatch(
                "parked", entry.fingerprint, "expected", expected_fingerprint
            )
            if mismatch:
                return Refusal(FINGERPRINT_MISMATCH, mismatch)
        if entry is not None and entry.binding is not None:
            return Refusal(ALREADY_BOUND, "another Fetch is attached to this id")
        total = entry.total_chunks if entry is not None else 0
        if requested is not None and max(requested) >= (total or MAX_CHUNKS):
            raise MalformedRequest(_out_of_range(max(requested), total))
        if entry is None:
            entry = _Entry(kv_request_id, created_at=now)
            self._entries[kv_request_id] = entry
        wait = self.settings.max_fetch_wait_s
        if wait_timeout_s > 0:
            wait = min(wait, wait_timeout_s)
        ttf = None if entry.committed_at is None else now - entry.committed_at
        redelivery = bool(entry.delivery_id)
        binding = FetchBinding(
            entry, requested, wait, now + wait, notify, now, ttf, redelivery, expected_fingerprint
        )
        self._attach(entry, binding)
        return binding

    def next_for(self, binding: FetchBinding) -> ReadyChunk | FetchWait | FetchEnd:
        """What a bound Fetch does next. A ReadyChunk's views must be copied before the next
        call into the lot: the following call may free them."""
        if binding.failed is not None or not binding.active:
            return self._end(
                binding, binding.failed or Refusal(pb.REASON_UNSPECIFIED, "fetch detached")
            )
        entry = binding.entry
        if binding.expected_fingerprint and not binding.chunks_sent:
            # Bound before the first commit, which fixed another fingerprint: nothing was sent.
            mismatch = _fingerprint_mismatch(
                "parked", entry.fingerprint, "expected", binding.expected_fingerprint
            )
            if mismatch:
                return self._end(binding, Refusal(FINGERPRINT_MISMATCH, mismatch))
        next_id = self._next_chunk_id(binding)
        if next_id is None:
            return self._deliver(binding)
        stored = entry.chunks.get(next_id)
        if stored is None:
            if self._shutting_down:  # no batch can commit it any more
                self._end_entries((entry,), SHUTTING_DOWN, self.clock())
                return self._end(binding, binding.failed or Refusal(SHUTTING_DOWN, ""))
            return FetchWait(binding.wait_deadline)
        views = self.pool.views(stored.handle)  # raises StaleSlotError, never reads freed memory
        binding.cursor += 1
        binding.chunks_sent += 1
        binding.bytes_sent += stored.handle.nbytes
        # Progress: the wait bounds a stall of the parking side, not the whole transfer.
        binding.wait_deadline = self.clock() + binding.wait_s
        return ReadyChunk(next_id, stored.crc32c, views, stored.handle.nbytes)

    def _next_chunk_id(self, binding: FetchBinding) -> int | None:
        """The chunk the Fetch sends next; None once it was handed every chunk it asked for."""
        if binding.requested is not None:
            order_len = len(binding.requested)
            return binding.requested[binding.cursor] if binding.cursor < order_len else None
        order_len = binding.entry.total_chunks  # 0 until a commit fixes it: stream 0, 1, ...
        return binding.cursor if not order_len or binding.cursor < order_len else None

    def sent(self, binding: FetchBinding) -> None:
        """The chunks handed out went out (a batch written, however long that took): the
        wait for the next chunk counts from now. A long write is the consumer's progress,
        not a stall of the parking side."""
        if binding.active:
            binding.wait_deadline = self.clock() + binding.wait_s

    def not_sent(self, binding: FetchBinding, chunks: Sequence[ReadyChunk]) -> None:
        """Chunks handed out that never reached the consumer whole (a batch cut short when
        the producer stopped): the Fetch's end does not count them as sent."""
        binding.chunks_sent -= len(chunks)
        binding.bytes_sent -= sum(step.nbytes for step in chunks)

    def fetch_wait_expired(self, binding: FetchBinding) -> FetchEnd:
        """Nothing became available to send for the binding's whole wait."""
        if binding.failed is not None:  # the id ended meanwhile (shutdown): that is the cause
            return self._end(binding, binding.failed)
        missing = self._first_missing(binding)
        detail = f"chunk {missing} not committed within {binding.wait_s:g}s of the last progress"
        return self._end(binding, Refusal(WAIT_TIMEOUT, detail))

    def cancel_fetch(self, binding: FetchBinding) -> None:
        """The consumer went away: the id returns to where it was, with its old timer."""
        if binding.active:
            self._detach(binding, fresh_timer=False)

    def stall_fetch(self, binding: FetchBinding) -> None:
        """The consumer read nothing for fetch_stall_timeout_s and was cut off: the id returns
        to where it was with a fresh timer, so a consumer that comes back can still load it."""
        if binding.active:
            self.stalled_fetches_total += 1
            self._detach(binding, fresh_timer=True)

    def _first_missing(self, binding: FetchBinding) -> int:
        if binding.requested is not None:
            return binding.requested[binding.cursor]
        return binding.cursor

    def _attach(self, entry: _Entry, binding: FetchBinding) -> None:
        entry.binding = binding
        self._bound += 1
        if entry.committed_at is not None:
            self._bound_committed += 1
        if binding.redelivery:
            self._redelivering += 1
            self._evictable_pages -= entry.pages

    def _unbind(self, entry: _Entry, binding: FetchBinding) -> None:
        binding.active = False
        entry.binding = None
        self._bound -= 1
        if entry.committed_at is not None:
            self._bound_committed -= 1
        if binding.redelivery:
            self._redelivering -= 1
            self._evictable_pages += entry.pages

    def _deliver(self, binding: FetchBinding) -> FetchEnd:
        """Every requested chunk was sent: the id is DELIVERED and keeps its bytes for the
        consumer's confirmation (or a repeat Fetch) for delivery_grace_s."""
        entry = binding.entry
        self._unbind(entry, binding)
        entry.delivery_id = secrets.randbits(64) or 1
        entry.deadline = self.clock() + self.settings.delivery_grace_s
        self._push_timer(entry)
        if binding.redelivery:
            self._delivered.move_to_end(entry.kv_request_id)  # now the newest delivery
            self.redelivered_total += 1
        else:
            pages_for = self.pool.pages_for
            entry.pages = sum(pages_for(stored.handle.nbytes) for stored in entry.chunks.values())
            self._delivered[entry.kv_request_id] = entry
            self._evictable_pages += entry.pages
        self.delivered_total += 1
        return FetchEnd(None, binding.chunks_sent, binding.bytes_sent, entry.delivery_id)

    def _end(self, binding: FetchBinding, refusal: Refusal) -> FetchEnd:
        if binding.active:
            self._detach(binding, fresh_timer=False)
        return FetchEnd(refusal, binding.chunks_sent, binding.bytes_sent)

    def _detach(self, binding: FetchBinding, *, fresh_timer: bool) -> None:
        binding.active = False
        entry = binding.entry
        if entry.binding is not binding:
            return
        self._unbind(entry, binding)
        if self._entries.get(entry.kv_request_id) is not entry:
            return
        if fresh_timer and entry.deadline is not None:
            s = self.settings
            span = s.delivery_grace_s if entry.delivery_id else s.unbound_store_timeout_s
            fresh = self.clock() + span
            if not entry.delivery_id and entry.committed_at is not None:
                # A lease, however renewed, ends max_lease_s after the first commit: a consumer
                # that binds and stalls again and again must not keep the id for ever.
                fresh = min(fresh, entry.committed_at + s.max_lease_s)
            entry.deadline = max(entry.deadline, fresh)
        if entry.deadline is not None:
            self._push_timer(entry)
        self._drop_if_idle(entry)

    # ================================================================ KeepAlive, Release, Lookup
    def keep_alive(self, kv_request_ids: Iterable[str], extend_s: float) -> list[IdStatus]:
        """Extends the lease of PARKED ids and records intent for ids not committed yet;
        answers each id's state. Delivered ids and open batches are not extended."""
        ids = list(kv_request_ids)  # read once: a generator must not be consumed twice
        now = self.clock()
        s = self.settings
        extend = min(extend_s if extend_s > 0 else s.unbound_store_timeout_s, s.max_lease_s)
        wanted = now + extend
        for kid in ids:
            entry = self._entries.get(kid)
            if entry is None:
                if kid not in self._tombstones and wanted > self._intents.get(kid, 0.0):
                    self._intents[kid] = wanted
                    self._intents.move_to_end(kid)
                    heapq.heappush(self._intent_heap, (wanted, kid))
                    self._cap_intents()
            elif entry.delivery_id:
                continue  # delivered: its grace is the consumer's to end, not to stretch
            elif entry.committed_at is None:
                entry.intent_deadline = max(entry.intent_deadline, wanted)
            else:
                assert entry.deadline is not None
                new = min(wanted, entry.committed_at + s.max_lease_s)
                if new > entry.deadline:
                    entry.deadline = new
                    if entry.binding is None:
                        self._push_timer(entry)
        return self._statuses(ids, now)

    def release(self, kv_request_id: str, delivery_id: int = 0) -> Refusal | None:
        """`delivery_id` 0: gives the id up (tombstone RELEASED). Otherwise confirms that
        delivery (tombstone ALREADY_CONSUMED). None means done."""
        now = self.clock()
        entry = self._entries.get(kv_request_id)
        if entry is None or (entry.committed_at is None and entry.binding is None):
            if delivery_id == 0:
                self._intents.pop(kv_request_id, None)
            tomb = self._tombstones.get(kv_request_id)
            if tomb is not None:
                return Refusal(tomb.reason, self._tomb_detail(tomb, now))
            if entry is not None and delivery_id == 0:  # only open batches: they end too
                self._end_entries((entry,), RELEASED, now)
                self.released_total += 1
                return None
            return Refusal(UNKNOWN_ID, "no such id")
        if delivery_id:
            if entry.delivery_id != delivery_id or entry.binding is not None:
                return Refusal(UNKNOWN_ID, "no such delivery of this id")
            self._end_entries((entry,), ALREADY_CONSUMED, now)
            self.consumed_total += 1
            self.confirmed_total += 1
            return None
        if entry.binding is not None:
            return Refusal(ALREADY_BOUND, "a Fetch is streaming this id")
        self._end_entries((entry,), RELEASED, now)
        self.released_total += 1
        return None

    def lookup(self, kv_request_ids: Iterable[str]) -> list[IdStatus]:
        return self._statuses(kv_request_ids, self.clock())

    def _statuses(self, kv_request_ids: Iterable[str], now: float) -> list[IdStatus]:
        return [self._status(kid, now) for kid in kv_request_ids]

    def _status(self, kid: str, now: float) -> IdStatus:
        entry = self._entries.get(kid)
        if entry is not None and (entry.committed_at is not None or entry.binding is not None):
            if entry.binding is not None:
                state = pb.STATE_BOUND
            elif entry.delivery_id:
                state = pb.STATE_DELIVERED
            else:
                state = pb.STATE_PARKED
            since = entry.committed_at if entry.committed_at is not None else entry.created_at
            return IdStatus(
                kid,
                state,
                chunks_parked=len(entry.chunks),
                total_chunks=entry.total_chunks,
                nbytes=entry.nbytes,
                age_s=now - since,
                lease_remaining_s=self._timer_remaining(entry, now),
                fingerprint=entry.fingerprint or b"",
            )
        tomb = self._tombstones.get(kid)
        if tomb is not None:
            return IdStatus(kid, pb.STATE_TOMBSTONED, tomb.reason, age_s=now - tomb.at)
        # Nothing visible: never seen, forgotten, or only uncommitted batches.
        intent = self._intents.get(kid)
        if entry is not None:
            intent = max(intent or 0.0, entry.intent_deadline) or None
        remaining = max(0.0, intent - now) if intent is not None else 0.0
        return IdStatus(kid, pb.STATE_UNKNOWN, lease_remaining_s=remaining)

    def _timer_remaining(self, entry: _Entry, now: float) -> float:
        if entry.binding is not None or entry.deadline is None:
            return 0.0
        return max(0.0, entry.deadline - now)

    # ================================================================================= Reaper
    def reap(self) -> list[str]:
        """One reaper pass: ends ids whose lease or delivery grace ran out, undoes batches
        silent for park_idle_timeout_s, prunes tombstones and intents. Returns the reaped ids.

        Costs O(expired + open batches): only timer items whose deadline has passed are
        touched."""
        now = self.clock()
        timers = self._timers
        live = self._timer_item_live
        due = [item[2] for item in timers.pop_due(now) if live(item)]
        # Ending an id never touches another id's timer item, so the live ones are picked
        # first and ended together (one clock reading, one tombstone cap for the pass).
        expired = [entry for entry in due if not entry.delivery_id]
        unconfirmed = [entry for entry in due if entry.delivery_id]
        self._end_entries(expired, REAPED, now)
        self.reaped_total += len(expired)
        if unconfirmed:
            self._end_entries(unconfirmed, ALREADY_CONSUMED, now)
            self.consumed_total += len(unconfirmed)
        if len(timers) > 2 * (len(self._entries) + _HEAP_SLACK):
            timers.retain(live)
        self._expire_idle_batches(now)
        self._prune(now)
        return [entry.kv_request_id for entry in expired]

    def _expire_idle_batches(self, now: float) -> None:
        idle_s = self.settings.park_idle_timeout_s
        open_s = self.settings.max_lease_s

        def silent(b: ParkBatch) -> bool:
            return not b.waiting_for_copies and now - b.last_activity >= idle_s

        stale = [b for b in self._open_batches if silent(b) or now - b.opened_at >= open_s]
        for batch in stale:
            if silent(batch):
                detail = f"the Park stream sent nothing for {idle_s:g}s (park_idle_timeout_s)"
            else:
                detail = f"the Park stayed open {open_s:g}s without a commit (max_lease_s)"
            self._undo_from_outside(batch, Refusal(NOT_COMMITTED, detail))
        self.idle_batches_total += len(stale)

    def _timer_item_live(self, item: tuple[float, int, _Entry]) -> bool:
        deadline, seq, entry = item
        return (
            entry.binding is None
            and entry.timer_seq == seq
            and entry.deadline == deadline
            and self._entries.get(entry.kv_request_id) is entry
        )

    def _push_timer(self, entry: _Entry) -> None:
        assert entry.deadline is not None
        entry.timer_seq = next(self._seq)
        self._timers.push(entry.deadline, entry.timer_seq, entry)

    def _prune(self, now: float) -> None:
        horizon = now - self.settings.tombstone_retention_s
        tombs = self._tombstones
        while tombs:
            first = next(iter(tombs.values()))
            if first.at > horizon:
                break
            tombs.popitem(last=False)
        self._cap_tombstones()
        heap = self._intent_heap
        while heap and heap[0][0] <= now:
            deadline, kid = heapq.heappop(heap)
            if self._intents.get(kid) == deadline:
                del self._intents[kid]
        if len(heap) > 2 * (len(self._intents) + _HEAP_SLACK):
            self._intent_heap = [(d, k) for k, d in self._intents.items()]
            heapq.heapify(self._intent_heap)

    def _cap_tombstones(self) -> None:
        tombs = self._tombstones
        while len(tombs) > self.settings.max_tombstones:
            tombs.popitem(last=False)

    def _cap_intents(self) -> None:
        while len(self._intents) > self.settings.max_tombstones:
            self._intents.popitem(last=False)

    def next_deadline(self) -> float | None:
        """The earliest live timer deadline (for scheduling the next pass), or None."""
        timers = self._timers
        while (head := timers.peek()) is not None and not self._timer_item_live(head):
            timers.pop()
        return head[0] if head is not None else None

    # ================================================================================ Endings
    def _end_entries(self, entries: Iterable[_Entry], reason: Reason, now: float) -> None:
        """Frees each id's memory, fails what is attached to it, and tombstones it, all at
        `now`. The reaper's ids are plain PARKED ones (no open batch, no bound Fetch), so those
        two attachments are handled out of line and the loop body is what every id needs; a
        reaper pass ends ~1k ids this way, so every lookup done once here counts."""
        free = self.pool.free
        by_id = self._entries
        intents = self._intents
        tombs = self._tombstones
        delivered = self._delivered
        tomb = _Tombstone(reason, now)
        for entry in entries:
            kid = entry.kv_request_id
            if entry.open_batches:
                for batch in list(entry.open_batches):
                    refusal = Refusal(reason, f"id ended: {reason_name(reason)}")
                    self._undo_from_outside(batch, refusal)
            # Every chunk goes, so the id's byte count leaves the lot's total in one step.
            for stored in entry.chunks.values():
                free(stored.handle)
            entry.chunks.clear()
            self._parked_bytes -= entry.nbytes
            entry.nbytes = 0
            binding = entry.binding
            if binding is not None:
                self._fail_binding(entry, binding, reason)
            if by_id.get(kid) is entry:
                del by_id[kid]
                if entry.committed_at is not None:
                    self._committed_ids -= 1
            if entry.delivery_id and delivered.pop(kid, None) is not None:
                self._evictable_pages -= entry.pages
            if intents:
                intents.pop(kid, None)
            if kid in tombs:  # never for a live id; a new key is inserted at the end anyway
                tombs.move_to_end(kid)
            tombs[kid] = tomb
        # Capping once after the inserts keeps the same (newest) tombstones as capping after
        # each one: inserts only ever go to the end.
        self._cap_tombstones()

    def _fail_binding(self, entry: _Entry, binding: FetchBinding, reason: Reason) -> None:
        """Detaches the Fetch bound to an ending id and wakes it to report `reason`."""
        binding.failed = Refusal(reason, f"id ended: {reason_name(reason)}")
        self._unbind(entry, binding)
        binding.notify()

    def _drop_if_idle(self, entry: _Entry) -> None:
        """Forgets an id that holds no committed chunk and has nothing attached (no tombstone:
        nothing was lost, a retry may start over)."""
        if (
            not entry.chunks
            and entry.binding is None
            and not entry.open_batches
            and self._entries.get(entry.kv_request_id) is entry
        ):
            del self._entries[entry.kv_request_id]
            self._delivered.pop(entry.kv_request_id, None)
            # Never shorten an intent recorded before this entry existed.
            if entry.intent_deadline > max(
                self.clock(), self._intents.get(entry.kv_request_id, 0.0)
            ):
                self._intents[entry.kv_request_id] = entry.intent_deadline
                heapq.heappush(self._intent_heap, (entry.intent_deadline, entry.kv_request_id))
                self._cap_intents()

    def _tomb_detail(self, tomb: _Tombstone, now: float) -> str:
        return f"{reason_name(tomb.reason)} {now - tomb.at:.3f}s ago"

    # =============================================================================== Shutdown
    def begin_shutdown(self) -> None:
        """New Parks and Fetches are refused SHUTTING_DOWN and open Park batches are undone
        (their handlers answer SHUTTING_DOWN at once); bound Fetches go on with what is
        committed. No batch can commit a chunk any more, so a Fetch waiting for one ends its
        id SHUTTING_DOWN now (next_for ends one that reaches such a chunk later) rather than
        hold the drain for its whole grace."""
        self._shutting_down = True
        for batch in list(self._open_batches):
            self._undo_from_outside(batch, Refusal(SHUTTING_DOWN, "producer is shutting down"))
        waiting = [
            entry
            for entry in self._entries.values()
            if entry.binding is not None and self._waits_for_a_chunk(entry.binding)
        ]
        self._end_entries(waiting, SHUTTING_DOWN, self.clock())

    def _waits_for_a_chunk(self, binding: FetchBinding) -> bool:
        next_id = self._next_chunk_id(binding)
        return next_id is not None and next_id not in binding.entry.chunks

    def fail_all(self, reason: Reason = SHUTTING_DOWN) -> int:
        """Ends every live id with `reason` (what remains after the shutdown grace). A Fetch
        still bound is also cut short: the batch it is sending may take far longer than the
        server then gives its calls to end, and its TransferDone must go out before."""
        entries = list(self._entries.values())
        bound = [entry.binding for entry in entries if entry.binding is not None]
        self._end_entries(entries, reason, self.clock())
        for binding in bound:
            if binding.cut_short is not None:
                binding.cut_short()
        return len(entries)

    @property
    def bound_count(self) -> int:
        return self._bound

    # ========================================================================== Observability
    def statistics(self) -> LotStatistics:
        delivered = len(self._delivered) - self._redelivering
        return LotStatistics(
            parked_ids=self._committed_ids - delivered - self._bound_committed,
            bound_ids=self._bound,
            delivered_ids=delivered,
            open_batches=len(self._open_batches),
            tombstones=len(self._tombstones),
            intents=len(self._intents),
            parked_bytes=self._parked_bytes,
            pending_bytes=self._pending_bytes,
            reaped_total=self.reaped_total,
            consumed_total=self.consumed_total,
            confirmed_total=self.confirmed_total,
            delivered_total=self.delivered_total,
            redelivered_total=self.redelivered_total,
            evicted_total=self.evicted_total,
            released_total=self.released_total,
            late_fetch_rejections_total=self.late_fetch_rejections_total,
            late_park_rejections_total=self.late_park_rejections_total,
            parked_bytes_total=self.parked_bytes_total,
            stalled_fetches_total=self.stalled_fetches_total,
            idle_batches_total=self.idle_batches_total,
            shutting_down=self._shutting_down,
        )

    def check_invariants(self) -> None:
        """Raises AssertionError if the lot and the pool disagree or a counter went wrong."""
        self.pool.check_invariants()
        entries = self._entries.values()
        bound = sum(1 for e in entries if e.binding is not None)
        assert bound == self._bound >= 0, f"bound count {self._bound}, actual {bound}"
        bound_committed = sum(1 for e in entries if e.binding and e.committed_at is not None)
        assert bound_committed == self._bound_committed, "bound committed count is off"
        assert sum(1 for e in entries if e.committed_at is not None) == self._committed_ids
        committed = pending = 0
        for kid, entry in self._entries.items():
            assert entry.kv_request_id == kid
            assert kid not in self._tombstones, f"{kid!r} is live and tombstoned"
            size = sum(s.handle.nbytes for s in entry.chunks.values())
            assert size == entry.nbytes >= 0, f"{kid!r}: bytes {entry.nbytes}, actual {size}"
            for s in entry.chunks.values():
                assert self.pool.is_live(s.handle), f"{kid!r} holds a freed slot"
            if entry.binding is not None:
                assert entry.binding.active and entry.binding.entry is entry
            assert entry.chunks or entry.binding is not None or entry.open_batches, (
                f"{kid!r} is idle"
            )
            assert (kid in self._delivered) == bool(entry.delivery_id), f"{kid!r}: delivered?"
            if entry.delivery_id:
                pages = sum(self.pool.pages_for(s.handle.nbytes) for s in entry.chunks.values())
                assert entry.pages == pages, f"{kid!r}: pages {entry.pages}, actual {pages}"
                assert entry.binding is None or entry.binding.redelivery
            if entry.committed_at is not None:
                assert entry.deadline is not None and entry.chunks
            for batch in entry.open_batches:
                assert batch in self._open_batches and not batch.done and batch.failed is None
                for s in batch.pending.values():
                    assert self.pool.is_live(s.handle), f"{kid!r}: a batch holds a freed slot"
                    pending += s.handle.nbytes
                handles = [s.handle for s in batch.pending.values()] + list(batch.filling)
                held = sum(self.pool.pages_for(h.nbytes) for h in handles)
                assert held == batch.held_pages <= self.max_batch_pages, f"{kid!r}: held pages"
            committed += size
        assert len(self._open_batches) == sum(len(e.open_batches) for e in self._entries.values())
        for handle in self._filling:
            assert self.pool.is_live(handle), "a slot being filled was freed under its thread"
            pending += handle.nbytes
        assert all(kid in self._entries for kid in self._delivered)
        bound_delivered = [e for e in self._delivered.values() if e.binding is not None]
        assert len(bound_delivered) == self._redelivering, "redelivering count is off"
        evictable = sum(e.pages for e in self._delivered.values() if e.binding is None)
        assert evictable == self._evictable_pages, "evictable pages are off"
        assert committed == self._parked_bytes >= 0, "parked bytes are off"
        assert pending == self._pending_bytes >= 0, "pending bytes are off"
        assert self.pool.statistics().stored_bytes == committed + pending, (
            "pool holds bytes no id or batch owns"
        )
        assert len(self._tombstones) <= self.settings.max_tombstones
        assert len(self._intents) <= self.settings.max_tombstones
        assert all(math.isfinite(t.at) for t in self._tombstones.values())


def _out_of_range(chunk_id: int, total: int) -> str:
    """Why `chunk_id` can never be stored or served under an id whose total is `total` (0:
    none known yet, so only the id space bounds it)."""
    why = f"total_chunks is {total}" if total else f"chunk ids stop at {MAX_CHUNKS - 1}"
    return f"chunk_id {chunk_id} out of range: {why}"


def _fingerprint_mismatch(held_as: str, held: bytes | None, given_as: str, given: bytes) -> str:
    """Why fingerprint `given` does not match the one an id holds (`held`; None: not fixed
    yet, so anything matches), or "" when it does."""
    if held is None or held == given:
        return ""
    return (
        f"fingerprint mismatch: {held_as} is {shown_fingerprint(held)}, "
        f"{given_as} is {shown_fingerprint(given)}"
    )
