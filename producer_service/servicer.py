"""Maps the kvpark.v1 contract onto the lot: parse, validate, ask the lot, answer.

No protocol decisions live here (they are the lot's); this module only translates requests,
maps malformed input to INVALID_ARGUMENT with a message saying what is wrong, counts outcomes
and rate-limits warnings.

The data path skips the generated message classes, whose parsing and serializing copy every
chunk's payload: Park is registered with an identity request deserializer and Fetch with an
identity response serializer, and `kvpark.wire` builds and parses the same bytes the generated
classes would, with payloads as views. Every other method uses the generated message classes.
The method table lives in `method_handlers()`, the one place that registers the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc

from kvpark import wire
from kvpark.fingerprints import fingerprint_problem
from kvpark.ids import id_problem, printable_id
from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import LEND_ENDED, LEND_UNKNOWN

from .data_listener import DataListener
from .data_threads import DataThreads
from .logs import LOGGER_NAME, RateLimitedWarnings
from .lot import (
    FetchBinding,
    FetchEnd,
    IdStatus,
    Lot,
    MalformedRequest,
    ParkBatch,
    ParkDone,
    ReadyChunk,
    Refusal,
    reason_name,
)
from .metrics import ProducerMetrics
from .shm_lending import LendGone, ShmLendingServer
from .shm_park import LentChunks
from .transports import (
    BATCH_BYTES,
    BATCH_CHUNKS,
    BATCH_GROWTH,
    FIRST_BATCH_BYTES,
    WHOLE_BATCH_CHUNKS,
    CutShort,
    Destination,
    GrpcStream,
    ShmStream,
    Stalled,
    TcpStream,
)

SERVICE_NAME = "kvpark.v1.KVProducer"
GRPC, TCP, SHM = pb.TRANSPORT_GRPC, pb.TRANSPORT_TCP, pb.TRANSPORT_SHM
T = TypeVar("T")
# Ids per Lookup or KeepAlive. Each id costs ~10 µs of the event loop (check, lot, IdState), so
# a full call is ~10 ms, served in slices that yield between them: an honest call waiting
# behind a big one is delayed by one slice, not by the whole list.
MAX_IDS_PER_CALL = 1_000
IDS_PER_SLICE = 200
log = logging.getLogger(LOGGER_NAME)


class KVProducerServicer:
    def __init__(
        self,
        lot: Lot,
        metrics: ProducerMetrics,
        *,
        max_chunk_bytes: int,
        fetch_stall_timeout_s: float,
        server_info: Callable[[], pb.ServerInfo],
        refuse_give_up: Callable[[Any], tuple[grpc.StatusCode, str] | None] = lambda md: None,
        data_threads: DataThreads,
        advertise_address: str = "",
    ) -> None:
        self._advertise_address = advertise_address
        # The out-of-band transports this producer offers (None: not offered; see `offer`),
        # and the threads that move their bytes.
        self._data: DataListener | None = None
        self._data_address = ""
        self._shm: ShmLendingServer | None = None
        self._threads = data_threads
        self._lot = lot
        self._metrics = metrics
        self._max_chunk_bytes = max_chunk_bytes
        self._fetch_stall_timeout_s = fetch_stall_timeout_s
        self._server_info = server_info
        self._offered: tuple[pb.Transport, ...] = (GRPC,)
        # Whether a caller (by its metadata) may give ids up; confirming a delivery is open to
        # both roles (auth.py holds the roles table).
        self._refuse_give_up = refuse_give_up
        self._warnings = RateLimitedWarnings(log, metrics.count_suppressed)

    def offer(
        self, *, data: DataListener | None, data_address: str, shm: ShmLendingServer | None
    ) -> None:
        """The out-of-band transports the server started (at start-up, before any call)."""
        self._data, self._data_address, self._shm = data, data_address, shm
        offered = [SHM] if shm is not None else []
        offered += [TCP] if data is not None else []
        self._offered = (*offered, GRPC)

    # =================================================================================== Park
    async def Park(self, requests: AsyncIterator[bytes], context: Any) -> pb.ParkResponse:
        settings = self._lot.settings
        # The wait for the header is bounded like any other silence: a stream that opens and
        # never speaks must not hold a call slot for ever.
        try:
            async with asyncio.timeout(settings.park_idle_timeout_s):
                first = await anext(requests, None)
        except TimeoutError:
            detail = f"no ParkHeader within {settings.park_idle_timeout_s:g}s (park_idle_timeout_s)"
            return self._park_failed(Refusal(pb.REASON_NOT_COMMITTED, detail))
        if first is None:
            await _invalid(context, "empty Park stream: the first message must be a ParkHeader")
        header = await _parse_park(context, first)
        if not isinstance(header, pb.ParkHeader):
            await _invalid(context, "the first Park message must be a ParkHeader")
        kid = await _valid_id(context, header.kv_request_id)
        fingerprint = await _valid_fingerprint(context, "fingerprint", header.fingerprint)
        lent = await self._lent_for_park(header, context)
        opened = self._lot.begin_park(kid, header.total_chunks, header.batch_bytes, fingerprint)
        if isinstance(opened, Refusal):
            if opened.late:
                self._warn_late("late_park", kid, opened, context)
            return self._park_failed(opened)
        batch: ParkBatch = opened
        task = asyncio.current_task()
        assert task is not None
        # The lot ends a batch from outside its call on idle expiry, shutdown or the end of
        # its id; waking the handler (it sits in `anext`) lets it answer in-band at once.
        batch.wake = functools.partial(_interrupt, task)
        held = contextlib.ExitStack()
        fills = None
        if lent is not None:
            try:
                held.enter_context(lent.acquire())  # mapped until the last fill is done
            except LendGone:
                self._lot.abort_park(batch)
                await _invalid(context, f"{LEND_ENDED} before the Park used it")
            fills = LentChunks(self._lot, batch, lent.view, self._threads)
        try:
            async for raw in requests:
                message = await _parse_park(context, raw)
                refused = None
                if isinstance(message, wire.ChunkView):
                    refused = await self._park_chunk(batch, message, context)
                elif isinstance(message, pb.ChunkRefs):
                    refused = await self._park_chunk_refs(batch, message.refs, fills, context)
                elif isinstance(message, pb.ParkCommit):
                    if fills is not None:
                        refused = await fills.finish()
                    if refused is None:
                        done = self._lot.commit_park(batch, message.chunks, message.bytes)
                        return self._park_committed(done)
                else:
                    self._lot.abort_park(batch)
                    await _invalid(
                        context, "ParkHeader repeated: only the first message may be a header"
                    )
                if refused is not None:
                    if refused.late:
                        self._warn_late("late_park", kid, refused, context)
                    return self._park_failed(refused)
            return self._park_failed(self._lot.end_park_stream(batch))
        except asyncio.CancelledError:
            if batch.failed is not None and _uncancel_wakeup(task):
                return self._park_failed(batch.failed)
            raise  # the client went away: the finally undoes the batch
        finally:
            self._lot.abort_park(batch)  # a no-op once committed or already undone
            try:
                if fills is not None:
                    await fills.drain()  # threads still copying finish before pages go back
            finally:
                held.close()  # the lent buffer, mapped until its last copy ended

    async def _lent_for_park(self, header: pb.ParkHeader, context: Any) -> Any:
        """The buffer a Park header names (TRANSPORT_SHM), or None when chunks come inline."""
        if not header.shm_lend_id:
            return None
        lent = self._shm.get(header.shm_lend_id, "park") if self._shm is not None else None
        if lent is None:
            await _invalid(context, f"{LEND_UNKNOWN} to this producer for Park")
        return lent

    async def _park_chunk_refs(
        self,
        batch: ParkBatch,
        refs: Sequence[pb.ChunkRef],
        fills: LentChunks | None,
        context: Any,
    ) -> Refusal | None:
        problem = "ChunkRefs need a ParkHeader that names shm_lend_id" if fills is None else None
        if problem is None and not refs:
            problem = "a ChunkRefs message names no chunk"
        for ref in refs:
            if problem is None and ref.nbytes > self._max_chunk_bytes:
                problem = f"chunk_ref {ref.chunk_id}: {ref.nbytes} bytes, over max_chunk_bytes"
            if problem is None and fills is not None:
                problem = fills.check_range(ref)
        if problem is not None:
            self._lot.abort_park(batch)
            await _invalid(context, problem)
        assert fills is not None
        try:
            return await fills.add(refs)
        except MalformedRequest as exc:
            await _invalid(context, str(exc))

    async def _park_chunk(
        self, batch: ParkBatch, chunk: wire.ChunkView, context: Any
    ) -> Refusal | None:
        if len(chunk.data) > self._max_chunk_bytes:
            self._lot.abort_park(batch)
            await _invalid(
                context,
                f"chunk {chunk.chunk_id} is {len(chunk.data)} bytes, "
                f"more than max_chunk_bytes {self._max_chunk_bytes}",
            )
        try:
            return self._lot.park_chunk(batch, chunk.chunk_id, chunk.data, chunk.crc32c)
        except MalformedRequest as exc:
            await _invalid(context, str(exc))

    def _park_committed(self, done: ParkDone | Refusal) -> pb.ParkResponse:
        if isinstance(done, Refusal):
            return self._park_failed(done)
        self._metrics.count_park(pb.REASON_UNSPECIFIED)
        return pb.ParkResponse(
            status=pb.STATUS_OK,
            chunks_parked=done.chunks_parked,
            bytes_parked=done.bytes_parked,
            total_chunks=done.total_chunks,
            producer_epoch=self._lot.epoch,
            lease_remaining_s=done.lease_remaining_s,
            advertise_address=self._advertise_address,
            transports=self._offered,
        )

    def _park_failed(self, refusal: Refusal) -> pb.ParkResponse:
        self._metrics.count_park(refusal.reason)
        return pb.ParkResponse(
            status=pb.STATUS_FAILED,
            reason=refusal.reason,
            detail=refusal.detail,
            producer_epoch=self._lot.epoch,
            retry_after_s=refusal.retry_after_s,
        )

    # ================================================================================== Fetch
    async def Fetch(self, raw: pb.FetchRequest | Malformed, context: Any) -> None:
        """Streams the id's chunks — as messages of this call, over the consumer's data
        connection, or into its lent buffer (transports.py) — then the TransferDone, with
        `context.write` (the Reader/Writer form of a grpc.aio server-streaming handler)."""
        started = time.monotonic()
        request = await _well_formed(context, raw)
        kid = await _valid_id(context, request.kv_request_id)
        wait_s = request.wait_timeout_s
        if not math.isfinite(wait_s) or wait_s < 0:
            await _invalid(context, f"wait_timeout_s must be >= 0 and finite, got {wait_s!r}")
        # Every chunk takes at least one pool page, so a longer list can never be served; it is
        # refused before it is copied (millions of ids would stall the loop and hold memory).
        most = self._lot.pool.total_pages
        if len(request.chunk_ids) > most:
            await _invalid(
                context, f"{len(request.chunk_ids)} chunk_ids, more than the pool can hold ({most})"
            )
        # Repeats are malformed whatever the id's state: refused before binding, whose epoch,
        # tombstone and shutdown refusals would otherwise answer them in-band (a chunk beyond
        # the id's total needs the id, so binding checks that).
        if len(set(request.chunk_ids)) != len(request.chunk_ids):
            await _invalid(context, "chunk_ids repeats a chunk")
        expected = await _valid_fingerprint(
            context, "expected_fingerprint", request.expected_fingerprint
        )
        transport = self._pick_transport(request)
        lent = await self._lent_for_fetch(request, context) if transport == SHM else None
        wakeup = asyncio.Event()
        try:
            bound = self._lot.bind_fetch(
                kid, request.chunk_ids, request.expected_epoch, wait_s, wakeup.set, expected
            )
        except MalformedRequest as exc:
            await _invalid(context, str(exc))
        if isinstance(bound, Refusal):
            if bound.late:
                self._warn_late("late_fetch", kid, bound, context)
            await context.write(self._fetch_done(FetchEnd(bound, 0, 0), started, GRPC))
            return
        binding = bound
        if binding.time_to_fetch_s is not None:
            self._metrics.time_to_fetch_seconds.observe(binding.time_to_fetch_s)
        try:
            with contextlib.ExitStack() as held:
                if lent is not None:
                    try:
                        held.enter_context(lent.acquire())  # mapped until the last copy
                    except LendGone:
                        await _invalid(context, f"{LEND_ENDED} before the Fetch used it")
                destination = await self._open(transport, binding, request, lent, context)
                held.callback(destination.close)
                binding.cut_short = destination.cut_short
                batch_bytes = FIRST_BATCH_BYTES
                while True:
                    if destination.whole_batches:
                        ready = await self._ready(binding, wakeup, math.inf, WHOLE_BATCH_CHUNKS)
                    else:
                        ready = await self._ready(binding, wakeup, batch_bytes, BATCH_CHUNKS)
                    if isinstance(ready, FetchEnd):
                        # A data connection ends (or is kept) before the TransferDone.
                        await destination.finish()
                        done = self._fetch_done(ready, started, destination.transport)
                        await context.write(done)
                        return
                    await self._send(destination, ready, binding, context)
                    batch_bytes = min(BATCH_BYTES, batch_bytes * BATCH_GROWTH)
        finally:
            # Consumer cancelled or disconnected: the id returns to where it was.
            self._lot.cancel_fetch(binding)

    def _pick_transport(self, request: pb.FetchRequest) -> pb.Transport:
        """The first transport the consumer accepts that this producer offers."""
        for transport in request.accept_transports:
            if transport == TCP and self._data is not None:
                return TCP
            if transport == SHM and self._shm is not None:
                return SHM
            if transport == GRPC:
                return GRPC
        return GRPC

    async def _lent_for_fetch(self, request: pb.FetchRequest, context: Any) -> Any:
        """The buffer a TRANSPORT_SHM Fetch names, checked before anything binds, so a bad one
        costs nothing (the consumer falls back to another transport)."""
        assert self._shm is not None
        lent = self._shm.get(request.shm_lend_id, "fetch")
        if lent is None:
            await _invalid(context, f"{LEND_UNKNOWN} to this producer for Fetch")
        if not 0 < request.shm_length <= lent.nbytes - request.shm_offset:
            await _invalid(
                context,
                f"shm range {request.shm_offset}+{request.shm_length} is empty or beyond the "
                f"{lent.nbytes}-byte lent buffer",
            )
        return lent

    async def _open(
        self,
        transport: pb.Transport,
        binding: FetchBinding,
        request: pb.FetchRequest,
        lent: Any,
        context: Any,
    ) -> Destination:
        stall_s = self._fetch_stall_timeout_s
        if transport == SHM:
            target = lent.view[request.shm_offset : request.shm_offset + request.shm_length]
            return ShmStream(
                context,
                target,
                limit=request.shm_length,
                threads=self._threads,
                stall_s=stall_s,
                on_stall=self._on_stall(binding, context),
            )
        if transport == TCP:
            assert self._data is not None
            ticket, arrival = self._data.expect()
            try:
                offer = pb.DataOffer(
                    transport=TCP, address=self._data_address, ticket=ticket, tls=self._data.tls
                )
                await context.write(pb.FetchResponse(data_offer=offer).SerializeToString())
                try:
                    async with asyncio.timeout(stall_s):
                        sock = await arrival
                except TimeoutError:
                    self._stalled(binding, binding.entry.kv_request_id, context)
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the consumer did not connect to the data address within {stall_s:g}s",
                    )
            except BaseException:
                # A connection delivered in the very turn the Fetch was cancelled or timed out.
                if arrival.done() and not arrival.cancelled():
                    arrival.result().close()
                raise
            finally:
                self._data.forget(ticket)  # used or not, it opens nothing any more
            keep = self._data.keep if request.reuse_data_connection else None
            return TcpStream(sock, stall_s, self._threads, keep)
        return GrpcStream(context, stall_s, self._on_stall(binding, context))

    def _on_stall(self, binding: FetchBinding, context: Any) -> Callable[[], None]:
        """What a write that waited fetch_stall_timeout_s for the consumer does."""
        return functools.partial(self._stalled, binding, binding.entry.kv_request_id, context)

    async def _ready(
        self, binding: FetchBinding, wakeup: asyncio.Event, max_bytes: float, max_chunks: float
    ) -> list[ReadyChunk] | FetchEnd:
        """The next chunks the binding may send (as many as are ready, up to `max_bytes` and
        `max_chunks`), or how it ended; waits, bounded by the binding's stall wait, while
        nothing is ready."""
        clock = self._lot.clock
        while True:
            wakeup.clear()  # before asking, so a notify during the answer is not lost
            step = self._lot.next_for(binding)
            if isinstance(step, ReadyChunk):
                batch, size = [step], step.nbytes
                # Never ask past the last chunk: that answer delivers the id, which must wait
                # until these chunks are really out.
                while size < max_bytes and len(batch) < max_chunks and binding.remaining() != 0:
                    more = self._lot.next_for(binding)
                    if not isinstance(more, ReadyChunk):
                        break
                    batch.append(more)
                    size += more.nbytes
                return batch
            if isinstance(step, FetchEnd):
                return step
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # lands in the same turn as the wakeup, leaving the id BOUND to a consumer that
                # is gone until the wait runs out.
                async with asyncio.timeout(max(0.0, step.deadline - clock())):
                    await wakeup.wait()
            except TimeoutError:
                return self._lot.fetch_wait_expired(binding)

    async def _send(
        self, destination: Destination, chunks: list[ReadyChunk], binding: FetchBinding,
        context: Any,
    ) -> None:  # fmt: skip
        last = binding.remaining() == 0  # no chunk of this Fetch follows the batch
        if not isinstance(destination, ShmStream):
            await self._write(destination, chunks, binding, context, last=last)
            return
        # As when a consumer's own buffer runs out on the other transports: every chunk that
        # fits is placed, and the refusal names the first that does not, with its size, so the
        # consumer can say how many bytes the load needs. OUT_OF_RANGE, not the lend refusals'
        # INVALID_ARGUMENT: a consumer must not take a range that is too small for a lend the
        # producer does not hold and retry the load on another transport.
        fits = destination.fitting(chunks)
        if fits:
            whole = fits == len(chunks)
            await self._write(destination, chunks[:fits], binding, context, last=last and whole)
        if fits < len(chunks):
            too_big = chunks[fits]
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"chunk {too_big.chunk_id} ({too_big.nbytes} bytes) does not fit in the "
                f"{destination.room_left} bytes left of the lent shm range; the id keeps its "
                "bytes",
            )

    async def _write(
        self, destination: Destination, chunks: list[ReadyChunk], binding: FetchBinding,
        context: Any, *, last: bool,
    ) -> None:  # fmt: skip
        """Sends a batch the destination has room for; `last`: no chunk of the Fetch follows."""
        kid = binding.entry.kv_request_id
        stall_s = self._fetch_stall_timeout_s
        before = destination.sent_bytes
        try:
            await destination.send(chunks, last=last)
            self._lot.sent(binding)
        except Stalled:
            self._stalled(binding, kid, context)
        except CutShort as cut:  # the shutdown grace ended its id: the TransferDone follows
            self._lot.not_sent(binding, chunks[cut.chunks :])
        except OSError as exc:  # the data connection broke: the consumer closed or reset it
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the data connection broke: {exc}")
        finally:
            # What went out, also of a batch cut off: not the batch, which may be a whole id.
            self._metrics.count_sent(destination.sent_bytes - before, destination.transport)
        if not binding.active and binding.failed is None:  # cut off for stalling
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the consumer read nothing for {stall_s:g}s (fetch_stall_timeout_s)",
            )

    def _fetch_done(self, end: FetchEnd, started: float, transport: pb.Transport) -> bytes:
        reason = end.refusal.reason if end.refusal is not None else pb.REASON_UNSPECIFIED
        self._metrics.count_fetch(reason)
        self._metrics.fetch_duration_seconds.observe(time.monotonic() - started)
        done = pb.TransferDone(
            status=pb.STATUS_FAILED if end.refusal is not None else pb.STATUS_OK,
            reason=reason,
            detail=end.refusal.detail if end.refusal is not None else "",
            chunks_sent=end.chunks_sent,
            bytes_sent=end.bytes_sent,
            delivery_id=end.delivery_id,
            producer_epoch=self._lot.epoch,
            transport=transport,
        )
        return wire.encode_done(done)

    # ======================================================================== Unary methods
    async def KeepAlive(
        self, raw: pb.KeepAliveRequest | Malformed, context: Any
    ) -> pb.KeepAliveResponse:
        request = await _well_formed(context, raw)
        ids = await _valid_ids(context, request.kv_request_ids)
        extend_s = request.extend_s
        if not math.isfinite(extend_s) or extend_s < 0:
            await _invalid(context, f"extend_s must be >= 0 and finite, got {extend_s!r}")
        reply = pb.KeepAliveResponse()
        async for part in _in_slices(ids):
            _add_states(reply.states, self._lot.keep_alive(part, extend_s))
        return reply

    async def Release(self, raw: pb.ReleaseRequest | Malformed, context: Any) -> pb.ReleaseResponse:
        request = await _well_formed(context, raw)
        kid = await _valid_id(context, request.kv_request_id)
        confirm = request.delivery_id
        refusal = None if confirm else self._refuse_give_up(context.invocation_metadata())
        if refusal is not None:
            await context.abort(*refusal)
        refused = self._lot.release(kid, confirm)
        if refused is None:
            if not confirm:  # confirmations are the normal end of every load: not logged
                fields = {"id": printable_id(kid), "peer": context.peer()}
                log.info("released", extra={"kv": fields})
            return pb.ReleaseResponse(status=pb.STATUS_OK)
        return pb.ReleaseResponse(
            status=pb.STATUS_FAILED, reason=refused.reason, detail=refused.detail
        )

    async def Lookup(self, raw: pb.LookupRequest | Malformed, context: Any) -> pb.LookupResponse:
        request = await _well_formed(context, raw)
        ids = await _valid_ids(context, request.kv_request_ids)
        reply = pb.LookupResponse()
        async for part in _in_slices(ids):
            _add_states(reply.states, self._lot.lookup(part))
        return reply

    async def GetServerInfo(
        self, raw: pb.GetServerInfoRequest | Malformed, context: Any
    ) -> pb.ServerInfo:
        await _well_formed(context, raw)
        return self._server_info()

    # ================================================================================ helpers
    def _stalled(self, binding: FetchBinding, kid: str, context: Any) -> None:
        """A chunk's write has not completed for fetch_stall_timeout_s: the consumer is not
        reading. Its id goes back to where it was with a fresh timer: PARKED with a lease, or
        DELIVERED with a grace. Once per Fetch: a gRPC write's watchdog may have cut it off
        already when the stream then reports the stall."""
        if not binding.active:
            return
        self._lot.stall_fetch(binding)
        self._warnings.warn(
            "stalled_fetch",
            kid,
            "Fetch cut off: its consumer read nothing; the id keeps its bytes with a fresh timer",
            lambda: {"id": printable_id(kid), "peer": context.peer()},
        )

    def _warn_late(self, kind: str, kid: str, refusal: Refusal, context: Any) -> None:
        # Most late calls are suppressed: their fields are only built for the ones logged.
        self._warnings.warn(
            kind,
            kid,
            f"{kind.replace('_', ' ')} for an ended id answered at once",
            lambda: {
                "id": printable_id(kid),
                "reason": reason_name(refusal.reason),
                "detail": refusal.detail,
                "peer": context.peer(),
            },
        )


def _interrupt(task: asyncio.Task[Any]) -> None:
    """Wakes a Park handler waiting for the client's next message. Never the running task
    itself: a handler whose own call ended its batch sees the refusal as a return value."""
    if task is not asyncio.current_task():
        task.cancel(_WAKEUP)


def _uncancel_wakeup(task: asyncio.Task[Any]) -> bool:
    """True (and the cancel taken back) when the CancelledError being handled was our wakeup
    rather than grpc cancelling the call."""
    if task.cancelling() == 1:
        task.uncancel()
        return True
    return False


_WAKEUP = "kvpark: Park batch ended from outside its call"


async def _parse_park(context: Any, raw: bytes) -> wire.ParkMessage:
    try:
        message = wire.parse_park_request(raw)
    except wire.WireError as exc:
        await _invalid(context, f"malformed ParkRequest: {exc}")
    if message is None:
        await _invalid(context, "ParkRequest with neither header nor chunk")
    return message


async def _invalid(context: Any, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("unreachable: context.abort raises")


async def _valid_id(context: Any, kid: str) -> str:
    problem = id_problem(kid)
    if problem is not None:
        await _invalid(context, problem)
    return kid


async def _valid_fingerprint(context: Any, field_name: str, value: bytes) -> bytes:
    problem = fingerprint_problem(value)
    if problem is not None:
        await _invalid(context, f"{field_name}: {problem}")
    return value


async def _valid_ids(context: Any, raw_ids: Any) -> list[str]:
    if not raw_ids:
        await _invalid(context, "kv_request_ids is empty")
    if len(raw_ids) > MAX_IDS_PER_CALL:  # before copying: a huge list must cost nothing
        await _invalid(context, f"{len(raw_ids)} ids in one call, at most {MAX_IDS_PER_CALL}")
    ids: list[str] = list(raw_ids)
    for start in range(0, len(ids), IDS_PER_SLICE):
        if start:
            await asyncio.sleep(0)  # let other calls run between slices
        for kid in ids[start : start + IDS_PER_SLICE]:
            await _valid_id(context, kid)
    return ids


async def _in_slices(ids: list[str]) -> AsyncIterator[list[str]]:
    """`ids` in slices of IDS_PER_SLICE, yielding the event loop before every slice but the
    first."""
    for start in range(0, len(ids), IDS_PER_SLICE):
        if start:
            await asyncio.sleep(0)
        yield ids[start : start + IDS_PER_SLICE]


class Malformed:
    """Stands in for a request whose bytes did not parse, so the handler can answer
    INVALID_ARGUMENT (a raising deserializer would make grpc answer INTERNAL)."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.problem = f"malformed {message_type}: {error}"


