"""The parking lot: per-id state machine, leases, reaper, tombstones and KeepAlive intents.

Pure logic with an injectable clock and no gRPC: the servicer translates RPCs into calls here
and answers with the decisions returned. Everything runs on one thread (the server's event
loop), so there are no locks; the only outward hook is a `notify` callback a bound Fetch gives,
called when something it may be waiting for changes.

Life of an id (spec §3):

    (unknown) --Park--> PARKED --Fetch--> BOUND --all sent--> tombstone ALREADY_CONSUMED
    (unknown) --Fetch--> BOUND (a demand: chunks stream as Parks deliver them)
    BOUND --cancel / wait timeout--> PARKED again with the old lease (or gone, if no chunks)
    PARKED --lease runs out--> tombstone REAPED;  PARKED --Release--> tombstone RELEASED
    any --shutdown--> tombstone SHUTTING_DOWN

The long-lived tables (who adds, who removes, what cleans up leftovers):

- `_entries: id -> _Entry` — live ids. Added by the first Park batch or a Fetch before any
  Park; removed when the id ends (consumed, reaped, released, shut down) or when it holds no
  chunk and nothing is attached any more (a failed first batch, a cancelled demand).
- `_leases: LeaseQueue of (deadline, seq, entry)` — one item per lease deadline ever set for a
  PARKED id; stale items (id bound, ended, deadline moved later, or superseded by a later push
  for the same entry, see `_Entry.lease_seq`) are skipped when popped, and
  the heap is rebuilt when stale items outnumber live ones, so a reaper pass costs
  O(expired · log n) and the heap stays O(parked).
- `_tombstones: id -> _Tombstone`, insertion-ordered = time-ordered. Added when an id ends;
  pruned from the front after `tombstone_retention_s` and past `max_tombstones`, on every
  reaper pass whether or not anything is parked.
- `_intents: id -> deadline` for KeepAlive on ids not parked yet, plus `_intent_heap` for
  expiry. Consumed by the id's first chunk; pruned at their deadline and capped at
  `max_tombstones` (oldest first), so KeepAlive cannot grow memory without bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvpark.checksum import crc32c_of
from kvpark.pb import kvpark_pb2 as pb

from .leases import LeaseQueue
from .pool import HostPool, Reservation, SlotHandle

Clock = Callable[[], float]
Notify = Callable[[], None]
# A value of the contract's FailureReason enum.
Reason = pb.FailureReason

# Reasons (values of the contract's FailureReason enum).
REAPED = pb.REASON_REAPED
UNKNOWN_ID = pb.REASON_UNKNOWN_ID
ALREADY_CONSUMED = pb.REASON_ALREADY_CONSUMED
RELEASED = pb.REASON_RELEASED
ALREADY_BOUND = pb.REASON_ALREADY_BOUND
POOL_FULL = pb.REASON_POOL_FULL
TOO_LARGE = pb.REASON_TOO_LARGE
WAIT_TIMEOUT = pb.REASON_WAIT_TIMEOUT
EPOCH_MISMATCH = pb.REASON_EPOCH_MISMATCH
SHUTTING_DOWN = pb.REASON_SHUTTING_DOWN
CHUNK_CONFLICT = pb.REASON_CHUNK_CONFLICT
CHECKSUM_MISMATCH = pb.REASON_CHECKSUM_MISMATCH

# Heap rebuild threshold: stale lease items beyond live ids plus this slack trigger a rebuild.
_HEAP_SLACK = 1024


def reason_name(reason: Reason) -> str:
    return str(pb.FailureReason.Name(reason)) if reason else "REASON_UNSPECIFIED"


class MalformedRequest(ValueError):
    """A request that breaks the contract's shape (maps to INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class LotSettings:
    """The lot's share of the producer configuration (seconds and counts)."""

    unbound_store_timeout_s: float = 60.0
    tombstone_retention_s: float = 60.0
    max_lease_s: float = 600.0
    max_fetch_wait_s: float = 30.0
    max_tombstones: int = 1_000_000
    reap_interval_s: float = 0.25


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


