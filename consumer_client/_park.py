"""One Park batch's logic, shared by the sync and the async parker: no I/O, no gRPC calls.

A batch on the wire is a `ParkHeader`, `Chunk`s and a `ParkCommit` that names how many chunks
and bytes were sent; the producer makes the batch visible only through that commit, so a
parker that fails half-way leaves nothing behind (docs/protocol.md, "Park"). This module builds
those frames (the CRC32C of every chunk computed here, over the caller's memory, without
copying it first), keeps the counts the commit must carry, turns the producer's answer into a
`ParkResult`, and decides whether a refusal is worth retrying within the call's time.

Chunks come as a sequence of buffers (chunk id = position), as `(chunk_id, buffer)` pairs, or
as a mapping of chunk id to buffer. A buffer may be one buffer or a list of buffers sent as one
chunk (a gather list: a chunk that is several pieces of a paged KV cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.fingerprints import fingerprint_problem
from kvpark.ids import MAX_CHUNKS
from kvpark.pb import kvpark_pb2 as pb

from ._buffers import byte_view
from ._errors import StatusRule, UsageError, classify_status, error_for
from ._result import Reason
from ._shm import ShmAccess, lend_refused
from ._timeouts import OUT_OF_BAND_SHARE
from .handle import TRANSPORT_NAMES, KVHandle

# POOL_FULL retries back off from this wait, doubling, never beyond the producer's
# retry_after_s: that is its estimate of when a lease ends, but room also frees sooner (a
# release, a confirmed delivery, a batch undone), and a short first wait catches that. It is
# also the shortest wait, even where retry_after_s is shorter (a reap_interval_s below it).
FIRST_RETRY_WAIT_S = 0.05
# A POOL_FULL retry starts only if it leaves the call at least this long before the deadline:
# a retry with only a few milliseconds would end DEADLINE_EXCEEDED and turn the truthful
# answer (the pool stayed full) into a TIMEOUT.
RETRY_CALL_BUDGET_S = 0.1
# A Park message over shared memory names up to 64 chunks and 16 MiB: the producer copies each
# message's chunks in one job on a worker thread, so its per-message cost (a gRPC read, a
# thread hand-off) is paid once per group instead of once per chunk, while several groups
# still copy at once and a refusal still stops a large batch early.
REFS_PER_MESSAGE = 64
REFS_MESSAGE_BYTES = 16 * 2**20

ChunkPayload = Any  # a buffer, or a list/tuple of buffers sent as one chunk
Chunks = Sequence[ChunkPayload] | Sequence[tuple[int, ChunkPayload]] | Mapping[int, ChunkPayload]


@dataclass(frozen=True, slots=True)
class PreparedChunk:
    chunk_id: int
    parts: tuple[memoryview, ...]
    nbytes: int


def prepare(chunk_id: object, payload: ChunkPayload) -> PreparedChunk:
    """One chunk's id checked and its memory viewed as bytes, without copying."""
    if isinstance(chunk_id, bool) or not isinstance(chunk_id, int):
        raise UsageError(f"chunk id: expected an int, got {chunk_id!r}")
    if not 0 <= chunk_id < MAX_CHUNKS:
        raise UsageError(f"chunk id {chunk_id} is not a chunk id (0..2**32-2)")
    pieces = payload if isinstance(payload, list | tuple) else [payload]
    parts = tuple(byte_view(p, f"chunk {chunk_id}", writable=False).data for p in pieces)
    nbytes = sum(len(p) for p in parts)
    if nbytes == 0:
        raise UsageError(f"chunk {chunk_id} is empty")
    return PreparedChunk(chunk_id, parts, nbytes)


def prepare_all(chunks: Chunks) -> list[PreparedChunk]:
    """Every chunk of a `park()` call, checked: ids unique, payloads non-empty buffers."""
    if isinstance(chunks, str | bytes | bytearray | memoryview):
        raise UsageError("chunks: expected a sequence of chunk buffers or (chunk_id, buffer) pairs")
    if isinstance(chunks, Mapping):
        items: Iterable[tuple[object, ChunkPayload]] = chunks.items()
    else:
        items = (_as_pair(i, item) for i, item in enumerate(chunks))
    prepared = [prepare(cid, payload) for cid, payload in items]
    if not prepared:
        raise UsageError("chunks: empty")
    ids = [p.chunk_id for p in prepared]
    if len(set(ids)) != len(ids):
        raise UsageError("chunks: a chunk id appears twice")
    return prepared


