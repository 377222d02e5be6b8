"""Where the chunks of a streaming Park batch (`KVParker.batch`) go, chunk by chunk: by
reference when a chunk lies in one of the parker's shared buffers (the producer copies it
from there, one copy per byte), inline in the call otherwise. Shared by the sync and the async
batch; no gRPC calls.

The header must name the lent buffer before the first chunk, and it goes out when the batch
starts, so that a refusal (RELEASED, POOL_FULL for `batch_bytes`) reaches the caller before it
produces any chunk. That works when the choice needs no chunk: a parker with no shared buffer
sends chunks inline, and one with a single shared buffer names that one. A parker with several
shared buffers (or, for the async parker, one that has not yet learnt the producer's epoch it
checks the socket against) learns which buffer the batch refers to only from the first `put`,
so its header goes with that chunk; chunks elsewhere go inline. Every lend a batch makes takes
at most a share of what is left of the batch's time (OUT_OF_BAND_SHARE), as for `park()`, so
a lending socket that does not answer leaves the batch most of its time for the gRPC stream;
once the batch knows which buffer its header names it lends no more (a chunk elsewhere could
not go by reference anyway). References go out in groups
of up to 64 chunks or 16 MiB, the last with the commit, as `park()` sends them: the
producer's cost is per message. A producer that does not
hold the lend (it restarted since the buffer was lent) refuses the header with
INVALID_ARGUMENT before taking any chunk, its detail saying so (`lend_refused`); the batch then
starts a new call and sends every chunk put so far inline (`inline`), so the fallback to the
gRPC stream happens within the batch, as for `park()`. Any other INVALID_ARGUMENT is the
batch's own fault, inline as much as by reference, so it is the batch's answer. Chunks that
went by reference are still in the caller's shared buffer then (a put from a shared buffer
asks the caller to leave those bytes alone until the commit).
A chunk that went inline is not kept (that memory is the caller's again once `put` returned),
so a batch that sent one reports the refusal instead (an RPC_ERROR result).
"""

from __future__ import annotations

import grpc

from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import SharedBuffer, find_shared

from ._park import (
    REFS_MESSAGE_BYTES,
    REFS_PER_MESSAGE,
    ParkFrames,
    ParkOutcome,
    ParkResult,
    PreparedChunk,
    crc_of,
    prepare,
)
from ._shm import ShmAccess, lend_refused
from ._timeouts import OUT_OF_BAND_SHARE

# Why a batch nothing was put in is not committed (it would park an id of no chunks).
EMPTY_BATCH = "a batch with no chunk put cannot be committed: put at least one chunk"
# Where a chunk goes by reference: the lend id, the lent buffer and the chunk's offset in it.
Place = tuple[str, SharedBuffer, int]