@dataclass(eq=False, slots=True)
class _Entry:
    kv_request_id: str
    created_at: float
    chunks: dict[int, _Stored] = field(default_factory=dict)
    total_chunks: int = 0
    nbytes: int = 0
    first_chunk_at: float | None = None
    lease_deadline: float | None = None  # None until the first chunk
    # seq of the one `_leases` item that is live for this entry; older items are stale even if
    # their deadline matches (a cancelled Fetch re-arms the same deadline).
    lease_seq: int = -1
    intent_deadline: float = 0.0  # KeepAlive before the first chunk
    binding: FetchBinding | None = None
    open_batches: list[ParkBatch] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class ParkBatch:
    """One Park call in progress. Chunks it stored are undone if it fails (all-or-nothing)."""

    entry: _Entry
    reservation: Reservation | None
    stored_ids: list[int] = field(default_factory=list)
    # Chunks this batch sent again with identical bytes while another open batch of the id
    # owned them: it relies on them, so their owner's failure hands them to it (not frees them)
    # and its own success commits them.
    matched_ids: list[int] = field(default_factory=list)
    chunks_received: int = 0
    failed: Refusal | None = None
    done: bool = False
    # Set when a Fetch consumed the id while this batch was open: what it parked was
    # delivered, so its stream may still end well (chunks sent after that are refused).
    consumed: ParkDone | None = None


@dataclass(eq=False, slots=True)
class FetchBinding:
    """A Fetch attached to an id. `requested` None = all chunks, in order 0..total-1."""

    entry: _Entry
    requested: list[int] | None
    wait_deadline: float
    notify: Notify
    bound_at: float
    # Seconds from the id's first chunk to this bind; None for a fetch before any chunk.
    time_to_fetch_s: float | None
    cursor: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    failed: Refusal | None = None
    active: bool = True


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
    """The stream is over: `refusal` None means every requested chunk was sent."""

    refusal: Refusal | None
    chunks_sent: int
    bytes_sent: int


@dataclass(frozen=True, slots=True)
class ParkDone:
    chunks_parked: int
    lease_remaining_s: float


@dataclass(frozen=True, slots=True)
class IdStatus:
    kv_request_id: str
    state: pb.State
    reason: Reason = pb.REASON_UNSPECIFIED
    chunks_parked: int = 0
    total_chunks: int = 0
    nbytes: int = 0
    age_s: float = 0.0
    lease_remaining_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Tombstone:
    """Why and when an id ended. Immutable, so the ids ended together share one."""

    reason: Reason
    at: float


@dataclass(frozen=True, slots=True)
class LotStatistics:
    parked_ids: int
    bound_ids: int
    tombstones: int
    intents: int
    parked_bytes: int
    reaped_total: int
    consumed_total: int
    released_total: int
    late_fetch_rejections_total: int
    late_park_rejections_total: int
    parked_bytes_total: int
    shutting_down: bool