def _lenient(message_type: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return message_type.FromString(raw)
        except Exception as exc:  # protobuf's DecodeError and friends
            return Malformed(message_type.DESCRIPTOR.name, exc)

    return parse


async def _well_formed(context: Any, request: T | Malformed) -> T:
    if isinstance(request, Malformed):
        await _invalid(context, request.problem)
    return request


def _add_states(states: Any, statuses: list[IdStatus]) -> None:
    """Appends each status to a repeated IdState field in place (building IdState messages
    first and passing them in would copy each one again)."""
    add = states.add
    for s in statuses:
        add(
            kv_request_id=s.kv_request_id,
            state=s.state,
            reason=s.reason,
            chunks_parked=s.chunks_parked,
            total_chunks=s.total_chunks,
            bytes=s.nbytes,
            age_s=s.age_s,
            lease_remaining_s=s.lease_remaining_s,
            fingerprint=s.fingerprint,
        )


def method_handlers(servicer: KVProducerServicer) -> grpc.GenericRpcHandler:
    """The service's method table: identity (de)serializers on the two data-path methods."""

    def unary(behavior: Any, request_type: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=_lenient(request_type),
            response_serializer=lambda m: m.SerializeToString(),
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            # Raw bytes in: kvpark.wire parses chunks as views, without protobuf copies.
            "Park": grpc.stream_unary_rpc_method_handler(
                servicer.Park, response_serializer=lambda m: m.SerializeToString()
            ),
            # Raw bytes out: frames built by kvpark.wire straight from pool memory. The handler
            # writes them with `context.write`, the documented form of a grpc.aio
            # server-streaming handler that is a coroutine rather than a generator.
            "Fetch": grpc.unary_stream_rpc_method_handler(
                servicer.Fetch, request_deserializer=_lenient(pb.FetchRequest)
            ),
            "KeepAlive": unary(servicer.KeepAlive, pb.KeepAliveRequest),
            "Release": unary(servicer.Release, pb.ReleaseRequest),
            "Lookup": unary(servicer.Lookup, pb.LookupRequest),
            "GetServerInfo": unary(servicer.GetServerInfo, pb.GetServerInfoRequest),
        },
    )
