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
so its header goes with that chunk; chunks elsewhere go inline. References go out in groups
of up to 64 chunks or 16 MiB, the last with the commit, as `park()` sends them: the
producer's cost is per message. A producer that does not
hold the lend (it restarted since the buffer was lent) refuses the header with
INVALID_ARGUMENT before taking any chunk; the batch then starts a new call and sends every
chunk put so far inline (`inline`), so the fallback to the gRPC stream happens within the
batch, as for `park()`. Chunks that went by reference are still in the caller's shared buffer
then (a put from a shared buffer asks the caller to leave those bytes alone until the commit).
A chunk that went inline is not kept (that memory is the caller's again once `put` returned),
so a batch that sent one reports the refusal instead (an RPC_ERROR result).
"""

from __future__ import annotations

import grpc

from kvpark.pb import kvpark_pb2 as pb

from ._park import (
    REFS_MESSAGE_BYTES,
    REFS_PER_MESSAGE,
    ParkFrames,
    ParkOutcome,
    ParkResult,
    PreparedChunk,
    crc_of,
)
from ._shm import ShmAccess


class BatchRoute:
    def __init__(self, frames: ParkFrames, shm: ShmAccess | None, *, can_lend: bool) -> None:
        """`can_lend`: lending may start now (the producer's epoch is known, or unneeded)."""
        self.frames = frames
        self._shm = shm
        self._started = False
        # Chunks sent by reference, to resend inline if the producer refuses the lend: views
        # of the caller's shared buffer, no copies. A chunk sent inline is not kept (its
        # memory is the caller's again once `put` returned), so after one the batch can no
        # longer go inline and a refused lend is its outcome.
        self._by_ref: list[PreparedChunk] = []
        self._inline_sent = False
        # References put and not yet sent, with their CRC32C taken at `put` (what the caller
        # had then is what the producer checks): they go in groups, as `park()` sends them,
        # since the producer's cost is per message (a read, a copy job), not per chunk.
        self._group: list[tuple[PreparedChunk, int]] = []
        self._group_crcs: list[int] = []
        self._group_bytes = 0
        self.header_at_start: bytes | None = None  # the header, when it can go at once
        if shm is None or not shm.has_buffers:
            self.header_at_start = self.opening()
        elif can_lend and (lend_id := shm.sole_lend()) is not None:
            frames.lend_id = lend_id
            self.header_at_start = self.opening()

    @property
    def transport(self) -> str:
        """What carried the batch's bytes: "shm" once a chunk went by reference."""
        return "shm" if self._by_ref and self.frames.lend_id else "grpc"

    def frames_for(self, chunk: PreparedChunk) -> list[bytes]:
        """The frames that send `chunk`, the header first on the first call."""
        found = None
        if self._shm is not None and len(chunk.parts) == 1:
            found = self._shm.lend_of(chunk.parts[0])
        out = []
        if not self._started:
            if found is not None:
                self.frames.lend_id = found[0]
            out.append(self.opening())
        if found is not None and found[0] == self.frames.lend_id:
            self._by_ref.append(chunk)
            self._group.append((chunk, found[2]))
            self._group_crcs.append(crc_of(chunk))
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

    def may_go_inline(self, code: grpc.StatusCode | None) -> bool:
        """Whether a call that ended with `code` is the producer refusing the lent buffer
        and every chunk put so far can be sent again (`inline`)."""
        return (
            bool(self.frames.lend_id)
            and code == grpc.StatusCode.INVALID_ARGUMENT
            and not self._inline_sent
        )

    def forget_lend(self) -> None:
        """The producer refused the lend the header named: forgotten, so the next use of the
        buffer lends it anew (blocking I/O on the shm socket)."""
        if self._shm is not None and self.frames.lend_id:
            self._shm.settle(self.frames.lend_id)

    def inline(self) -> list[bytes]:
        """The frames of a new call that sends every chunk put so far inline (after
        `forget_lend`)."""
        old = self.frames
        self.frames = ParkFrames(old.kv_request_id, old.total_chunks, old.batch_bytes)
        self._group, self._group_crcs, self._group_bytes = [], [], 0
        out = [self.frames.header, *(self.frames.chunk(chunk) for chunk in self._by_ref)]
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
        return outcome.failed(code, details or "", quiet=bool(self.frames.lend_id))

    def finished(self) -> None:
        """The batch ended: its references to the caller's memory go."""
        self._by_ref, self._group, self._group_crcs = [], [], []