def _as_pair(index: int, item: Any) -> tuple[object, ChunkPayload]:
    """`(chunk_id, buffer)` when the item is such a pair, else `(index, item)`."""
    if (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], int)
        and not isinstance(item[0], bool)
    ):
        return item[0], item[1]
    return index, item


@dataclass(frozen=True, slots=True)
class ShmPlan:
    """How a `park()` goes over shared memory: the lend its header names, each chunk's offset
    in that buffer, and whether the client staged (copied) the chunks there."""

    lend_id: str
    offsets: list[int]
    staged: bool


def plan_shm(shm: ShmAccess, chunks: list[PreparedChunk], outcome: ParkOutcome) -> ShmPlan | None:
    """Chunks that all lie in one lent buffer go by reference; otherwise they are copied into
    a lent staging buffer. None when shared memory cannot be used. The lends still to be made
    share one allowance, a quarter of what is left of the park's time, so that however many
    buffers the chunks lie in, a lending socket that does not answer leaves the park most of
    its time for the gRPC stream."""
    left = outcome.remaining_s()
    lends_end = None if left is None else time.monotonic() + left * OUT_OF_BAND_SHARE

    def lend_s() -> float | None:
        return None if lends_end is None else max(0.0, lends_end - time.monotonic())

    found = [shm.lend_of(c.parts[0], lend_s()) if len(c.parts) == 1 else None for c in chunks]
    lend_ids = {f[0] for f in found if f is not None}
    if None not in found and len(lend_ids) == 1:
        return ShmPlan(lend_ids.pop(), [f[2] for f in found if f is not None], staged=False)
    staged = shm.staging(sum(c.nbytes for c in chunks), lend_s())
    if staged is None:
        return None
    lend_id, view, _buffer = staged
    offsets, pos = [], 0
    for chunk in chunks:
        offsets.append(pos)
        for part in chunk.parts:  # the staging copy: memory that is not in a shared buffer
            view[pos : pos + len(part)] = part
            pos += len(part)
    return ShmPlan(lend_id, offsets, staged=True)


def batch_frames(
    frames: ParkFrames, chunks: list[PreparedChunk], plan: ShmPlan | None
) -> Iterator[bytes]:
    """Every frame of one `park()` call: header, chunks (inline or by reference), commit."""
    yield frames.header
    if plan is None:
        yield from (frames.chunk(chunk) for chunk in chunks)
    else:
        group: list[tuple[PreparedChunk, int]] = []
        group_bytes = 0
        for chunk, offset in zip(chunks, plan.offsets, strict=True):
            if group and group_bytes + chunk.nbytes > REFS_MESSAGE_BYTES:
                yield frames.chunk_refs(group)
                group, group_bytes = [], 0
            group.append((chunk, offset))
            group_bytes += chunk.nbytes
            if len(group) == REFS_PER_MESSAGE:
                yield frames.chunk_refs(group)
                group, group_bytes = [], 0
        if group:
            yield frames.chunk_refs(group)
    yield frames.commit()


def crc_of(chunk: PreparedChunk) -> int:
    crc = 0
    for part in chunk.parts:
        crc = crc32c_of(part, crc)
    return crc


def check_total(total_chunks: int | None) -> int:
    if total_chunks is None:
        return 0
    if isinstance(total_chunks, bool) or not isinstance(total_chunks, int):
        raise UsageError(f"total_chunks: expected an int or None, got {total_chunks!r}")
    if not 1 <= total_chunks <= MAX_CHUNKS:
        raise UsageError(f"total_chunks: expected 1..2**32-1, got {total_chunks}")
    return total_chunks


def check_fingerprint(fingerprint: bytes | None) -> bytes:
    if fingerprint is None:
        return b""
    problem = fingerprint_problem(fingerprint)
    if problem is not None:
        raise UsageError(f"fingerprint: {problem}")
    return bytes(fingerprint)


