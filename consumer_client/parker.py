"""`KVParker` and `AsyncKVParker`: the prefill side's clients, with the consumers' conventions
(target, token, credentials, timeout rule, context manager, one channel).

Two ways to park, both all-or-nothing on the producer:

    with KVParker("prefill-0:50051", token=park_token) as parker:
        result = parker.park("req-42", chunks)          # every chunk at hand: one call
        with parker.batch("req-43", total_chunks=n) as batch:   # KV produced layer by layer
            for chunk_id, kv in engine.layers():
                batch.put(chunk_id, kv)                  # sent while the next is computed
        batch.result                                     # committed on a clean exit

`park` declares the batch's size, so the producer reserves the pool up front or answers
POOL_FULL before any byte is sent; it then tries again while the call's timeout allows,
backing off from 50 ms and never waiting longer than the producer's `retry_after_s`. A `batch`
streams chunks as they are produced and is committed when the block ends cleanly; an
exception inside the block undoes it (no commit is sent, the call is cancelled, the producer
frees what arrived). A batch cannot be retried by the library (it does
not keep the chunks): `put` returns False once the producer ended the batch, and
`batch.result` says why. Every refusal is a `ParkResult` with `ok=False` and a reason;
exceptions are for misuse and misconfiguration, as for loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvpark.address import target_address
from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc
from kvpark.shm import PARK_ROLE

from ._async import caller_cancelled, given_back_if_abandoned
from ._channel import DEFAULT_MAX_CHUNK_BYTES, ChannelSettings
from ._core import (
    SERVICE,
    ClientBase,
    ClientCore,
    Transport,
    aread_info_before_lending,
    read_info_before_lending,
    release_request,
    valid_id,
)
from ._errors import UsageError, error_from_rpc
from ._models import ProducerInfo, ReleaseResult
from ._park import (
    Chunks,
    ParkFrames,
    ParkOutcome,
    ParkResult,
    PreparedChunk,
    ShmPlan,
    batch_frames,
    check_batch_bytes,
    check_fingerprint,
    check_total,
    monotonic,
    plan_shm,
    prepare_all,
)
from ._park_route import EMPTY_BATCH, BatchRoute
from ._shm import ShmAccess, lend_refused
from ._timeouts import DEFAULT_TIMEOUT, USE_CLIENT_DEFAULT, Timeout, TimeoutArg, resolve

PARK_METHOD = SERVICE + "Park"
# Frames a batch may have queued ahead of the transport: `put` blocks beyond it, so a prefill
# that produces KV faster than the network takes it does not buffer without bound.
_BATCH_QUEUE_FRAMES = 2
_END = object()


def _park_core(
    target: str,
    timeout: Timeout | float | None,
    token: str | None,
    credentials: grpc.ChannelCredentials | None,
    channel_options: Sequence[tuple[str, Any]],
    interceptors: Sequence[Any],
    max_chunk_bytes: int,
    transport: Transport,
    shm_socket: str | None,
) -> ClientCore:
    """What a sync or async parker knows and decides (its arguments checked)."""
    settings = ChannelSettings.build(
        target,
        token=token,
        credentials=credentials,
        channel_options=channel_options,
        interceptors=interceptors,
        max_chunk_bytes=max_chunk_bytes,
    )
    if transport == "tcp":
        raise UsageError("transport: Park goes over the gRPC stream or shared memory")
    return ClientCore(
        settings,
        timeout=timeout,
        confirm=False,
        transport=transport,
        shm_socket=shm_socket,
        role=PARK_ROLE,
    )


def _outcome(core: ClientCore, kid: str, timeout: TimeoutArg) -> ParkOutcome:
    deadline_s = resolve(timeout, core.timeout).total_s
    dialed = target_address(core.channel.target)
    producer = str(dialed) if dialed else ""
    return ParkOutcome(kid, deadline_s, monotonic, producer=producer, noted=core.note_park)


async def _planned(
    shm: ShmAccess, prepared: list[PreparedChunk], outcome: ParkOutcome
) -> ShmPlan | None:
    """`plan_shm` off the event loop: a lend waits on the shm socket, and staging copies the
    bytes. A caller cancelled meanwhile never gets the plan, so its staging buffer is given
    back once the thread is done (else every later park would find staging busy)."""
    job = asyncio.get_running_loop().run_in_executor(None, plan_shm, shm, prepared, outcome)
    return await given_back_if_abandoned(job, functools.partial(_unstage_unused, shm))


def _unstage_unused(shm: ShmAccess, plan: ShmPlan | None) -> None:
    if plan is not None and plan.staged:
        shm.unstage()


# ===================================================================================== sync
class KVParker(ClientBase):
    """A blocking park-side client for one producer (`target`, "host:port").

    `timeout` is the default of every call (README, "Timeouts"). Thread-safe: one parker (one
    channel) serves every thread of a prefill worker."""

    def __init__(
        self,
        target: str,
        *,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] = (),
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        transport: Transport = "auto",
        shm_socket: str | None = None,
    ) -> None:
        self._core = _park_core(
            target, timeout, token, credentials, channel_options, interceptors,
            max_chunk_bytes, transport, shm_socket,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._park: Any = None

    def close(self) -> None:
        """Closes the channel: parks in flight end and are undone by the producer. Idempotent."""
        with self._lock:
            self._core.closed = True
            channel, self._channel = self._channel, None
        self._core.shm.close()
        if channel is not None:
            channel.close()

    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A numpy array of `nbytes` in shared memory: build KV in it and park views of it,
        and on the producer's host the producer copies it from there (one copy, no gRPC)."""
        return self._core.shm.shared_buffer(nbytes)

    def __enter__(self) -> KVParker:
        self._core.check_open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    def _stubs(self) -> tuple[Any, Any]:
        with self._lock:
            self._core.check_open()
            if self._channel is None:
                self._channel = self._core.channel.open_sync()
                self._stub = kvpark_pb2_grpc.KVProducerStub(self._channel)
                # Raw frames: built by kvpark.wire from the caller's memory, one copy.
                self._park = self._channel.stream_unary(PARK_METHOD)
            return self._stub, self._park

    def park(
        self,
        kv_request_id: str,
        chunks: Chunks,
        *,
        total_chunks: int | None = None,
        fingerprint: bytes | None = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
    ) -> ParkResult:
        """Parks every chunk of one batch. `total_chunks`: the id's total when this batch is
        one of several; None when this batch is the whole id (its commit fixes the total).
        POOL_FULL is retried after the producer's `retry_after_s` while `timeout` allows."""
        kid = valid_id(kv_request_id)
        total = check_total(total_chunks)
        fp = check_fingerprint(fingerprint)
        prepared = prepare_all(chunks)
        size = sum(c.nbytes for c in prepared)
        outcome = _outcome(self._core, kid, timeout)
        read_info_before_lending(self._core, self.server_info, timeout, stages=True)
        plan = plan_shm(self._core.shm, prepared, outcome) if self._core.uses_shm else None
        try:
            while True:
                frames = ParkFrames(kid, total, size, plan.lend_id if plan else "", fp)
                result = self._call(outcome, iter(batch_frames(frames, prepared, plan)), plan)
                if plan is not None and lend_refused(result.grpc_code, result.detail):
                    self._core.shm.forget_refused(plan.lend_id)  # the next park lends it anew
                    self._unplan(plan)
                    plan = None  # the producer holds no such lend: inline
                    continue
                wait = outcome.retry_wait_s(result)
                if wait is None:
                    return result
                time.sleep(wait)
        finally:
            if plan is not None:
                self._unplan(plan)

    def _unplan(self, plan: ShmPlan) -> None:
        if plan.staged:
            self._core.shm.unstage()

    def _call(
        self, outcome: ParkOutcome, requests: Iterator[bytes], plan: ShmPlan | None
    ) -> ParkResult:
        _, park = self._stubs()
        transport = "shm" if plan else "grpc"
        try:
            raw = self._core.start_call(
                park, requests, timeout=outcome.remaining_s(), metadata=self._core.channel.metadata
            )
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED:
                self._core.check_open()
            return outcome.failed(exc.code(), exc.details() or "", transport)
        return outcome.answered(pb.ParkResponse.FromString(raw), transport)

    def batch(
        self,
        kv_request_id: str,
        *,
        total_chunks: int | None = None,
        batch_bytes: int = 0,
        fingerprint: bytes | None = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
    ) -> ParkBatch:
        """A batch to fill chunk by chunk (`put`), committed when its block ends cleanly and
        undone when it ends with an exception. `batch_bytes` > 0 reserves that much of the
        pool before the first chunk, less what the id holds committed already."""
        kid = valid_id(kv_request_id)
        frames = ParkFrames(
            kid,
            check_total(total_chunks),
            check_batch_bytes(batch_bytes),
            fingerprint=check_fingerprint(fingerprint),
        )
        outcome = _outcome(self._core, kid, timeout)
        read_info_before_lending(self._core, self.server_info, timeout)
        shm = self._core.shm if self._core.uses_shm else None
        route = BatchRoute(frames, shm, outcome, can_lend=True)
        route.lend_at_start()
        _, park = self._stubs()
        return self._core.start_call(
            ParkBatch, park, self._core.channel.metadata, route, outcome, self._core.check_open
        )

    def release(
        self, kv_request_id: str, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Gives an id up: frees its memory on the producer, tombstones it RELEASED."""
        request = release_request(kv_request_id)
        stub, _ = self._stubs()
        try:
            reply = self._core.start_call(
                stub.Release,
                request,
                timeout=self._core.call_deadline(timeout),
                metadata=self._core.channel.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Release") from None
        return ReleaseResult.from_proto(request.kv_request_id, reply)

    def server_info(self, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT) -> ProducerInfo:
        """The producer's epoch, limits and timeouts (one GetServerInfo call)."""
        stub, _ = self._stubs()
        try:
            msg = self._core.start_call(
                stub.GetServerInfo,
                pb.GetServerInfoRequest(),
                timeout=self._core.call_deadline(timeout),
                metadata=self._core.channel.metadata,
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "GetServerInfo") from None
        return self._core.set_info(ProducerInfo.from_proto(msg))


class ParkBatch:
    """One streaming Park call (made by `KVParker.batch`). `put` sends a chunk; leaving the
    `with` block commits it, or undoes it when the block raised. Chunks in one of the parker's
    shared buffers go by reference (kvpark/client/_park_route.py)."""

    def __init__(
        self,
        park: Any,
        metadata: Any,
        route: BatchRoute,
        outcome: ParkOutcome,
        check_open: Callable[[], None],
    ) -> None:
        self._park = park
        self._metadata = metadata
        self._route = route
        self._outcome = outcome
        self._check_open = check_open  # ClientClosedError once the parker closed
        self._ended = False
        self.result: ParkResult | None = None
        self._start()
        if route.header_at_start is not None:
            self._frames.send(route.header_at_start)

    def _start(self) -> None:
        """Starts the call, its frames read from a queue of their own."""
        frames = _CallFrames()
        self._frames = frames
        self._future = self._park.future(
            iter(frames), timeout=self._outcome.remaining_s(), metadata=self._metadata
        )
        # Once the call ended (a refusal, a deadline), grpc reads no more frames: the queue
        # drops them from then on, so no `put` waits for a reader that is gone.
        self._future.add_done_callback(lambda _: frames.close())

    def _lend_refused(self) -> bool:
        """The call ended with the producer refusing the lend, and the batch can go on
        inline."""
        if not self._future.done() or self._future.cancelled():
            return False
        failure = self._future.exception()
        return isinstance(failure, grpc.RpcError) and self._route.may_go_inline(
            failure.code(), failure.details()
        )

    def _went_inline(self) -> bool:
        """After a refused lend: a new call now carries every chunk put so far inline."""
        if not self._lend_refused():
            return False
        # Closing the parker ends its lends too, so a refusal may come from the close: no
        # new call then (grpc refuses one on a closed channel), the batch ends as the close.
        self._check_open()
        self._route.forget_lend()
        self._start()
        for frame in self._route.inline():
            self._frames.send(frame)
        return True

    @property
    def done(self) -> bool:
        """True once the producer answered (a refusal ends a batch before its commit)."""
        return bool(self._future.done()) and not self._lend_refused()

    def put(self, chunk_id: int, payload: Any) -> bool:
        """Sends one chunk (a buffer, or a list of buffers sent as one chunk); blocks while
        the transport is behind. False when the producer already ended the batch: stop
        producing and read `result` after the block. A chunk in one of this parker's shared
        buffers goes by reference: the producer copies it after `put` returns, so leave those
        bytes unchanged until the batch is committed."""
        if self._ended:
            raise UsageError("put on a batch that was already committed or undone")
        chunk = self._route.prepared(chunk_id, payload)
        if self._future.done() and not self._went_inline():
            return False
        place = self._route.place_of(chunk)
        for frame in self._route.frames_for(chunk, place):
            self._frames.send(frame)
        return not self._future.done() or self._went_inline()

    def commit(self) -> ParkResult:
        """Sends the commit and waits for the producer's answer (done by a clean `with` exit).
        A batch nothing was put in is undone instead: UsageError, as for `park` with no chunk;
        ClientClosedError once the parker was closed, as for `park`."""
        if self._ended:
            raise UsageError("the batch was already committed or undone")
        if self._route.empty:
            self.abort()  # nothing to park: the call ends and the producer keeps nothing
            self._check_open()  # a closed parker's batch is that first, as for `park`
            raise UsageError(EMPTY_BATCH)
        self._ended = True
        try:
            return self._committed()
        except BaseException:
            # abort() does nothing once the batch ended: an interrupt while frames are
            # queued must not leave the call open, the producer holding the batch's pages.
            self._future.cancel()
            self._frames.close()
            raise
        finally:
            self._route.finished()

    def _committed(self) -> ParkResult:
        if not self._route.started:
            self._frames.send(self._route.opening())
        while True:
            for frame in [*self._route.flush(), self._route.frames.commit()]:
                self._frames.send(frame)
            self._frames.send(_END)
            try:
                raw = self._future.result()
                self.result = self._route.answered(self._outcome, raw)
            except grpc.RpcError as exc:
                if self._went_inline():
                    continue
                if exc.code() is grpc.StatusCode.CANCELLED:
                    self._check_open()
                self.result = self._route.failed(self._outcome, exc.code(), exc.details())
            return self.result

    def abort(self) -> None:
        """Undoes the batch: no commit is sent and the call is cancelled."""
        if not self._ended:
            self._ended = True
            self._future.cancel()
            self._frames.close()
            self._route.finished()

    def __enter__(self) -> ParkBatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if exc_type is None:
            if not self._ended:
                self.commit()
        else:
            self.abort()


class _CallFrames:
    """The frames of one streaming call, from the caller's thread to grpc's. `send` blocks
    while the transport is behind; once the call ended (`close`, also after the last frame)
    frames are dropped, so a sender never waits for a reader that is gone."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_BATCH_QUEUE_FRAMES)
        self._closed = False

    def send(self, frame: Any) -> None:
        """Queues a frame (or _END, the last)."""
        if not self._closed:
            self._queue.put(frame)  # a close meanwhile makes room: this returns

    def close(self) -> None:
        self._closed = True
        while True:  # room for a send already waiting, and for the end marker
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_END)

    def __iter__(self) -> Iterator[bytes]:
        while (frame := self._queue.get()) is not _END:
            yield frame


# ==================================================================================== async
class AsyncKVParker(ClientBase):
    """An asyncio park-side client for one producer, with `KVParker`'s method names."""

    def __init__(
        self,
        target: str,
        *,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] = (),
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        transport: Transport = "auto",
        shm_socket: str | None = None,
    ) -> None:
        self._core = _park_core(
            target, timeout, token, credentials, channel_options, interceptors,
            max_chunk_bytes, transport, shm_socket,
        )  # fmt: skip
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._park: Any = None

    async def aclose(self) -> None:
        """Closes the channel: parks in flight end and are undone by the producer. Idempotent."""
        self._core.closed = True
        channel, self._channel = self._channel, None
        self._core.shm.close()
        if channel is not None:
            await channel.close()

    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """As `KVParker.shared_buffer`."""
        return self._core.shm.shared_buffer(nbytes)

    async def __aenter__(self) -> AsyncKVParker:
        self._core.check_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()

    def _stubs(self) -> tuple[Any, Any]:
        self._core.check_open()
        if self._channel is None:
            self._channel = self._core.channel.open_aio()
            self._stub = kvpark_pb2_grpc.KVProducerStub(self._channel)
            self._park = self._channel.stream_unary(PARK_METHOD)
        return self._stub, self._park

    async def park(
        self,
        kv_request_id: str,
        chunks: Chunks,
        *,
        total_chunks: int | None = None,
        fingerprint: bytes | None = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
    ) -> ParkResult:
        """As `KVParker.park`."""
        kid = valid_id(kv_request_id)
        total = check_total(total_chunks)
        fp = check_fingerprint(fingerprint)
        prepared = prepare_all(chunks)
        size = sum(c.nbytes for c in prepared)
        outcome = _outcome(self._core, kid, timeout)
        await aread_info_before_lending(self._core, self.server_info, timeout, stages=True)
        plan = await _planned(self._core.shm, prepared, outcome) if self._core.uses_shm else None
        try:
            while True:
                frames = ParkFrames(kid, total, size, plan.lend_id if plan else "", fp)

                async def requests(
                    frames: ParkFrames = frames, plan: ShmPlan | None = plan
                ) -> AsyncIterator[bytes]:
                    for frame in batch_frames(frames, prepared, plan):
                        yield frame

                result = await self._call(outcome, requests(), plan)
                if plan is not None and lend_refused(result.grpc_code, result.detail):
                    self._core.shm.forget_refused(plan.lend_id)  # the next park lends it anew
                    if plan.staged:
                        self._core.shm.unstage()
                    plan = None  # the producer holds no such lend: inline
                    continue
                wait = outcome.retry_wait_s(result)
                if wait is None:
                    return result
                await asyncio.sleep(wait)
        finally:
            if plan is not None and plan.staged:
                self._core.shm.unstage()

    async def _call(
        self, outcome: ParkOutcome, requests: AsyncIterator[bytes], plan: ShmPlan | None
    ) -> ParkResult:
        _, park = self._stubs()
        transport = "shm" if plan else "grpc"
        try:
            raw = await park(
                requests, timeout=outcome.remaining_s(), metadata=self._core.channel.metadata
            )
        except grpc.aio.AioRpcError as exc:
            return outcome.failed(exc.code(), exc.details() or "", transport)
        except asyncio.CancelledError:
            if caller_cancelled():
                raise
            self._core.check_open()
            return outcome.failed(grpc.StatusCode.CANCELLED, "call cancelled", transport)
        return outcome.answered(pb.ParkResponse.FromString(raw), transport)

    def batch(
        self,
        kv_request_id: str,
        *,
        total_chunks: int | None = None,
        batch_bytes: int = 0,
        fingerprint: bytes | None = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
    ) -> AsyncParkBatch:
        """As `KVParker.batch`, for `async with`."""
        kid = valid_id(kv_request_id)
        frames = ParkFrames(
            kid,
            check_total(total_chunks),
            check_batch_bytes(batch_bytes),
            fingerprint=check_fingerprint(fingerprint),
        )
        outcome = _outcome(self._core, kid, timeout)
        shm = self._core.shm if self._core.uses_shm else None
        route = BatchRoute(frames, shm, outcome, can_lend=not self._core.lends_blind())
        _, park = self._stubs()
        # Lending may need the producer's epoch first: read before the first chunk is routed.
        core, info = self._core, self.server_info
        lending = functools.partial(aread_info_before_lending, core, info, timeout)
        return AsyncParkBatch(
            park, self._core.channel.metadata, route, outcome, core.check_open, lending
        )

    async def release(
        self, kv_request_id: str, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Gives an id up: frees its memory on the producer, tombstones it RELEASED."""
        request = release_request(kv_request_id)
        stub, _ = self._stubs()
        try:
            reply = await stub.Release(
                request,
                timeout=self._core.call_deadline(timeout),
                metadata=self._core.channel.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, "Release") from None
        return ReleaseResult.from_proto(request.kv_request_id, reply)

    async def server_info(self, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT) -> ProducerInfo:
        """The producer's epoch, limits and timeouts (one GetServerInfo call)."""
        stub, _ = self._stubs()
        try:
            msg = await stub.GetServerInfo(
                pb.GetServerInfoRequest(),
                timeout=self._core.call_deadline(timeout),
                metadata=self._core.channel.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, "GetServerInfo") from None
        return self._core.set_info(ProducerInfo.from_proto(msg))


class AsyncParkBatch:
    """One streaming Park call (made by `AsyncKVParker.batch`): `await put(...)`; leaving the
    `async with` block commits it, or undoes it when the block raised."""

    def __init__(
        self,
        park: Any,
        metadata: Any,
        route: BatchRoute,
        outcome: ParkOutcome,
        check_open: Callable[[], None],
        before_first_put: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._park = park
        self._metadata = metadata
        self._route = route
        self._outcome = outcome
        self._check_open = check_open  # ClientClosedError once the parker closed
        self._before_first_put = before_first_put
        self._ended = False
        self.result: ParkResult | None = None
        self._start()
        if route.header_at_start is not None:
            self._frames.send_nowait(route.header_at_start)

    def _start(self) -> None:
        frames = _AsyncCallFrames()
        self._frames = frames
        call = self._park(
            aiter(frames), timeout=self._outcome.remaining_s(), metadata=self._metadata
        )
        self._call = call
        # Whether the call ended refusing the lend: `done` must say so without awaiting, and
        # a grpc.aio call tells its status only to an await.
        self._refused: bool | None = None

        def ended(_: Any) -> None:
            frames.close()
            self._noting = asyncio.ensure_future(self._note_status(call))

        call.add_done_callback(ended)

    async def _note_status(self, call: Any) -> None:
        refused = await self._lend_refused(call)
        if call is self._call:
            self._refused = refused

    async def _lend_refused(self, call: Any) -> bool:
        """As `ParkBatch._lend_refused`, for `call`."""
        if not call.done() or call.cancelled():
            return False
        return self._route.may_go_inline(await call.code(), await call.details())

    async def _went_inline(self) -> bool:
        """As `ParkBatch._went_inline`."""
        if not await self._lend_refused(self._call):
            return False
        self._check_open()  # as in ParkBatch._went_inline
        self._route.forget_lend()
        self._start()
        for frame in self._route.inline():
            await self._frames.send(frame)
        return True

    @property
    def done(self) -> bool:
        """As `ParkBatch.done` (False until the call's status is known)."""
        return bool(self._call.done()) and self._refused is False

    async def put(self, chunk_id: int, payload: Any) -> bool:
        """As `ParkBatch.put`."""
        if self._ended:
            raise UsageError("put on a batch that was already committed or undone")
        chunk = self._route.prepared(chunk_id, payload)
        if self._call.done() and not await self._went_inline():
            return False
        if not self._route.started and self._before_first_put is not None:
            await self._before_first_put()
        if self._route.may_lend(chunk):  # waits on the shm socket: off the event loop
            place = await asyncio.to_thread(self._route.place_of, chunk)
        else:
            place = self._route.place_of(chunk)
        for frame in self._route.frames_for(chunk, place):
            await self._frames.send(frame)
        return not self._call.done() or await self._went_inline()

    async def commit(self) -> ParkResult:
        """As `ParkBatch.commit` (done by a clean exit)."""
        if self._ended:
            raise UsageError("the batch was already committed or undone")
        if self._route.empty:
            self.abort()  # nothing to park: the call ends and the producer keeps nothing
            self._check_open()  # a closed parker's batch is that first, as for `park`
            raise UsageError(EMPTY_BATCH)
        self._ended = True
        try:
            return await self._committed()
        except BaseException:
            # abort() does nothing once the batch ended: without this a cancel while frames
            # are queued would leave the call open (the producer holding the batch's pages),
            # or let a commit already queued commit the batch after its caller was cancelled.
            # No await before the cancel: the writer sends no frame meanwhile.
            self._call.cancel()
            self._frames.close()
            raise
        finally:
            self._route.finished()

    async def _committed(self) -> ParkResult:
        if not self._route.started:
            await self._frames.send(self._route.opening())
        while True:
            await self._send_commit()
            try:
                raw = await self._call
                self.result = self._route.answered(self._outcome, raw)
            except grpc.aio.AioRpcError as exc:
                if await self._went_inline():
                    continue
                if exc.code() is grpc.StatusCode.CANCELLED:
                    self._check_open()
                self.result = self._route.failed(self._outcome, exc.code(), exc.details())
            except asyncio.CancelledError:
                # The parker's aclose() cancels the call; only the caller's own cancel
                # cancels the caller.
                if caller_cancelled():
                    raise
                self._check_open()
                cancelled = grpc.StatusCode.CANCELLED
                self.result = self._route.failed(self._outcome, cancelled, "call cancelled")
            return self.result

    async def _send_commit(self) -> None:
        """Queues the chunks still held back, the commit and the end of the stream."""
        for frame in self._route.flush():
            await self._frames.send(frame)
        await self._frames.send_commit(self._route.frames.commit())
        await self._frames.send(_END)

    def abort(self) -> None:
        """Undoes the batch: no commit is sent and the call is cancelled."""
        if not self._ended:
            self._ended = True
            self._call.cancel()
            self._frames.close()
            self._route.finished()

    async def __aenter__(self) -> AsyncParkBatch:
        if self._route.lends_at_start:
            # The lend that lets the header go out before the first chunk waits on the shm
            # socket: off the event loop.
            try:
                await asyncio.to_thread(self._route.lend_at_start)
            except BaseException:
                self.abort()  # no `async with` body follows, so no exit would end the call
                raise
            if self._route.header_at_start is not None:
                await self._frames.send(self._route.header_at_start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        if exc_type is None:
            if not self._ended:
                await self.commit()
        else:
            self.abort()


class _AsyncCallFrames:
    """As `_CallFrames`, on the event loop."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=_BATCH_QUEUE_FRAMES)
        self._closed = False
        self._commit: Any = None
        self._committer: asyncio.Task[Any] | None = None

    async def send(self, frame: Any) -> None:
        if not self._closed:
            await self._queue.put(frame)  # a close meanwhile makes room: this returns

    async def send_commit(self, frame: Any) -> None:
        """Queues the commit frame. The writer sends it only while the task that queued it is
        not being cancelled: a cancel lands as that task waits to queue the end, and the
        writer may run before the task does and cancels the call."""
        self._commit, self._committer = frame, asyncio.current_task()
        await self.send(frame)

    def send_nowait(self, frame: Any) -> None:
        self._queue.put_nowait(frame)

    def close(self) -> None:
        self._closed = True
        while not self._queue.empty():
            self._queue.get_nowait()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_END)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (frame := await self._queue.get()) is not _END:
            if frame is self._commit and self._committer and self._committer.cancelling():
                # grpc cancels a call whose frames raise: the batch is undone, not committed
                raise asyncio.CancelledError("the batch's commit was cancelled")
            yield frame
