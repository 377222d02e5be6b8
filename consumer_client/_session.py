"""One load's logic, shared by the sync and the async client: no I/O, no gRPC calls.

The clients only move bytes: they start the Fetch, hand every received message to
`LoadSession.feed`, report how the stream ended (`stream_ended`, `rpc_failed`), cancel the call
when the session says so, and ask for the `result()`. Everything else lives here once: the
request bytes, the deadlines, frame parsing, the chunk-order and CRC32C checks, placement into
the destination, the in-band TransferDone, and what each ending means. A load needs no other
call: the TransferDone carries the producer's epoch and the delivery's id.

How a stream may end, and what the session decides:

    TransferDone OK, every requested chunk verified       -> ok
    TransferDone FAILED                                   -> the producer's reason, at once (no
                                                             cancel: the stream is over)
    a chunk out of order or without a CRC, a malformed
    frame, no Done                                        -> PROTOCOL_ERROR, client cancels
    a chunk whose CRC32C does not match                   -> CHECKSUM_MISMATCH, client cancels
    our first-chunk watchdog cancelled / deadline passed  -> TIMEOUT
    any other gRPC status                                 -> `classify_status` decides (value or
                                                             raise)

A chunk counts (in `chunks_loaded`) only after its CRC32C matched and it was copied, and only
in request order, so what was loaded is always a prefix and `first_missing_chunk` is exact.
If every explicitly requested chunk was verified, the load is ok even if the stream then broke:
the bytes are all there and checked.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from kvpark import wire
from kvpark.checksum import crc32c_of
from kvpark.ids import printable_id
from kvpark.pb import kvpark_pb2 as pb

from ._buffers import ChunkBuffers, Destination, OwnedBuffer
from ._errors import BufferTooSmallError, classify_status, error_for
from ._result import LoadResult, Reason
from ._shm import lend_refused
from ._timeouts import Timeout
from .handle import TRANSPORT_NAMES

log = logging.getLogger("kvpark.client")

# How LoadResult.transport names the contract's Transport values.

# Called after each chunk is verified and placed: (index in the request, chunk id, its bytes
# where they landed). Lets an engine start on early chunks while later ones still stream.
OnChunk = Callable[[int, int, memoryview], None]


class Step(enum.Enum):
    """What the client does after `feed`."""

    CONTINUE = "continue"  # read the next message
    DONE = "done"  # the producer's TransferDone arrived: drain to the end, do not cancel
    ABANDON = "abandon"  # the client gave up on the stream: cancel the call
    OFFER = "offer"  # the bytes come over a data connection: `offer` says where


@dataclass(frozen=True, slots=True)
class ShmTarget:
    """Where a TRANSPORT_SHM load's chunks land: a range of a buffer this client lent.
    `view` is the client's own mapping of the whole lent buffer; `direct` when that range is
    the destination itself (no staging copy)."""

    lend_id: str
    view: memoryview
    offset: int
    length: int
    direct: bool


class LoadSession:
    def __init__(
        self,
        *,
        kv_request_id: str,
        chunk_ids: tuple[int, ...] | None,
        destination: Destination,
        timeout: Timeout,
        expected_epoch: int,
        wait_timeout_s: float,
        on_chunk: OnChunk | None,
        max_chunk_bytes: int,
        fingerprint: bytes = b"",
        accept: Sequence[pb.Transport] = (),
        shm: ShmTarget | None = None,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ) -> None:
        self.kv_request_id = kv_request_id
        self.shm = shm
        # This load holds the client's staging buffer (given back by the client when the load
        # ends, whatever path it ended on, fallback included).
        self.staged = shm is not None and not shm.direct
        # This load is the one that tries TCP again after a pause (ClientCore._tcp_turn):
        # the end of the pause it set, given back when no DataOffer let it try.
        self.tcp_probe: float | None = None
        # Why the data connection ended before its end frame, when it did.
        self._data_broke = ""
        self._args = (
            chunk_ids, destination, timeout, expected_epoch, wait_timeout_s, on_chunk, fingerprint
        )  # fmt: skip
        self.chunk_ids = chunk_ids
        self.expected_epoch = expected_epoch
        # The largest chunk this client takes: what the producer announces for a chunk out of
        # band is checked against it before any buffer is sized by it.
        self.max_chunk_bytes = max_chunk_bytes
        self._dest = destination
        self._on_chunk = on_chunk
        self._clock = clock
        # When the load began (`started`: earlier work for it, e.g. lending a buffer, counts).
        self.started = clock() if started is None else started
        budget = timeout.budget_s(destination.capacity)
        self.deadline = None if budget is None else self.started + budget
        first = timeout.first_chunk_s
        self.first_chunk_deadline = None if first is None else self.started + first
        self.request: Final[bytes] = pb.FetchRequest(
            kv_request_id=kv_request_id,
            chunk_ids=chunk_ids or (),
            expected_epoch=expected_epoch,
            wait_timeout_s=wait_timeout_s,
            expected_fingerprint=fingerprint,
            accept_transports=accept,
            reuse_data_connection=pb.TRANSPORT_TCP in accept,
            shm_lend_id=shm.lend_id if shm else "",
            shm_offset=shm.offset if shm else 0,
            shm_length=shm.length if shm else 0,
        ).SerializeToString()
        # The DataOffer of a TRANSPORT_TCP answer, once it came (Step.OFFER).
        self.offer: pb.DataOffer | None = None
        # The transport asked for, until the answer says otherwise: a load cut off before
        # its first byte names the path it was waiting on.
        self.transport = pb.TRANSPORT_SHM if shm else pb.TRANSPORT_GRPC
        self.chunks_loaded = 0
        self._sizes: list[int] = []
        # The decided outcome: (reason or None for ok, detail, grpc code). None = undecided.
        self._outcome: tuple[Reason | None, str, grpc.StatusCode | None] | None = None
        # The failure policy the caller loads under (a label of the client's metrics).
        self.policy = "none"
        self.first_chunk_at: float | None = None
        # From the producer's TransferDone: its epoch, and the delivery a success names.
        self.producer_epoch = 0
        self.delivery_id = 0

    def over_grpc(self) -> LoadSession:
        """The same load over the gRPC stream, after an out-of-band path failed before its
        first byte: nothing was placed yet, and the time already spent still counts."""
        chunk_ids, destination, timeout, expected_epoch, wait_timeout_s, on_chunk, fingerprint = (
            self._args
        )
        session = LoadSession(
            kv_request_id=self.kv_request_id,
            chunk_ids=chunk_ids,
            destination=destination,
            timeout=timeout,
            expected_epoch=expected_epoch,
            wait_timeout_s=wait_timeout_s,
            on_chunk=on_chunk,
            max_chunk_bytes=self.max_chunk_bytes,
            fingerprint=fingerprint,
            clock=self._clock,
        )
        session.started = self.started
        session.policy = self.policy
        session.staged = self.staged
        session.tcp_probe = self.tcp_probe
        session.deadline = self.deadline
        session.first_chunk_deadline = self.first_chunk_deadline
        return session

    # ------------------------------------------------------------------------------ deadlines
    def remaining_s(self) -> float | None:
        """Seconds left of the load budget (never negative); None = unbounded."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self._clock())

    def settle_within_s(self) -> float | None:
        """How long a cut-off shared-memory load may wait for a copy still landing: what is
        left of the load, and before its first chunk, of the first-chunk limit too."""
        left = self.remaining_s()
        first = self.first_chunk_remaining_s() if not self.chunks_loaded else None
        if first is None:
            return left
        return first if left is None else min(left, first)

    def first_chunk_remaining_s(self) -> float | None:
        """Seconds until the first-chunk watchdog fires; None when not armed."""
        if self.first_chunk_deadline is None:
            return None
        return max(0.0, self.first_chunk_deadline - self._clock())

    def first_chunk_watch_s(self) -> float | None:
        """How long the client's first-chunk watchdog lets the stream be silent from now on:
        what is left of the first-chunk limit while no chunk has counted, None once one did
        (or when the load has no such limit). Re-armed after every message that brought no
        chunk: a data connection that ended before its first frame leaves the load waiting on
        the stream's TransferDone, and the limit must still bound that wait."""
        return None if self.chunks_loaded else self.first_chunk_remaining_s()

    @property
    def decided(self) -> bool:
        return self._outcome is not None

    # -------------------------------------------------------------------------------- stream
    def feed(self, raw: bytes) -> Step:
        """Handles one received FetchResponse (raw bytes). May raise BufferTooSmallError or
        what `on_chunk` raises; the client cancels the call on any exception."""
        if self._outcome is not None:  # a message after TransferDone: nothing to do with it
            return Step.DONE
        try:
            message = wire.parse_fetch_response(raw)
        except wire.WireError as exc:
            return self._abandon(Reason.PROTOCOL_ERROR, f"malformed FetchResponse: {exc}")
        if isinstance(message, wire.ChunkView):
            return self._chunk(message)
        if isinstance(message, pb.TransferDone):
            return self._done(message)
        if isinstance(message, pb.DataOffer):
            if self.offer is not None or self.chunks_loaded:
                return self._abandon(Reason.PROTOCOL_ERROR, "a DataOffer after the first message")
            self.offer = message
            self.transport = message.transport  # so a load cut off mid-way still says it
            return Step.OFFER
        if isinstance(message, pb.ChunksPlaced):
            if not message.chunks:
                return self._abandon(Reason.PROTOCOL_ERROR, "a ChunksPlaced that names no chunk")
            self.transport = pb.TRANSPORT_SHM
            for placed in message.chunks:
                step = self._placed(placed)
                if step is not Step.CONTINUE:
                    return step
            return Step.CONTINUE
        return self._abandon(Reason.PROTOCOL_ERROR, "FetchResponse with nothing in it")

    # ------------------------------------------------------------- out-of-band transports
    def refused_out_of_band(self, code: grpc.StatusCode | None, details: str | None) -> bool:
        """True when the producer refused this load's lent buffer before any byte moved (it
        does not hold it: another process, or released), its detail saying so: the load goes
        on over gRPC. Any other refusal is about the request and stands on every transport; a
        range too small for the next chunk is OUT_OF_RANGE (`rpc_failed`)."""
        return self.shm is not None and self.chunks_loaded == 0 and lend_refused(code, details)

    def _next_requested(self) -> int | None:
        """The id of the next chunk to load; None when every requested chunk was loaded."""
        index = self.chunks_loaded
        if self.chunk_ids is None:
            return index
        return self.chunk_ids[index] if index < len(self.chunk_ids) else None

    def expected_chunk(self, chunk_id: int, nbytes: int, most: int | None = None) -> Step | None:
        """None when `chunk_id` is the next requested chunk and `nbytes` a size a chunk may
        have (1 to `most`, by default max_chunk_bytes: docs/protocol.md), else the step of
        giving up."""
        most = self.max_chunk_bytes if most is None else most
        if not 0 < nbytes <= most:
            return self._abandon(
                Reason.PROTOCOL_ERROR,
                f"chunk {chunk_id} of {nbytes} bytes: a chunk has 1 to {most}",
            )
        expected = self._next_requested()
        if expected is None:
            return self._abandon(
                Reason.PROTOCOL_ERROR, f"chunk {chunk_id} sent after all requested chunks"
            )
        if chunk_id != expected:
            return self._abandon(
                Reason.PROTOCOL_ERROR, f"chunk {chunk_id} arrived, expected {expected}"
            )
        return None

    def parts_for(self, chunk_id: int, nbytes: int) -> list[memoryview]:
        """Where the next chunk's bytes go, for a transport that reads them straight there
        (after `expected_chunk`). May raise BufferTooSmallError."""
        return self._dest.parts_for(self.chunks_loaded, chunk_id, nbytes)

    def landed(
        self,
        chunk_id: int,
        crc32c: int,
        parts: list[memoryview],
        nbytes: int,
        actual: int | None = None,
    ) -> Step:
        """A chunk read straight into `parts`: it counts once its CRC32C matches there.
        `actual` is that CRC when the transport computed it as the bytes landed."""
        if actual is None:
            actual = 0
            for part in parts:
                actual = crc32c_of(part, actual)
        if actual != crc32c:
            return self._abandon(
                Reason.CHECKSUM_MISMATCH,
                f"chunk {chunk_id}: crc32c {actual:#010x}, producer says {crc32c:#010x}",
            )
        if isinstance(self._dest, OwnedBuffer):
            self._dest.keep(parts)
        self._dest.landed(nbytes)
        return self._counted(chunk_id, self._joined(parts), nbytes)

    def _joined(self, parts: list[memoryview]) -> memoryview:
        """The chunk's bytes as one view for `on_chunk`, as the gRPC stream hands them: the
        destination itself when it is one buffer; for a chunk read into several, a copy made
        only when someone looks."""
        if len(parts) == 1:
            return parts[0]
        return memoryview(b"".join(parts) if self._on_chunk is not None else b"")

    def _placed(self, placed: pb.ChunkPlaced) -> Step:
        """A chunk the producer copied into this client's lent buffer (TRANSPORT_SHM)."""
        shm = self.shm
        if shm is None or placed.offset + placed.nbytes > shm.length:
            return self._abandon(Reason.PROTOCOL_ERROR, "a ChunkPlaced outside the lent range")
        if placed.offset != self._dest.nbytes:
            # Chunks are placed back to back: any other offset would report a chunk where it
            # is not, or over one already verified.
            return self._abandon(
                Reason.PROTOCOL_ERROR,
                f"chunk {placed.chunk_id} placed at {placed.offset}, not at {self._dest.nbytes}",
            )
        # Bounded by the lent range (checked above), not by max_chunk_bytes: that is the
        # limit of a gRPC message, which a placement is not.
        refused = self.expected_chunk(placed.chunk_id, placed.nbytes, most=shm.length)
        if refused is not None:
            return refused
        start = shm.offset + placed.offset
        region = shm.view[start : start + placed.nbytes]
        if shm.direct:  # the lent range is the destination: the bytes are in place already
            return self.landed(placed.chunk_id, placed.crc32c, [region], placed.nbytes)
        # Verified, then copied from the staging range to `into`, which the next load of
        # this client overwrites: on_chunk gets the bytes where they landed.
        view = wire.ChunkView(placed.chunk_id, placed.crc32c, region)
        return self._verified(view, lasting=False)

    def _chunk(self, chunk: wire.ChunkView) -> Step:
        refused = self.expected_chunk(chunk.chunk_id, len(chunk.data))
        if refused is not None:
            return refused
        return self._verified(chunk, lasting=True)

    def _verified(self, chunk: wire.ChunkView, *, lasting: bool) -> Step:
        """Checks the CRC32C of the next requested chunk and places it in the destination.
        `lasting`: its bytes stay as they are after this load (a received message), so
        on_chunk may see them there when they landed in several pieces."""
        index, expected = self.chunks_loaded, chunk.chunk_id
        if chunk.crc32c is None:
            return self._abandon(Reason.PROTOCOL_ERROR, f"chunk {expected} came without a CRC32C")
        actual = crc32c_of(chunk.data)
        if actual != chunk.crc32c:
            return self._abandon(
                Reason.CHECKSUM_MISMATCH,
                f"chunk {expected}: crc32c {actual:#010x}, producer says {chunk.crc32c:#010x}",
            )
        parts = self._dest.place(chunk.data, index, expected)
        landed = chunk.data if lasting and len(parts) > 1 else self._joined(parts)
        return self._counted(expected, landed, len(chunk.data))

    def _counted(self, chunk_id: int, landed: memoryview, nbytes: int) -> Step:
        index = self.chunks_loaded
        if index == 0:
            self.first_chunk_at = self._clock()
        self.chunks_loaded += 1
        self._sizes.append(nbytes)
        if self._on_chunk is not None:
            self._on_chunk(index, chunk_id, landed)
        return Step.CONTINUE

    def data_connection_broke(self, why: str) -> None:
        """The data connection ended before its end frame (a reset, a frame cut short)."""
        self._data_broke = why

    def _done(self, done: pb.TransferDone) -> Step:
        self.producer_epoch = done.producer_epoch
        self.transport = done.transport or pb.TRANSPORT_GRPC
        if (
            done.status == pb.STATUS_OK
            and self._data_broke
            and self.chunks_loaded < done.chunks_sent
        ):
            # The producer sent every frame; the connection lost some on the way (a reset by
            # the network or a proxy): the path failed, not the contract. The id keeps its
            # bytes for the delivery grace, so a retry loads it again.
            self._decide(
                Reason.UNAVAILABLE,
                f"the data connection broke after {self.chunks_loaded} of {done.chunks_sent} "
                f"chunks: {self._data_broke}",
            )
        elif done.status == pb.STATUS_OK:
            if self.chunk_ids is not None and not self._complete():
                self._decide(
                    Reason.PROTOCOL_ERROR,
                    f"TransferDone OK after {self.chunks_loaded} of {len(self.chunk_ids)} chunks",
                )
            elif done.chunks_sent != self.chunks_loaded:
                self._decide(
                    Reason.PROTOCOL_ERROR,
                    f"TransferDone says {done.chunks_sent} chunks sent, {self.chunks_loaded} "
                    "received",
                )
            else:
                self.delivery_id = done.delivery_id
                self._decide(None, "")
        elif self._complete():
            # Every requested chunk is here and verified; the producer failed the id only after.
            self._decide(None, f"all chunks verified; producer then said {done.detail!r}")
        else:
            self._decide(Reason.from_proto(done.reason), done.detail)
        return Step.DONE

    def stream_ended(self) -> None:
        """The stream closed with status OK. Without a TransferDone that breaks the contract."""
        if self._outcome is None:
            if self._complete():
                self._decide(None, "all chunks verified; stream ended without TransferDone")
            else:
                self._decide(Reason.PROTOCOL_ERROR, "stream ended without TransferDone")

    def rpc_failed(self, code: grpc.StatusCode | None, details: str, *, timed_out: bool) -> None:
        """The call ended with an error status. `timed_out`: our own watchdog cancelled it.

        Raises the mapped exception for statuses that mean misuse (classify_status)."""
        if self._outcome is not None:
            return  # decided before the transport ended (e.g. our cancel after a bad chunk)
        if self._complete():
            self._decide(None, f"all chunks verified; then {code}: {details}", code)
            return
        if timed_out:
            self._decide(Reason.TIMEOUT, self._timeout_detail("first chunk"), code)
            return
        if self.shm is not None and _does_not_fit(code, details):
            # A next chunk that does not fit in the rest of the lent range (docs/protocol.md):
            # the same misuse as a chunk that does not fit `into` on the other transports.
            raise self._too_small(details)
        rule = classify_status(code)
        if rule.load_reason is None:
            raise error_for(code, details, f"Fetch {printable_id(self.kv_request_id)}")
        if rule.load_reason is Reason.TIMEOUT:
            details = self._deadline_detail(details)
        self._decide(rule.load_reason, details, rule.code)

    def _deadline_detail(self, details: str) -> str:
        """What a DEADLINE_EXCEEDED status says: the load's own total passed, or (well before
        it) the producer gave up on the Fetch (fetch_stall_timeout_s: the consumer neither
        connected nor read), which the detail must not pass off as the caller's limit."""
        left = self.remaining_s()
        if left is not None and left <= _OWN_DEADLINE_SLACK_S:
            return self._timeout_detail("total")
        return (
            f"the producer cut the Fetch off after {self._clock() - self.started:.3f}s, "
            f"{self.chunks_loaded} chunks loaded: {details}"
        )

    def _too_small(self, details: str) -> BufferTooSmallError:
        """The error the other transports raise when `into` runs out at the same chunk: the
        same counts, and `needed` up to the end of the chunk the producer names."""
        assert self.shm is not None
        loaded = self._dest.nbytes
        named = _DOES_NOT_FIT.match(details)
        if named is None or int(named["chunk_id"]) != self._next_requested():
            return BufferTooSmallError(
                f"into holds {self.shm.length} bytes; the next chunks do not fit after "
                f"{loaded} bytes ({details})",
                needed=self.shm.length + 1,  # at least: the chunk and its size are not known
                available=self.shm.length,
                chunks_loaded=self.chunks_loaded,
                bytes_loaded=loaded,
            )
        chunk_id, nbytes = int(named["chunk_id"]), int(named["nbytes"])
        if isinstance(self._dest, ChunkBuffers):
            # Staged for one destination per chunk: a chunk that overflows the staging range
            # (their sizes added up) is larger than its own destination, and the error is
            # that destination's, as on the other transports.
            try:
                self._dest.parts_for(self.chunks_loaded, chunk_id, nbytes)
            except BufferTooSmallError as exc:
                return exc
        needed = loaded + nbytes
        return BufferTooSmallError(
            f"into holds {self.shm.length} bytes; chunk {chunk_id} needs bytes {loaded}.."
            f"{needed} (chunks are placed back to back in request order)",
            needed=needed,
            available=self.shm.length,
            chunks_loaded=self.chunks_loaded,
            bytes_loaded=loaded,
        )

    # ------------------------------------------------------------------------------- result
    def _first_chunk_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.started

    def result(self, info_epoch: int | None) -> LoadResult:
        """The outcome. `info_epoch`: the epoch of the client's last ServerInfo, used only when
        the producer's own answer did not carry one (the call broke before it)."""
        if self._outcome is None:  # the client must decide every path; guard anyway
            self._decide(Reason.PROTOCOL_ERROR, "load ended without an outcome")
        assert self._outcome is not None
        reason, detail, code = self._outcome
        ok = reason is None
        epoch = self.producer_epoch or (0 if reason is Reason.EPOCH_MISMATCH else info_epoch or 0)
        result = LoadResult(
            kv_request_id=self.kv_request_id,
            ok=ok,
            reason=reason,
            detail=detail,
            chunk_ids=self.chunk_ids,
            chunks_loaded=self.chunks_loaded,
            bytes=self._dest.nbytes,
            chunk_sizes=tuple(self._sizes),
            elapsed_s=self._clock() - self.started,
            producer_epoch=epoch,
            grpc_code=code,
            delivery_id=self.delivery_id if ok else 0,
            transport=TRANSPORT_NAMES.get(self.transport, "grpc"),
            first_chunk_s=self._first_chunk_s(),
            data=self._dest.array(),
        )
        level = logging.WARNING if reason in _LOUD else logging.DEBUG
        log.log(
            level,
            "load %s: %s, %d chunks, %d bytes, %.3fs%s",
            printable_id(self.kv_request_id),
            "ok" if ok else reason,
            result.chunks_loaded,
            result.bytes,
            result.elapsed_s,
            f" ({detail})" if detail else "",
        )
        return result

    # ------------------------------------------------------------------------------ helpers
    def _complete(self) -> bool:
        return self.chunk_ids is not None and self.chunks_loaded == len(self.chunk_ids)

    def _decide(
        self, reason: Reason | None, detail: str, code: grpc.StatusCode | None = None
    ) -> None:
        if self._outcome is None:
            self._outcome = (reason, detail, code)

    def give_up(self, reason: Reason, detail: str) -> Step:
        """The client ends the load (a transport of its own saw it fail)."""
        if reason is Reason.TIMEOUT:
            detail = self._timeout_detail(self._limit_passed())
        return self._abandon(reason, detail)

    def _limit_passed(self) -> str:
        """Which of the load's limits ran out: its first-chunk limit, or its total."""
        now = self._clock()
        first = self.first_chunk_deadline
        before_total = self.deadline is None or now < self.deadline
        if self.chunks_loaded == 0 and first is not None and first <= now and before_total:
            return "first chunk"
        return "total"

    def _abandon(self, reason: Reason, detail: str) -> Step:
        self._decide(reason, detail)
        return Step.ABANDON

    def _timeout_detail(self, which: str) -> str:
        return (
            f"{which} timeout after {self._clock() - self.started:.3f}s, "
            f"{self.chunks_loaded} chunks loaded; Fetch cancelled"
        )


# A DEADLINE_EXCEEDED this close to the load's own deadline is that deadline (gRPC's timer and
# this clock may differ by a little); earlier, the producer ended the Fetch.
_OWN_DEADLINE_SLACK_S = 0.1

# How a producer refuses a shm Fetch's next chunk that does not fit in the rest of the lent
# range: OUT_OF_RANGE, its detail naming the chunk and its size (docs/protocol.md). Producers
# of an earlier build refused it INVALID_ARGUMENT with the same detail; any other
# INVALID_ARGUMENT is about the request itself (a chunk id the id lacks, say).
_DOES_NOT_FIT = re.compile(r"chunk (?P<chunk_id>\d+) \((?P<nbytes>\d+) bytes\) does not fit")


def _does_not_fit(code: grpc.StatusCode | None, details: str) -> bool:
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return True
    return code == grpc.StatusCode.INVALID_ARGUMENT and _DOES_NOT_FIT.match(details) is not None


# Outcomes that point at a bug or corruption somewhere: worth a warning in the worker's log.
_LOUD = frozenset({Reason.CHECKSUM_MISMATCH, Reason.PROTOCOL_ERROR, Reason.RPC_ERROR})
