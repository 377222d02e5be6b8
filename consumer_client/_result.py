"""What a load returns: `LoadResult`, its `Reason`, and the path `load_or_recompute` took.

Expected outcomes are values: a reaped id, a producer that stalled past the timeout, a
connection that broke, a chunk whose checksum is wrong — all come back as a frozen
`LoadResult` with `ok=False` and a `Reason`. Exceptions are left for misuse and bugs.

`Reason` is one string enum for both origins, so an engine switches on one type:

- the producer's reasons are the contract's `FailureReason` values without the `REASON_`
  prefix (`REAPED`, `EPOCH_MISMATCH`, ...), converted by `Reason.from_proto`; a test checks that
  every `FailureReason` has its member;
- the client's own reasons (`TIMEOUT`, `UNAVAILABLE`, `CANCELLED`, `PROTOCOL_ERROR`,
  `RPC_ERROR`) say what went wrong on this side of the wire. `CHECKSUM_MISMATCH` is shared: the
  producer uses it for a corrupt Park, the client for a received chunk whose CRC32C is wrong.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from kvpark.pb import kvpark_pb2 as pb

_PROTO_PREFIX = "REASON_"


# What `load_or_recompute` does with a load that failed: recompute what is missing, or raise.
Policy = Literal["recompute", "fail"]
POLICIES: tuple[Policy, ...] = ("recompute", "fail")


class Reason(enum.StrEnum):
    """Why a load (or another call) did not succeed."""

    # --- the producer's reasons (FailureReason in the .proto), answered in-band -------------
    REAPED = "REAPED"
    UNKNOWN_ID = "UNKNOWN_ID"
    ALREADY_CONSUMED = "ALREADY_CONSUMED"
    RELEASED = "RELEASED"
    EVICTED = "EVICTED"
    ALREADY_BOUND = "ALREADY_BOUND"
    POOL_FULL = "POOL_FULL"
    TOO_LARGE = "TOO_LARGE"
    WAIT_TIMEOUT = "WAIT_TIMEOUT"
    EPOCH_MISMATCH = "EPOCH_MISMATCH"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    CHUNK_CONFLICT = "CHUNK_CONFLICT"
    # Also the client's: a received chunk whose bytes do not match its CRC32C.
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    NOT_COMMITTED = "NOT_COMMITTED"
    COMMIT_MISMATCH = "COMMIT_MISMATCH"
    # The id's KV was computed from something else than the load's `fingerprint` names.
    FINGERPRINT_MISMATCH = "FINGERPRINT_MISMATCH"

    # --- the client's own reasons ------------------------------------------------------------
    # The load timeout (total, first-chunk or size-scaled) fired; the RPC was cancelled.
    TIMEOUT = "TIMEOUT"
    # The producer could not be reached or the connection broke (gRPC UNAVAILABLE).
    UNAVAILABLE = "UNAVAILABLE"
    # The call was cancelled by something other than our timeout (client closed, peer reset).
    CANCELLED = "CANCELLED"
    # The stream broke the contract: malformed frame, chunk out of order, no TransferDone.
    PROTOCOL_ERROR = "PROTOCOL_ERROR"
    # Any other gRPC status the transport or a proxy answered with; see `LoadResult.grpc_code`.
    RPC_ERROR = "RPC_ERROR"

    @classmethod
    def from_proto(cls, value: int) -> Reason:
        """The member for a contract `FailureReason` value. REASON_UNSPECIFIED on a failure is
        itself a broken contract (PROTOCOL_ERROR)."""
        if value == pb.REASON_UNSPECIFIED:
            return cls.PROTOCOL_ERROR
        try:
            name = str(pb.FailureReason.Name(value))
        except ValueError:  # a reason newer than this client: still a failure, name unknown
            return cls.PROTOCOL_ERROR
        return cls(name.removeprefix(_PROTO_PREFIX))

    @property
    def from_producer(self) -> bool:
        """True for reasons the producer answers in-band (CHECKSUM_MISMATCH counts as both)."""
        return self.name not in _CLIENT_ONLY


_CLIENT_ONLY = frozenset({"TIMEOUT", "UNAVAILABLE", "CANCELLED", "PROTOCOL_ERROR", "RPC_ERROR"})


class LoadPath(enum.StrEnum):
    """Where a request's KV came from."""

    # Every requested chunk was loaded from the producer.
    REMOTE = "remote"
    # A prefix was loaded; the engine recomputes from the first missing chunk.
    PARTIAL = "partial"
    # Nothing usable was loaded; the engine recomputes everything.
    RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """The outcome of one `load`. Frozen; compare and hash ignore `data`.

    Chunks land back to back, in the requested order, from the start of the destination, so
    chunk i sits at `chunk_offsets[i]` and is `chunk_sizes[i]` bytes long. Only a contiguous
    prefix ever counts as loaded: a chunk counts once its CRC32C matched and it was copied.
    """

    kv_request_id: str
    ok: bool
    # None when ok; otherwise why the load stopped.
    reason: Reason | None
    # Human-readable detail (the producer's TransferDone.detail or the client's); never parse.
    detail: str
    # The chunk ids asked for, in order; None means "all chunks" (count decided by the producer).
    chunk_ids: tuple[int, ...] | None
    # Requested chunks that were verified and copied, counted from the first: a prefix.
    chunks_loaded: int
    # Payload bytes of those chunks.
    bytes: int
    # Size of each loaded chunk, bytes, in load order.
    chunk_sizes: tuple[int, ...]
    # Wall time of the whole call, seconds (includes first contact).
    elapsed_s: float
    # Epoch of the producer that answered: the one its TransferDone named, else the last
    # ServerInfo read (not after EPOCH_MISMATCH, which that may predate); 0 when unknown.
    producer_epoch: int
    # The gRPC status the call ended with when it ended with an error status; None otherwise.
    grpc_code: grpc.StatusCode | None = None
    # Names the delivery when ok (the producer's TransferDone.delivery_id); the client confirms
    # it unless told not to (see `KVConsumer.confirm`). 0 when not ok.
    delivery_id: int = 0
    # Which transport carried the bytes.
    transport: str = "grpc"
    # Seconds from the start of the load to its first verified chunk; None when none came.
    first_chunk_s: float | None = None
    # The loaded bytes: a uint8 view of the caller's one `into` buffer (its first `bytes`
    # bytes), a new array the result owns when no `into` was given, or None when `into` named
    # one destination per chunk.
    data: npt.NDArray[np.uint8] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def first_missing_chunk(self) -> int | None:
        """The chunk id to recompute from: None when ok, else the first requested chunk that
        was not loaded (with "all chunks", the count loaded)."""
        if self.ok:
            return None
        if self.chunk_ids is None:
            return self.chunks_loaded
        if self.chunks_loaded >= len(self.chunk_ids):  # never built so; kept total
            return None
        return self.chunk_ids[self.chunks_loaded]

    @property
    def path(self) -> LoadPath:
        if self.ok:
            return LoadPath.REMOTE
        return LoadPath.PARTIAL if self.chunks_loaded else LoadPath.RECOMPUTE

    @property
    def chunk_offsets(self) -> tuple[int, ...]:
        """Byte offset of each loaded chunk in `data` (and in the caller's `into`)."""
        offsets = []
        pos = 0
        for size in self.chunk_sizes:
            offsets.append(pos)
            pos += size
        return tuple(offsets)


T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport(Generic[T]):
    """What `load_or_recompute` did: the load's result and, when the engine was asked to
    recompute, from which chunk and what `recompute` returned."""

    result: LoadResult
    # The argument `recompute` was called with; None when the load succeeded.
    recomputed_from: int | None
    recompute_value: T | None = None

    @property
    def path(self) -> LoadPath:
        return self.result.path

    @property
    def reason(self) -> Reason | None:
        return self.result.reason