class BatchRoute:
    def __init__(
        self, frames: ParkFrames, shm: ShmAccess | None, outcome: ParkOutcome, *, can_lend: bool
    ) -> None:
        """`can_lend`: lending may start now (the producer's epoch is known, or unneeded);
        `lend_at_start` then lends the parker's only shared buffer."""
        self.frames = frames
        self._shm = shm
        self._outcome = outcome
        self._started = False
        self._chunks_put = 0  # `put` calls, those the producer had already ended included
        # The buffer the header's lend is of, once a chunk showed it: chunks in it go by
        # reference without asking the shm socket, chunks elsewhere inline.
        self._lent: SharedBuffer | None = None
        # Chunks sent by reference, to resend inline if the producer refuses the lend: views
        # of the caller's shared buffer, no copies, each with its CRC32C taken at `put`. A
        # chunk sent inline is not kept (its memory is the caller's again once `put`
        # returned), so after one the batch can no longer go inline and a refused lend is its
        # outcome.
        self._by_ref: list[tuple[PreparedChunk, int]] = []
        self._inline_sent = False
        # References put and not yet sent, with their CRC32C taken at `put` (what the caller
        # had then is what the producer checks): they go in groups, as `park()` sends them,
        # since the producer's cost is per message (a read, a copy job), not per chunk.
        self._group: list[tuple[PreparedChunk, int]] = []
        self._group_crcs: list[int] = []
        self._group_bytes = 0
        self.header_at_start: bytes | None = None  # the header, when it can go at once
        self.lends_at_start = False  # whether `lend_at_start` has a lend to try
        if shm is None or not shm.has_buffers:
            self.header_at_start = self.opening()
        else:
            self.lends_at_start = can_lend

    def lend_at_start(self) -> None:
        """Lends the parker's only shared buffer, so that the header names it and goes out at
        once (`header_at_start`); with several, the first chunk chooses. Blocking I/O on the
        shm socket."""
        if not self.lends_at_start or self._started or self._shm is None:
            return
        self.lends_at_start = False
        lend_id = self._shm.sole_lend(self._lend_s())
        if lend_id is not None:
            self.frames.lend_id = lend_id
            self.header_at_start = self.opening()

    def prepared(self, chunk_id: object, payload: object) -> PreparedChunk:
        """The chunk `put` was given, checked, and counted (`empty`)."""
        chunk = prepare(chunk_id, payload)
        self._chunks_put += 1
        return chunk

    @property
    def empty(self) -> bool:
        """Whether nothing was put in the batch. Committing it is misuse, as `park()` with no
        chunk is: it would park an id of no chunks, which nothing can load."""
        return not self._chunks_put

    def _lend_s(self) -> float | None:
        left = self._outcome.remaining_s()
        return None if left is None else left * OUT_OF_BAND_SHARE

    @property
    def transport(self) -> str:
        """What carried the batch's bytes: "shm" once a chunk went by reference."""
        return "shm" if self._by_ref and self.frames.lend_id else "grpc"

    def _shared(self, chunk: PreparedChunk) -> tuple[SharedBuffer, int] | None:
        """The shared buffer `chunk` lies in and its offset there, if it lies in one."""
        if self._shm is None or len(chunk.parts) != 1:
            return None
        found = find_shared(chunk.parts[0])
        return None if found is None else found[:2]

    def _chooses_lend(self) -> bool:
        """Whether a chunk may still decide which lent buffer the header names: before the
        header, or after a header named a lend whose buffer no chunk has shown yet."""
        return self._lent is None and (not self._started or bool(self.frames.lend_id))

    def may_lend(self, chunk: PreparedChunk) -> bool:
        """Whether `place_of(chunk)` may lend a buffer (blocking I/O on the shm socket)."""
        return self._chooses_lend() and self._shared(chunk) is not None

    def place_of(self, chunk: PreparedChunk) -> Place | None:
        """Where `chunk` goes by reference, or None: inline. While the batch has yet to learn
        which buffer its header names, this lends the chunk's buffer (`may_lend`), taking at
        most a share of what is left of the batch's time. Changes nothing in the route."""
        shared = self._shared(chunk)
        if shared is None:
            return None
        buffer, offset = shared
        if buffer is self._lent and self.frames.lend_id:
            return self.frames.lend_id, buffer, offset
        if not self._chooses_lend():
            return None
        assert self._shm is not None
        found = self._shm.lend_of(chunk.parts[0], self._lend_s())
        return None if found is None else (found[0], buffer, offset)

    def frames_for(self, chunk: PreparedChunk, place: Place | None) -> list[bytes]:
        """The frames that send `chunk` (`place`: `place_of(chunk)`), the header first on the
        first call."""
        out = []
        if not self._started:
            if place is not None:
                self.frames.lend_id = place[0]
            out.append(self.opening())
        if place is not None and place[0] == self.frames.lend_id:
            self._lent = place[1]
            crc = crc_of(chunk)
            self._by_ref.append((chunk, crc))
            self._group.append((chunk, place[2]))
            self._group_crcs.append(crc)
            self._group_bytes += chunk.nbytes
            if len(self._group) == REFS_PER_MESSAGE or self._group_bytes >= REFS_MESSAGE_BYTES:
                out += self.flush()
        else:
            self._inline_sent = True
            out.append(self.frames.chunk(chunk))
        return out

    def flush(self) -> list[bytes]:
        """The references put but not yet sent, as one message (before the commit)."""
        if not self._group:
            return []
        frame = self.frames.chunk_refs(self._group, self._group_crcs)
        self._group, self._group_crcs, self._group_bytes = [], [], 0
        return [frame]

    def opening(self) -> bytes:
        """The header (once): sent with the first chunk, or by a commit of no chunks."""
        self._started = True
        return self.frames.header

    @property
    def started(self) -> bool:
        return self._started

    def may_go_inline(self, code: grpc.StatusCode | None, details: str | None) -> bool:
        """Whether a call that ended with `code` and `details` is the producer refusing the
        lent buffer and every chunk put so far can be sent again (`inline`)."""
        return bool(self.frames.lend_id) and lend_refused(code, details) and not self._inline_sent

    def forget_lend(self) -> None:
        """The producer refused the lend the header named: forgotten, so the next use of the
        buffer lends it anew."""
        if self._shm is not None and self.frames.lend_id:
            self._shm.forget_refused(self.frames.lend_id)

    def inline(self) -> list[bytes]:
        """The frames of a new call that sends every chunk put so far inline (after
        `forget_lend`)."""
        old = self.frames
        self.frames = ParkFrames(
            old.kv_request_id, old.total_chunks, old.batch_bytes, fingerprint=old.fingerprint
        )
        self._lent = None
        self._group, self._group_crcs, self._group_bytes = [], [], 0
        # Each with the CRC32C taken at its `put`: bytes the caller changed since (which a put
        # by reference asks it not to do) are then CHECKSUM_MISMATCH, not parked as they are.
        out = [self.frames.header, *(self.frames.chunk(c, crc) for c, crc in self._by_ref)]
        self._by_ref = []
        return out

    def answered(self, outcome: ParkOutcome, raw: bytes) -> ParkResult:
        """The batch's result from the producer's answer."""
        return outcome.answered(pb.ParkResponse.FromString(raw), self.transport)

    def failed(
        self, outcome: ParkOutcome, code: grpc.StatusCode | None, details: str
    ) -> ParkResult:
        """The batch's result from an error status; a refused lend that could not go inline
        is a value, as for `park()`."""
        return outcome.failed(code, details or "", self.transport)

    def finished(self) -> None:
        """The batch ended: its references to the caller's memory go."""
        self._by_ref, self._group, self._group_crcs = [], [], []
        self._lent = None