def check_batch_bytes(batch_bytes: int) -> int:
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 0:
        raise UsageError(f"batch_bytes: expected an int >= 0, got {batch_bytes!r}")
    return batch_bytes


class ParkFrames:
    """The frames of one batch, and the counts its commit must carry. With a `lend_id`, the
    header names a buffer this client lent, and chunks in it go as ChunkRefs."""

    def __init__(
        self,
        kv_request_id: str,
        total_chunks: int,
        batch_bytes: int,
        lend_id: str = "",
        fingerprint: bytes = b"",
    ) -> None:
        self.kv_request_id = kv_request_id
        self.total_chunks = total_chunks
        self.batch_bytes = batch_bytes
        self.lend_id = lend_id
        self.fingerprint = fingerprint
        self.chunks = 0
        self.nbytes = 0

    @property
    def header(self) -> bytes:
        header = pb.ParkHeader(
            kv_request_id=self.kv_request_id,
            total_chunks=self.total_chunks,
            batch_bytes=self.batch_bytes,
            shm_lend_id=self.lend_id,
            fingerprint=self.fingerprint,
        )
        return pb.ParkRequest(header=header).SerializeToString()

    def chunk(self, chunk: PreparedChunk, crc: int | None = None) -> bytes:
        """A chunk's frame: its CRC32C (`crc`, when taken before, else now over the caller's
        memory), then one copy into the frame."""
        self.count(chunk)
        crc = crc_of(chunk) if crc is None else crc
        return wire.encode_park_chunk(chunk.chunk_id, crc, chunk.parts)

    def count(self, chunk: PreparedChunk) -> None:
        """Counts a chunk this batch sends, for the commit."""
        self.chunks += 1
        self.nbytes += chunk.nbytes

    def chunk_refs(
        self, placed: Sequence[tuple[PreparedChunk, int]], crcs: Sequence[int] | None = None
    ) -> bytes:
        """Chunks already in the lent buffer, each at its offset: only where they are and
        their CRC32C (`crcs`, when computed before, else now)."""
        refs = pb.ChunkRefs()
        for i, (chunk, offset) in enumerate(placed):
            self.count(chunk)
            crc = crc_of(chunk) if crcs is None else crcs[i]
            refs.refs.add(chunk_id=chunk.chunk_id, crc32c=crc, offset=offset, nbytes=chunk.nbytes)
        return pb.ParkRequest(chunk_refs=refs).SerializeToString()

    def commit(self) -> bytes:
        return wire.encode_park_commit(self.chunks, self.nbytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParkResult:
    """The outcome of one `park()` or one batch. Frozen. A refusal is a value like a failed
    load: `ok=False` and a `Reason` (POOL_FULL, TOO_LARGE, CHUNK_CONFLICT, REAPED, ...)."""

    kv_request_id: str
    ok: bool
    # None when ok; otherwise why the batch was refused (nothing of it was kept).
    reason: Reason | None
    # Human-readable detail (the producer's or the client's); never parse it.
    detail: str
    # The id's chunks and payload bytes on the producer after this batch (all batches).
    chunks_parked: int = 0
    bytes_parked: int = 0
    # The id's total chunk count, once declared or fixed by a commit; 0 when not known.
    total_chunks: int = 0
    # Seconds until the id's lease runs out, as of the answer.
    lease_remaining_s: float = 0.0
    # With POOL_FULL: when the producer expects room (the last answer's value).
    retry_after_s: float = 0.0
    # The producer process's epoch; a decode worker passes it as `expected_epoch`.
    producer_epoch: int = 0
    # host:port decode workers dial to reach this producer: the address it advertises, else
    # the one this parker dialed.
    producer: str = ""
    # What a Fetch of this id may use there, best first ("shm", "tcp", "grpc").
    transports: tuple[str, ...] = ("grpc",)
    # Park calls made (POOL_FULL is retried while the timeout allows) and wall time in all.
    attempts: int = 1
    elapsed_s: float = 0.0
    # The gRPC status the last call ended with when it ended with an error status.
    grpc_code: grpc.StatusCode | None = None
    # Which transport carried the bytes (for a call that ended with an error status: the one
    # it used).
    transport: str = "grpc"

    @property
    def handle(self) -> KVHandle:
        """Where the parked KV is, for the router to pass to a decode worker. Raises UsageError
        for a refused park: there is nothing to hand over."""
        if not self.ok:
            raise UsageError(f"no handle: parking {self.kv_request_id!r} failed ({self.reason})")
        if not self.producer:
            raise UsageError(
                "no handle: the parker's target names no host:port decode workers could dial; "
                "set the producer's advertise_address"
            )
        return KVHandle(
            kv_request_id=self.kv_request_id,
            producer=self.producer,
            producer_epoch=self.producer_epoch,
            num_chunks=self.total_chunks or self.chunks_parked,
            nbytes=self.bytes_parked,
            transports=self.transports or ("grpc",),
        )


class ParkOutcome:
    """Turns one Park call's ending into a ParkResult, and plans retries across calls."""

    def __init__(
        self,
        kv_request_id: str,
        deadline_s: float | None,
        clock: Callable[[], float],
        *,
        producer: str = "",
        noted: Callable[[ParkResult], None] | None = None,
    ) -> None:
        self.kv_request_id = kv_request_id
        # The parker's target, the address a handle names when the producer advertises none.
        self.producer = producer
        # Told every result made here, a `park()`'s and a `batch()`'s alike: what a call's
        # ending says of the producer (a new process) is learnt from either.
        self._noted = noted
        self._clock = clock
        self.started = clock()
        self._deadline = None if deadline_s is None else self.started + deadline_s
        self.attempts = 0

    def remaining_s(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - self._clock())

    def answered(self, reply: pb.ParkResponse, transport: str = "grpc") -> ParkResult:
        self.attempts += 1
        ok = reply.status == pb.STATUS_OK
        result = ParkResult(
            kv_request_id=self.kv_request_id,
            ok=ok,
            reason=None if ok else Reason.from_proto(reply.reason),
            detail=reply.detail,
            chunks_parked=reply.chunks_parked,
            bytes_parked=reply.bytes_parked,
            total_chunks=reply.total_chunks,
            lease_remaining_s=reply.lease_remaining_s,
            retry_after_s=reply.retry_after_s,
            producer_epoch=reply.producer_epoch,
            producer=reply.advertise_address or self.producer,
            transports=tuple(TRANSPORT_NAMES.get(t, "grpc") for t in reply.transports),
            attempts=self.attempts,
            elapsed_s=self._clock() - self.started,
            transport=transport,
        )
        return self._note(result)

    def failed(
        self, code: grpc.StatusCode | None, details: str, transport: str = "grpc"
    ) -> ParkResult:
        """The call ended with an error status: a value for transport failures, an exception
        for statuses that mean misuse or misconfiguration (as for loads). A refused lend is a
        value too: the caller sends the chunks again inline when it still can. `transport`:
        the one the call used."""
        self.attempts += 1
        rule = classify_status(code)
        if lend_refused(code, details):
            rule = StatusRule(code, Reason.RPC_ERROR, rule.error)
        elif rule.load_reason is None:
            raise error_for(code, details, f"Park {self.kv_request_id!r}")
        result = ParkResult(
            kv_request_id=self.kv_request_id,
            ok=False,
            reason=rule.load_reason,
            detail=details,
            producer=self.producer,
            attempts=self.attempts,
            elapsed_s=self._clock() - self.started,
            grpc_code=rule.code,
            transport=transport,
        )
        return self._note(result)

    def _note(self, result: ParkResult) -> ParkResult:
        if self._noted is not None:
            self._noted(result)
        return result

    def retry_wait_s(self, result: ParkResult) -> float | None:
        """Seconds to wait before trying again, or None to stop: only POOL_FULL is retried,
        and only when the wait still leaves the call RETRY_CALL_BUDGET_S within the deadline."""
        if result.reason is not Reason.POOL_FULL:
            return None
        backoff = FIRST_RETRY_WAIT_S * 2.0 ** (self.attempts - 1)
        wait = max(FIRST_RETRY_WAIT_S, min(backoff, result.retry_after_s))
        remaining = self.remaining_s()
        if remaining is not None and wait + RETRY_CALL_BUDGET_S > remaining:
            return None
        return wait


def monotonic() -> float:
    return time.monotonic()
