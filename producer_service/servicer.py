"""Maps the kvpark.v1 contract onto the lot: parse, validate, ask the lot, answer.

No protocol decisions live here (they are the lot's); this module only translates requests,
maps malformed input to INVALID_ARGUMENT with a message saying what is wrong, counts outcomes
and rate-limits warnings.

The data path skips protobuf (performance-notes.md, lever 2): Park is registered with an
identity request deserializer and Fetch with an identity response serializer, and
`kvpark.wire` builds and parses the same bytes the generated classes would. Every other method
uses the generated message classes. The method table lives in `method_handlers()`, the one place
that registers the service.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvpark import wire
from kvpark.ids import id_problem, printable_id
from kvpark.pb import kvpark_pb2 as pb

from .logs import LOGGER_NAME, RateLimitedWarnings
from .lot import (
    FetchEnd,
    FetchWait,
    Lot,
    MalformedRequest,
    ParkBatch,
    ReadyChunk,
    Refusal,
    reason_name,
)
from .metrics import ProducerMetrics

SERVICE_NAME = "kvpark.v1.KVProducer"
T = TypeVar("T")
MAX_IDS_PER_CALL = 10_000
log = logging.getLogger(LOGGER_NAME)


class KVProducerServicer:
    def __init__(
        self,
        lot: Lot,
        metrics: ProducerMetrics,
        *,
        max_chunk_bytes: int,
        server_info: Callable[[], pb.ServerInfo],
    ) -> None:
        self._lot = lot
        self._metrics = metrics
        self._max_chunk_bytes = max_chunk_bytes
        self._server_info = server_info
        self._warnings = RateLimitedWarnings(log, metrics.count_suppressed)

    # =================================================================================== Park
    async def Park(self, requests: AsyncIterator[bytes], context: Any) -> pb.ParkResponse:
        first = await anext(requests, None)
        if first is None:
            await _invalid(context, "empty Park stream: the first message must be a ParkHeader")
        header = await _parse_park(context, first)
        if not isinstance(header, pb.ParkHeader):
            await _invalid(context, "the first Park message must be a ParkHeader")
        kid = await _valid_id(context, header.kv_request_id)
        opened = self._lot.begin_park(kid, header.total_chunks, header.batch_bytes)
        if isinstance(opened, Refusal):
            if opened.late:
                self._warn_late("late_park", kid, opened, context)
            return self._park_failed(opened)
        batch: ParkBatch = opened
        # A stream that goes quiet for as long as a lease is stuck: its batch is undone then,
        # rather than holding its reserved pages while the client lives on without sending.
        idle_s = self._lot.settings.unbound_store_timeout_s
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_s):
                        raw = await anext(requests)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    return self._park_failed(self._lot.expire_park(batch, idle_s))
                message = await _parse_park(context, raw)
                if not isinstance(message, wire.ChunkView):
                    self._lot.abort_park(batch)
                    await _invalid(
                        context, "ParkHeader repeated: only the first message may be a header"
                    )
                if len(message.data) > self._max_chunk_bytes:
                    self._lot.abort_park(batch)
                    await _invalid(
                        context,
                        f"chunk {message.chunk_id} is {len(message.data)} bytes, "
                        f"more than max_chunk_bytes {self._max_chunk_bytes}",
                    )
                try:
                    refused = self._lot.park_chunk(
                        batch, message.chunk_id, message.data, message.crc32c
                    )
                except MalformedRequest as exc:
                    await _invalid(context, str(exc))
                if refused is not None:
                    if refused.late:
                        self._warn_late("late_park", kid, refused, context)
                    return self._park_failed(refused)
            # A client that went away (cancel, deadline, crash) ends the request stream just
            # like one that finished, and grpc.aio cancels this task a loop turn later: give it
            # that turn and look, so a cut-off batch is undone below instead of committed.
            await asyncio.sleep(0)
            remaining = context.time_remaining()  # None without a deadline
            if context.cancelled() or (remaining is not None and remaining <= 0):
                raise asyncio.CancelledError
            done = self._lot.finish_park(batch)
        finally:
            # Cancelled, aborted or crashed mid-stream: the batch is undone (all-or-nothing).
            self._lot.abort_park(batch)
        if isinstance(done, Refusal):
            return self._park_failed(done)
        self._metrics.count_park(pb.REASON_UNSPECIFIED)
        return pb.ParkResponse(
            status=pb.STATUS_OK,
            chunks_parked=done.chunks_parked,
            producer_epoch=self._lot.epoch,
            lease_remaining_s=done.lease_remaining_s,
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
    async def Fetch(self, raw: pb.FetchRequest | Malformed, context: Any) -> bytes:
        """Streams the id's chunks with `context.write` and returns the final `TransferDone`
        frame (see `method_handlers` for why Fetch is registered this way)."""
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
        wakeup = asyncio.Event()
        try:
            bound = self._lot.bind_fetch(
                kid, request.chunk_ids, request.expected_epoch, wait_s, wakeup.set
            )
        except MalformedRequest as exc:
            await _invalid(context, str(exc))
        if isinstance(bound, Refusal):
            if bound.late:
                self._warn_late("late_fetch", kid, bound, context)
            return self._fetch_done(FetchEnd(bound, 0, 0), started)
        binding = bound
        if binding.time_to_fetch_s is not None:
            self._metrics.time_to_fetch_seconds.observe(binding.time_to_fetch_s)
        clock = self._lot.clock
        try:
            while True:
                wakeup.clear()  # before asking, so a notify during the answer is not lost
                step = self._lot.next_for(binding)
                if isinstance(step, ReadyChunk):
                    frame = wire.encode_fetch_chunk(step.chunk_id, step.crc32c, step.views)
                    self._metrics.sent_bytes_total.inc(step.nbytes)
                    await context.write(frame)
                elif isinstance(step, FetchWait):
                    try:
                        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel
                        # that lands in the same turn as the wakeup, leaving the id BOUND to a
                        # consumer that is gone until the wait runs out.
                        async with asyncio.timeout(max(0.0, step.deadline - clock())):
                            await wakeup.wait()
                    except TimeoutError:
                        return self._fetch_done(self._lot.fetch_wait_expired(binding), started)
                else:
                    return self._fetch_done(step, started)
        finally:
            # Consumer cancelled or disconnected: PARKED again with the old lease.
            self._lot.cancel_fetch(binding)

    def _fetch_done(self, end: FetchEnd, started: float) -> bytes:
        reason = end.refusal.reason if end.refusal is not None else pb.REASON_UNSPECIFIED
        self._metrics.count_fetch(reason)
        self._metrics.fetch_duration_seconds.observe(time.monotonic() - started)
        done = pb.TransferDone(
            status=pb.STATUS_FAILED if end.refusal is not None else pb.STATUS_OK,
            reason=reason,
            detail=end.refusal.detail if end.refusal is not None else "",
            chunks_sent=end.chunks_sent,
            bytes_sent=end.bytes_sent,
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
        states = self._lot.keep_alive(ids, extend_s)
        return pb.KeepAliveResponse(states=[_id_state(s) for s in states])

    async def Release(self, raw: pb.ReleaseRequest | Malformed, context: Any) -> pb.ReleaseResponse:
        request = await _well_formed(context, raw)
        kid = await _valid_id(context, request.kv_request_id)
        refused = self._lot.release(kid)
        if refused is None:
            log.info("released", extra={"kv": {"id": printable_id(kid), "peer": context.peer()}})
            return pb.ReleaseResponse(status=pb.STATUS_OK)
        return pb.ReleaseResponse(status=pb.STATUS_FAILED, reason=refused.reason)

    async def Lookup(self, raw: pb.LookupRequest | Malformed, context: Any) -> pb.LookupResponse:
        request = await _well_formed(context, raw)
        ids = await _valid_ids(context, request.kv_request_ids)
        return pb.LookupResponse(states=[_id_state(s) for s in self._lot.lookup(ids)])

    async def GetServerInfo(
        self, raw: pb.GetServerInfoRequest | Malformed, context: Any
    ) -> pb.ServerInfo:
        await _well_formed(context, raw)
        return self._server_info()

    # ================================================================================ helpers
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


async def _parse_park(context: Any, raw: bytes) -> pb.ParkHeader | wire.ChunkView:
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


async def _valid_ids(context: Any, raw_ids: Any) -> list[str]:
    if not raw_ids:
        await _invalid(context, "kv_request_ids is empty")
    if len(raw_ids) > MAX_IDS_PER_CALL:  # before copying: a huge list must cost nothing
        await _invalid(context, f"{len(raw_ids)} ids in one call, at most {MAX_IDS_PER_CALL}")
    ids: list[str] = list(raw_ids)
    for kid in ids:
        await _valid_id(context, kid)
    return ids


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


def _id_state(s: Any) -> pb.IdState:
    return pb.IdState(
        kv_request_id=s.kv_request_id,
        state=s.state,
        reason=s.reason,
        chunks_parked=s.chunks_parked,
        total_chunks=s.total_chunks,
        bytes=s.nbytes,
        age_s=s.age_s,
        lease_remaining_s=s.lease_remaining_s,
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
            # Raw bytes out: frames built by kvpark.wire straight from pool memory.
            # Registered unary-unary although the contract's Fetch is a server stream: on the
            # wire the two are the same (HTTP/2 carries messages, not the method's shape), and
            # grpc.aio sends a unary handler's returned message and the call's status in ONE
            # batch, where a streaming handler's status costs a second batch and event-loop
            # hop. Chunks go out with `context.write` before the return. So every Fetch — the
            # one-RTT late-fetch answer above all — ends with one write instead of two.
            # Clients see an ordinary server stream (tests use plain generated stubs).
            "Fetch": grpc.unary_unary_rpc_method_handler(
                servicer.Fetch, request_deserializer=_lenient(pb.FetchRequest)
            ),
            "KeepAlive": unary(servicer.KeepAlive, pb.KeepAliveRequest),
            "Release": unary(servicer.Release, pb.ReleaseRequest),
            "Lookup": unary(servicer.Lookup, pb.LookupRequest),
            "GetServerInfo": unary(servicer.GetServerInfo, pb.GetServerInfoRequest),
        },
    )