class Lot:
    def __init__(self, pool: HostPool, settings: LotSettings, epoch: int, clock: Clock) -> None:
        self.pool = pool
        self.settings = settings
        self.epoch = epoch
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._leases: LeaseQueue[_Entry] = LeaseQueue()
        self._seq = itertools.count()
        self._tombstones: OrderedDict[str, _Tombstone] = OrderedDict()
        self._intents: OrderedDict[str, float] = OrderedDict()
        self._intent_heap: list[tuple[float, str]] = []
        self._bound = 0
        self._parked_bytes = 0
        self._shutting_down = False
        self.reaped_total = 0
        self.consumed_total = 0
        self.released_total = 0
        self.late_fetch_rejections_total = 0
        self.late_park_rejections_total = 0
        self.parked_bytes_total = 0

    # =================================================================================== Park
    def begin_park(
        self, kv_request_id: str, total_chunks: int, batch_bytes: int
    ) -> ParkBatch | Refusal:
        """Opens a batch for `kv_request_id` (spec §3 Park steps 1-2)."""
        now = self.clock()
        if self._shutting_down:
            return Refusal(SHUTTING_DOWN, "producer is shutting down")
        tomb = self._tombstones.get(kv_request_id)
        if tomb is not None:
            self.late_park_rejections_total += 1
            return Refusal(tomb.reason, self._tomb_detail(tomb, now), late=True)
        if batch_bytes and not self.pool.fits_ever(batch_bytes):
            return Refusal(
                TOO_LARGE,
                f"batch of {batch_bytes} bytes exceeds the {self.pool.pool_bytes}-byte pool",
            )
        entry = self._entries.get(kv_request_id)
        if entry is not None and total_chunks:
            conflict = self._total_conflict(entry, total_chunks)
            if conflict:
                return Refusal(CHUNK_CONFLICT, conflict)
        reservation = None
        if batch_bytes:
            reservation = self.pool.reserve(batch_bytes)
            if reservation is None:
                return Refusal(
                    POOL_FULL,
                    f"batch of {batch_bytes} bytes, {self.pool.free_bytes} bytes free",
                    retry_after_s=self._retry_after(now),
                )
        if entry is None:
            entry = _Entry(kv_request_id, created_at=now)
            self._entries[kv_request_id] = entry
        if total_chunks:
            self._set_total(entry, total_chunks)
        batch = ParkBatch(entry, reservation)
        entry.open_batches.append(batch)
        return batch

    def park_chunk(
        self, batch: ParkBatch, chunk_id: int, data: memoryview, crc32c: int
    ) -> Refusal | None:
        """Stores one chunk of an open batch; a refusal has already undone the whole batch.

        Raises MalformedRequest (after undoing the batch) for a chunk the contract forbids."""
        if batch.failed is not None:
            return batch.failed
        entry = batch.entry
        batch.chunks_received += 1
        if not data:
            self.abort_park(batch)
            raise MalformedRequest(f"chunk {chunk_id} has no data")
        if entry.total_chunks and chunk_id >= entry.total_chunks:
            self.abort_park(batch)
            raise MalformedRequest(
                f"chunk_id {chunk_id} out of range: total_chunks is {entry.total_chunks}"
            )
        actual = crc32c_of(data)
        if crc32c and actual != crc32c:
            return self._fail_batch(
                batch,
                Refusal(
                    CHECKSUM_MISMATCH,
                    f"chunk {chunk_id}: crc32c {actual:#010x}, header says {crc32c:#010x}",
                ),
            )
        existing = entry.chunks.get(chunk_id)
        if existing is not None:
            if existing.crc32c == actual and self.pool.equals(existing.handle, data):
                batch.matched_ids.append(chunk_id)
                return None  # the same bytes again: idempotent
            return self._fail_batch(
                batch, Refusal(CHUNK_CONFLICT, f"chunk {chunk_id} was parked with other bytes")
            )
        handle = self.pool.store(data, batch.reservation)
        if handle is None:
            now = self.clock()
            return self._fail_batch(
                batch,
                Refusal(
                    POOL_FULL,
                    f"pool full at chunk {chunk_id} ({len(data)} bytes)",
                    self._retry_after(now),
                ),
            )
        entry.chunks[chunk_id] = _Stored(handle, actual)
        batch.stored_ids.append(chunk_id)
        entry.nbytes += len(data)
        self._parked_bytes += len(data)
        self.parked_bytes_total += len(data)
        if entry.first_chunk_at is None:
            self._start_lease(entry)
        if entry.binding is not None:
            entry.binding.notify()
        return None

    def finish_park(self, batch: ParkBatch) -> ParkDone | Refusal:
        """Closes a batch whose stream ended normally."""
        if batch.consumed is not None:
            return batch.consumed
        if batch.failed is not None:
            return batch.failed
        entry = batch.entry
        if batch.matched_ids:  # acknowledged now: no other open batch may undo them any more
            matched = set(batch.matched_ids)
            for other in entry.open_batches:
                if other is not batch:
                    other.stored_ids = [c for c in other.stored_ids if c not in matched]
        self._close_batch(batch)
        if not entry.chunks:
            self._drop_if_idle(entry)
        return ParkDone(len(entry.chunks), self._lease_remaining(entry, self.clock()))

    def expire_park(self, batch: ParkBatch, idle_s: float) -> Refusal:
        """Undoes a batch whose stream sent nothing for `idle_s`: a stuck uploader must not
        hold its reservation and chunks for ever (no lease runs while a batch is open)."""
        if batch.failed is not None:
            return batch.failed
        detail = f"Park batch sent nothing for {idle_s:g}s (unbound_store_timeout_s); undone"
        return self._fail_batch(batch, Refusal(REAPED, detail))

    def abort_park(self, batch: ParkBatch) -> None:
        """Undoes a batch whose stream broke (cancel, malformed message): all-or-nothing."""
        if batch.failed is None and not batch.done:
            self._fail_batch(batch, Refusal(pb.REASON_UNSPECIFIED, "batch aborted"))

    def _fail_batch(self, batch: ParkBatch, refusal: Refusal) -> Refusal:
        entry = batch.entry
        for chunk_id in batch.stored_ids:
            heir = next(
                (b for b in entry.open_batches if b is not batch and chunk_id in b.matched_ids),
                None,
            )
            if heir is not None:  # another open batch sent the same bytes: the chunk is its now
                heir.matched_ids.remove(chunk_id)
                heir.stored_ids.append(chunk_id)
                continue
            stored = entry.chunks.pop(chunk_id, None)
            if stored is not None:
                self._free_chunk(entry, stored)
        batch.stored_ids.clear()
        batch.failed = refusal
        self._close_batch(batch)
        self._drop_if_idle(entry)
        return refusal

    def _close_batch(self, batch: ParkBatch) -> None:
        batch.done = True
        if batch.reservation is not None:
            self.pool.close_reservation(batch.reservation)
        if batch in batch.entry.open_batches:
            batch.entry.open_batches.remove(batch)

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

    def _start_lease(self, entry: _Entry) -> None:
        now = self.clock()
        s = self.settings
        entry.first_chunk_at = now
        intent = max(entry.intent_deadline, self._intents.pop(entry.kv_request_id, 0.0))
        # Kept on the entry: if this first batch fails, the id is unparked again and
        # `_drop_if_idle` puts the intent back.
        entry.intent_deadline = intent
        entry.lease_deadline = min(
            max(now + s.unbound_store_timeout_s, intent), now + s.max_lease_s
        )
        if entry.binding is None:
            self._push_lease(entry)

    def _retry_after(self, now: float) -> float:
        """When memory may free up: the next lease deadline, at least one reaper interval."""
        floor = self.settings.reap_interval_s
        nxt = self.next_lease_deadline()
        if nxt is not None:
            return max(floor, nxt - now)
        return max(floor, 1.0)

    # ================================================================================== Fetch
    def bind_fetch(
        self,
        kv_request_id: str,
        chunk_ids: Sequence[int],
        expected_epoch: int,
        wait_timeout_s: float,
        notify: Notify,
    ) -> FetchBinding | Refusal:
        """Attaches a Fetch (spec §3 Fetch steps 1-4). Raises MalformedRequest for bad chunk_ids."""
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
        if requested is not None and len(set(requested)) != len(requested):
            raise MalformedRequest("chunk_ids repeats a chunk")
        entry = self._entries.get(kv_request_id)
        if entry is not None:
            if entry.binding is not None:
                return Refusal(ALREADY_BOUND, "another Fetch is attached to this id")
            if (
                requested is not None
                and entry.total_chunks
                and max(requested) >= entry.total_chunks
            ):
                raise MalformedRequest(
                    f"chunk_id {max(requested)} out of range: total_chunks is {entry.total_chunks}"
                )
        else:
            entry = _Entry(kv_request_id, created_at=now)
            self._entries[kv_request_id] = entry
        wait = self.settings.max_fetch_wait_s
        if wait_timeout_s > 0:
            wait = min(wait, wait_timeout_s)
        ttf = None if entry.first_chunk_at is None else now - entry.first_chunk_at
        binding = FetchBinding(entry, requested, now + wait, notify, now, ttf)
        entry.binding = binding
        self._bound += 1
        return binding

    def next_for(self, binding: FetchBinding) -> ReadyChunk | FetchWait | FetchEnd:
        """What a bound Fetch does next. A ReadyChunk's views must be copied before the next
        call into the lot: the following call may free them."""
        if binding.failed is not None or not binding.active:
            return self._end(
                binding, binding.failed or Refusal(pb.REASON_UNSPECIFIED, "fetch detached")
            )
        entry = binding.entry
        if binding.requested is not None:
            order_len = len(binding.requested)
            next_id = binding.requested[binding.cursor] if binding.cursor < order_len else None
        else:
            order_len = entry.total_chunks  # 0 while unknown: keep streaming 0, 1, 2, ...
            next_id = binding.cursor if not order_len or binding.cursor < order_len else None
        if next_id is None:
            return self._complete(binding)
        stored = entry.chunks.get(next_id)
        if stored is None:
            return FetchWait(binding.wait_deadline)
        views = self.pool.views(stored.handle)  # raises StaleSlotError, never reads freed memory
        binding.cursor += 1
        binding.chunks_sent += 1
        binding.bytes_sent += stored.handle.nbytes
        return ReadyChunk(next_id, stored.crc32c, views, stored.handle.nbytes)

    def fetch_wait_expired(self, binding: FetchBinding) -> FetchEnd:
        """The Fetch waited its whole wait time for chunks that were not parked."""
        if binding.failed is not None:  # the id ended meanwhile (shutdown): that is the cause
            return self._end(binding, binding.failed)
        missing = self._first_missing(binding)
        return self._end(binding, Refusal(WAIT_TIMEOUT, f"chunk {missing} not parked in time"))

    def cancel_fetch(self, binding: FetchBinding) -> None:
        """The consumer went away: the id is PARKED again with its old lease (spec §3 Fetch 5)."""
        if binding.active:
            self._detach(binding)

    def _first_missing(self, binding: FetchBinding) -> int:
        if binding.requested is not None:
            return binding.requested[binding.cursor]
        return binding.cursor

    def _complete(self, binding: FetchBinding) -> FetchEnd:
        entry = binding.entry
        binding.active = False
        entry.binding = None
        self._bound -= 1
        self._end_entry(entry, ALREADY_CONSUMED)
        self.consumed_total += 1
        return FetchEnd(None, binding.chunks_sent, binding.bytes_sent)

    def _end(self, binding: FetchBinding, refusal: Refusal) -> FetchEnd:
        if binding.active:
            self._detach(binding)
        return FetchEnd(refusal, binding.chunks_sent, binding.bytes_sent)

    def _detach(self, binding: FetchBinding) -> None:
        binding.active = False
        entry = binding.entry
        if entry.binding is binding:
            entry.binding = None
            self._bound -= 1
            if entry.lease_deadline is not None and self._entries.get(entry.kv_request_id) is entry:
                self._push_lease(entry)
            self._drop_if_idle(entry)

    # ============================================================================ KeepAlive etc
    def keep_alive(self, kv_request_ids: Iterable[str], extend_s: float) -> list[IdStatus]:
        now = self.clock()
        s = self.settings
        extend = min(extend_s if extend_s > 0 else s.unbound_store_timeout_s, s.max_lease_s)
        wanted = now + extend
        for kid in kv_request_ids:
            entry = self._entries.get(kid)
            if entry is None:
                if kid not in self._tombstones and wanted > self._intents.get(kid, 0.0):
                    self._intents[kid] = wanted
                    self._intents.move_to_end(kid)
                    heapq.heappush(self._intent_heap, (wanted, kid))
                    self._cap_intents()
            elif entry.first_chunk_at is None:
                entry.intent_deadline = max(entry.intent_deadline, wanted)
            else:
                assert entry.lease_deadline is not None
                new = min(wanted, entry.first_chunk_at + s.max_lease_s)
                if new > entry.lease_deadline:
                    entry.lease_deadline = new
                    if entry.binding is None:
                        self._push_lease(entry)
        return self.lookup(kv_request_ids)

    def release(self, kv_request_id: str) -> Refusal | None:
        """Frees a parked id and tombstones it RELEASED; None means it was released."""
        now = self.clock()
        entry = self._entries.get(kv_request_id)
        if entry is None:
            tomb = self._tombstones.get(kv_request_id)
            self._intents.pop(kv_request_id, None)
            if tomb is not None:
                return Refusal(tomb.reason, self._tomb_detail(tomb, now))
            return Refusal(UNKNOWN_ID, "no such id")
        if entry.binding is not None:
            return Refusal(ALREADY_BOUND, "a Fetch is streaming this id")
        self._end_entry(entry, RELEASED)
        self.released_total += 1
        return None

    def lookup(self, kv_request_ids: Iterable[str]) -> list[IdStatus]:
        now = self.clock()
        return [self._status(kid, now) for kid in kv_request_ids]

    def _status(self, kid: str, now: float) -> IdStatus:
        entry = self._entries.get(kid)
        if entry is not None:
            state = pb.STATE_BOUND if entry.binding is not None else pb.STATE_PARKED
            since = entry.first_chunk_at if entry.first_chunk_at is not None else entry.created_at
            return IdStatus(
                kid,
                state,
                chunks_parked=len(entry.chunks),
                total_chunks=entry.total_chunks,
                nbytes=entry.nbytes,
                age_s=now - since,
                lease_remaining_s=self._lease_remaining(entry, now),
            )
        tomb = self._tombstones.get(kid)
        if tomb is not None:
            return IdStatus(kid, pb.STATE_TOMBSTONED, tomb.reason, age_s=now - tomb.at)
        intent = self._intents.get(kid)
        remaining = max(0.0, intent - now) if intent is not None else 0.0
        return IdStatus(kid, pb.STATE_UNKNOWN, lease_remaining_s=remaining)

    def _lease_remaining(self, entry: _Entry, now: float) -> float:
        if entry.binding is not None or entry.lease_deadline is None:
            return 0.0
        return max(0.0, entry.lease_deadline - now)

    # ================================================================================= Reaper
    def reap(self) -> list[str]:
        """One reaper pass: frees PARKED ids past their lease, prunes tombstones and intents.

        Costs O(expired · log n): only heap items whose deadline has passed are touched."""
        now = self.clock()
        leases = self._leases
        live = self._lease_item_live
        # Ending an id never touches another id's lease item, so the live ones can be picked
        # first and ended together (one clock reading, one tombstone cap for the pass).
        expired = [item[2] for item in leases.pop_due(now) if live(item)]
        self._end_entries(expired, REAPED, now)
        self.reaped_total += len(expired)
        if len(leases) > 2 * (len(self._entries) + _HEAP_SLACK):
            leases.retain(live)
        self._prune(now)
        return [entry.kv_request_id for entry in expired]

    def _lease_item_live(self, item: tuple[float, int, _Entry]) -> bool:
        deadline, seq, entry = item
        return (
            entry.binding is None
            and entry.lease_seq == seq
            and entry.lease_deadline == deadline
            and self._entries.get(entry.kv_request_id) is entry
        )

    def _push_lease(self, entry: _Entry) -> None:
        assert entry.lease_deadline is not None
        entry.lease_seq = next(self._seq)
        self._leases.push(entry.lease_deadline, entry.lease_seq, entry)

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

    def next_lease_deadline(self) -> float | None:
        """The earliest live lease deadline (for scheduling the next pass), or None."""
        leases = self._leases
        while (head := leases.peek()) is not None and not self._lease_item_live(head):
            leases.pop()
        return head[0] if head is not None else None

    # ================================================================================ Endings
    def _end_entry(self, entry: _Entry, reason: Reason) -> None:
        """Frees an id's memory, fails what is attached to it, and tombstones it."""
        self._end_entries((entry,), reason, self.clock())

    def _end_entries(self, entries: Iterable[_Entry], reason: Reason, now: float) -> None:
        """`_end_entry` for each of `entries`, all ended at `now`.

        The reaper's ids are plain PARKED ones (no open batch, no bound Fetch), so those two
        attachments are handled out of line and the loop body is what every id needs; a
        reaper pass ends ~1k ids this way, so every lookup done once here counts."""
        free = self.pool.free
        by_id = self._entries
        intents = self._intents
        tombs = self._tombstones
        tomb = _Tombstone(reason, now)
        for entry in entries:
            kid = entry.kv_request_id
            if entry.open_batches:
                self._fail_open_batches(entry, reason)
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
            if intents:
                intents.pop(kid, None)
            if kid in tombs:  # never for a live id; a new key is inserted at the end anyway
                tombs.move_to_end(kid)
            tombs[kid] = tomb
        # Capping once after the inserts keeps the same (newest) tombstones as capping after
        # each one: inserts only ever go to the end.
        self._cap_tombstones()

    def _fail_open_batches(self, entry: _Entry, reason: Reason) -> None:
        """Fails the Park batches still open on an ending id (its chunks are freed by the
        caller, with the rest of the id)."""
        parked = len(entry.chunks)
        for batch in list(entry.open_batches):
            batch.stored_ids.clear()
            batch.failed = Refusal(reason, f"id ended: {reason_name(reason)}")
            if reason == ALREADY_CONSUMED:
                batch.consumed = ParkDone(parked, 0.0)
            self._close_batch(batch)

    def _fail_binding(self, entry: _Entry, binding: FetchBinding, reason: Reason) -> None:
        """Detaches the Fetch bound to an ending id and wakes it to report `reason`."""
        binding.failed = Refusal(reason, f"id ended: {reason_name(reason)}")
        entry.binding = None
        binding.active = False
        self._bound -= 1
        binding.notify()

    def _free_chunk(self, entry: _Entry, stored: _Stored) -> None:
        self.pool.free(stored.handle)
        entry.nbytes -= stored.handle.nbytes
        self._parked_bytes -= stored.handle.nbytes

    def _drop_if_idle(self, entry: _Entry) -> None:
        """Forgets an id that holds no chunk and has nothing attached (no tombstone: nothing
        was lost, a retry may start over)."""
        if (
            not entry.chunks
            and entry.binding is None
            and not entry.open_batches
            and self._entries.get(entry.kv_request_id) is entry
        ):
            del self._entries[entry.kv_request_id]
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
        """New Parks and Fetches are refused SHUTTING_DOWN; bound Fetches go on."""
        self._shutting_down = True

    def fail_all(self, reason: Reason = SHUTTING_DOWN) -> int:
        """Ends every live id with `reason` (what remains after the shutdown grace)."""
        entries = list(self._entries.values())
        self._end_entries(entries, reason, self.clock())
        return len(entries)

    @property
    def bound_count(self) -> int:
        return self._bound

    # ========================================================================== Observability
    def statistics(self) -> LotStatistics:
        return LotStatistics(
            parked_ids=len(self._entries) - self._bound,
            bound_ids=self._bound,
            tombstones=len(self._tombstones),
            intents=len(self._intents),
            parked_bytes=self._parked_bytes,
            reaped_total=self.reaped_total,
            consumed_total=self.consumed_total,
            released_total=self.released_total,
            late_fetch_rejections_total=self.late_fetch_rejections_total,
            late_park_rejections_total=self.late_park_rejections_total,
            parked_bytes_total=self.parked_bytes_total,
            shutting_down=self._shutting_down,
        )

    def check_invariants(self) -> None:
        """Raises AssertionError if the lot and the pool disagree or a counter went wrong."""
        self.pool.check_invariants()
        bound = sum(1 for e in self._entries.values() if e.binding is not None)
        assert bound == self._bound >= 0, f"bound count {self._bound}, actual {bound}"
        total = 0
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
            total += size
        assert total == self._parked_bytes >= 0, "parked bytes are off"
        assert self.pool.statistics().stored_bytes == total, "pool holds bytes no id owns"
        assert len(self._tombstones) <= self.settings.max_tombstones
        assert len(self._intents) <= self.settings.max_tombstones
        assert all(math.isfinite(t.at) for t in self._tombstones.values())
