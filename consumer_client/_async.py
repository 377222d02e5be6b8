"""`AsyncKVConsumer`: the asyncio client, on `grpc.aio`, with the sync client's method names.

Same decisions as `KVConsumer` (they live in `_core` and `_session`); only the waiting differs:
the first-chunk watchdog is a `loop.call_later` that cancels the call, background work (one
ServerInfo read after first use, confirmations of deliveries) runs as tasks the client owns
and cancels on `aclose`, and a locally cancelled aio call surfaces as `asyncio.CancelledError`,
which is told apart from a cancellation of the caller's own task (`Task.cancelling()`) — the
latter always propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import ssl
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc

from ._channel import DEFAULT_MAX_CHUNK_BYTES, ChannelSettings
from ._core import (
    CLIENT_CLOSED,
    CONFIRM_FLUSH_S,
    CONFIRM_TIMEOUT_S,
    FETCH_METHOD,
    ClientBase,
    ClientCore,
    T,
    Transport,
    aread_info_before_lending,
    check_policy,
    confirm_request,
    keepalive_requests,
    lookup_requests,
    release_request,
    report,
    states_of,
)
from ._errors import KVParkError, error_for, error_from_rpc
from ._models import IdStatus, ProducerInfo, ReleaseResult
from ._result import LoadReport, LoadResult, Policy
from ._session import LoadSession, OnChunk, Step
from ._tcp import Fallback, TcpReceiver
from ._timeouts import DEFAULT_TIMEOUT, USE_CLIENT_DEFAULT, Timeout, TimeoutArg
from .keepalive import AsyncKeepAlive
from .metrics import ConsumerMetrics

log = logging.getLogger("kvpark.client")
_CONFIRM_TASK = "kvpark-confirm"
# Threads for the blocking parts of loads (lending a buffer, reading a data connection): a
# client's own, not asyncio's default executor (min(32, cpus + 4) threads, shared with the
# application), so loads waiting on their data connections do not queue the others.
MAX_LOAD_THREADS = 256


class _Watchdog:
    """Cancels the call if no message arrived within `delay_s` (the first-chunk timeout)."""

    def __init__(self, delay_s: float | None, cancel: Callable[[], Any]) -> None:
        self.fired = False
        self._cancel = cancel
        self._handle: asyncio.TimerHandle | None = None
        if delay_s is not None:
            self._handle = asyncio.get_running_loop().call_later(delay_s, self._fire)

    def _fire(self) -> None:
        self.fired = True
        self._cancel()

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


R = TypeVar("R")


async def given_back_if_abandoned(job: asyncio.Future[R], give_back: Callable[[R], None]) -> R:
    """The result of `job`, work on a thread that takes something its caller must give back
    (the staging buffer, say). A caller cancelled meanwhile never gets that result, so it is
    given back once the thread is done, else it would stay taken for ever."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(functools.partial(_give_back_unclaimed, give_back))
        raise


def _give_back_unclaimed(give_back: Callable[[R], None], job: asyncio.Future[R]) -> None:
    if not job.cancelled() and job.exception() is None:
        give_back(job.result())


def caller_cancelled() -> bool:
    """Whether the running task itself is being cancelled (as opposed to a call it awaited
    being cancelled under it, by a watchdog or by closing the client)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def outlast(work: asyncio.Future[R]) -> R:
    """Awaits `work` to its end, however often the caller is cancelled meanwhile, then raises
    the cancel: what it waits for (a thread writing into the caller's memory, or the settle
    that says no copy does any more) must be over before the caller may reuse that memory.
    It is bounded: such a thread is stopped, a settle waits at most its own timeout."""
    cancel: asyncio.CancelledError | None = None
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError as exc:
            cancel = exc
    if cancel is not None:
        raise cancel
    return work.result()


class AsyncKVConsumer(ClientBase):
    """An asyncio kvpark client for one producer (`target`, "host:port").

    `timeout` is the default of every call (README, "Timeouts"); `confirm` whether successful
    loads are confirmed to the producer. Use as an async context manager or call `aclose()`.
    The channel is opened on first use (inside the running loop) and reused.
    """

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
        confirm: bool = True,
        transport: Transport = "auto",
        data_tls: ssl.SSLContext | None = None,
        shm_socket: str | None = None,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        settings = ChannelSettings.build(
            target,
            token=token,
            credentials=credentials,
            channel_options=channel_options,
            interceptors=interceptors,
            max_chunk_bytes=max_chunk_bytes,
        )
        self._core = ClientCore(
            settings,
            timeout=timeout,
            confirm=confirm,
            transport=transport,
            data_tls=data_tls,
            shm_socket=shm_socket,
            metrics=metrics,
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._fetch: Any = None
        self._background: set[asyncio.Task[Any]] = set()
        # The keep-alives this client started, ended by aclose (held weakly: a keep-alive
        # dropped by its caller is no business of the client's).
        self._keep_alives: weakref.WeakSet[AsyncKeepAlive] = weakref.WeakSet()
        self._threads = ThreadPoolExecutor(MAX_LOAD_THREADS, thread_name_prefix="kvpark-load")
        # The data connections loads are reading on those threads: aclose aborts them, as
        # closing the channel cannot end a read of a socket of their own.
        self._receivers: set[TcpReceiver] = set()

    # ---------------------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        """Closes the channel: loads in flight end CANCELLED, other calls ClientClosedError.
        Confirmations already queued get up to CONFIRM_FLUSH_S to go out; then background
        work is cancelled (the producer frees unconfirmed ids after its delivery_grace_s).
        Idempotent. Cancelled while it waits for those confirmations, it still closes."""
        try:
            confirms = [t for t in self._background if t.get_name() == _CONFIRM_TASK]
            if confirms:  # before closing: they need the channel
                await asyncio.wait(confirms, timeout=CONFIRM_FLUSH_S)
        finally:
            # Nothing from here to the first await yields to the loop, so no load starts a
            # step on a client that is half closed.
            self._core.closed = True
            for keep_alive in list(self._keep_alives):
                keep_alive.client_closed()
            for receiver in list(self._receivers):
                receiver.abort()
            tasks = list(self._background)
            for task in tasks:
                task.cancel()
            channel, self._channel = self._channel, None
            self._core.shm.close()
            self._core.data_connections.close()
            self._threads.shutdown(wait=False)
            try:
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                if channel is not None:
                    await channel.close()

    async def __aenter__(self) -> AsyncKVConsumer:
        self._core.check_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()

    def _stubs(self) -> tuple[Any, Any]:
        """(stub, raw Fetch callable) of the open channel, opened on first use. No await
        happens here, so two coroutines cannot both open one."""
        self._core.check_open()
        if self._channel is None:
            self._channel = self._core.channel.open_aio()
            self._stub = kvpark_pb2_grpc.KVProducerStub(self._channel)
            # Raw bytes in and out: kvpark.wire parses chunks as views, no protobuf copies.
            self._fetch = self._channel.unary_stream(FETCH_METHOD)
        if self._core.want_info():
            self._in_background(self._read_info(self._stub))
        return self._stub, self._fetch

    def _in_background(self, work: Coroutine[Any, Any, None], name: str = "kvpark-info") -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _read_info(self, stub: Any) -> None:
        info = None
        try:
            msg = await stub.GetServerInfo(
                pb.GetServerInfoRequest(),
                timeout=self._core.info_timeout_s(),
                metadata=self._core.channel.metadata,
            )
            info = ProducerInfo.from_proto(msg)
        except grpc.aio.AioRpcError as exc:
            log.debug("kvpark: ServerInfo from %s failed: %s", self.target, exc.code())
        finally:
            self._core.info_done(info)

    # -------------------------------------------------------------------------- unary calls
    async def _unary(self, method: str, request: Any, timeout: TimeoutArg) -> Any:
        """One unary call under the timeout rule; gRPC errors become our exceptions."""
        deadline = self._core.call_deadline(timeout)
        stub, _ = self._stubs()
        try:
            call = getattr(stub, method)
            return await call(request, timeout=deadline, metadata=self._core.channel.metadata)
        except grpc.aio.AioRpcError as exc:
            self._core.note_status(exc.code())
            raise error_from_rpc(exc, method) from None
        except asyncio.CancelledError:
            if caller_cancelled():
                raise  # our caller is being cancelled
            # The call was cancelled under us, by aclose(): an error of ours, not a
            # cancellation of a task nobody cancelled.
            self._core.check_open()  # closed: ClientClosedError
            raise error_for(grpc.StatusCode.CANCELLED, "call cancelled", method) from None

    async def server_info(
        self, *, refresh: bool = False, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ProducerInfo:
        """The producer's epoch, limits and timeouts. Answered from what the client knows
        unless `refresh` or it knows nothing yet (then one GetServerInfo call)."""
        known = self._core.info
        if known is not None and not refresh:
            return known
        msg = await self._unary("GetServerInfo", pb.GetServerInfoRequest(), timeout)
        return self._core.set_info(ProducerInfo.from_proto(msg))

    async def lookup(
        self, kv_request_ids: Iterable[str], *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> list[IdStatus]:
        """The state of each id, in order."""
        out: list[IdStatus] = []
        requests = lookup_requests(kv_request_ids)
        for request, left in self._core.share_deadline("Lookup", requests, timeout):
            out += states_of(await self._unary("Lookup", request, left))
        return out

    async def extend_leases(
        self,
        kv_request_ids: Iterable[str],
        extend_s: float = 0.0,
        *,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
    ) -> list[IdStatus]:
        """One KeepAlive round: leases last at least `extend_s` more (0 = the producer's
        unbound_store_timeout_s). Returns each id's state. See `keep_alive` for the loop.
        More than 1000 ids take one call per 1000 within `timeout`; if one fails, the ids of
        the calls before it were extended."""
        out: list[IdStatus] = []
        requests = keepalive_requests(kv_request_ids, extend_s)
        for request, left in self._core.share_deadline("KeepAlive", requests, timeout):
            out += states_of(await self._unary("KeepAlive", request, left))
        return out

    async def release(
        self, kv_request_id: str, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Gives an id up on the producer (frees its memory, tombstones it RELEASED). Needs
        the park role's token when the producer has one."""
        request = release_request(kv_request_id)
        reply = await self._unary("Release", request, timeout)
        return ReleaseResult.from_proto(request.kv_request_id, reply)

    async def confirm(
        self, result: LoadResult, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Confirms a successful load's delivery: the producer frees the id now rather than
        after its delivery_grace_s. Loads do this by themselves in the background unless
        `confirm=False`; call it when you turned that off."""
        request = confirm_request(result)
        reply = await self._unary("Release", request, timeout)
        return ReleaseResult.from_proto(request.kv_request_id, reply)

    def shared_buffer(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """A numpy array of `nbytes` in shared memory: load into it (or a slice of it) and,
        on the producer's host, the producer copies each chunk straight there (one copy).
        It lives until the client closes."""
        return self._core.shm.shared_buffer(nbytes)

    def keep_alive(
        self,
        kv_request_ids: Iterable[str] = (),
        *,
        interval_s: float | None = None,
        extend_s: float = 0.0,
    ) -> AsyncKeepAlive:
        """Starts keeping leases alive from a task while requests wait in the decode queue; it
        runs when returned. `async with client.keep_alive(ids) as ka: ...`, and `ka.add()` /
        `ka.discard()` as the queue changes; `await ka.stop()` or leaving the block stops it."""
        self._core.check_open()
        keep_alive = AsyncKeepAlive(self, kv_request_ids, interval_s=interval_s, extend_s=extend_s)
        self._keep_alives.add(keep_alive)
        return keep_alive

    # -------------------------------------------------------------------------------- loads
    async def load(
        self,
        kv_request_id: str,
        *,
        chunk_ids: Iterable[int] | None = None,
        num_chunks: int | None = None,
        into: Any = None,
        expected_epoch: int = 0,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
        confirm: bool | None = None,
    ) -> LoadResult:
        """Loads an id's chunks (all of them, `num_chunks` = 0..N-1, or `chunk_ids` in that
        order) into `into` (one buffer, one destination per chunk, a callable, or nothing for
        a new array), under `timeout`. Failures are values: see `LoadResult.reason`. Raises
        only for misuse (UsageError, BufferTooSmallError, ClientClosedError) and for statuses
        that mean misconfiguration (AuthError, ...). A success is confirmed to the producer in
        the background unless `confirm` (default: the client's) is False. `on_chunk` runs on
        the event loop for a load over the gRPC stream, and on one of the client's worker
        threads for a load over TCP or shared memory (the chunks are read and checked there)."""
        args = self._core.load_args(
            kv_request_id,
            chunk_ids=chunk_ids,
            num_chunks=num_chunks,
            into=into,
            expected_epoch=expected_epoch,
            timeout=timeout,
            wait_timeout_s=wait_timeout_s,
            on_chunk=on_chunk,
            fingerprint=fingerprint,
        )
        started = await aread_info_before_lending(
            self._core, self.server_info, timeout, into, stages=True
        )
        # Off the event loop: lending a shared buffer can wait on the shm socket. The read
        # above and a wait for a thread are part of the load's time.
        begin = functools.partial(self._core.begin_load, args, started)
        session = await self._begun(begin)
        return await self._run(session, confirm)

    async def _begun(self, begin: Callable[[], LoadSession]) -> LoadSession:
        """`begin()` on a load thread (ClientClosedError once aclose shut those down). A
        caller cancelled meanwhile never gets the session, so what it holds (the staging
        buffer, a turn to try TCP) is given back once the thread is done."""
        self._core.check_open()
        begun = asyncio.get_running_loop().run_in_executor(self._threads, begin)
        return await given_back_if_abandoned(begun, self._core.end_load)

    async def _run(self, session: LoadSession, confirm: bool | None) -> LoadResult:
        """Runs a load: its transport, the fallback to the gRPC stream, the confirmation."""
        try:
            _, fetch = self._stubs()
            try:
                await self._stream(fetch, session)
            except Fallback as why:
                # A data connection aborted by aclose falls back too: no stream to go on with.
                if not self._core.closed_under(session):
                    session = self._core.fall_back(session, why)
                    await self._stream(fetch, session)
        finally:
            self._core.end_load(session)
        result = self._core.finish_load(session)
        if self._core.should_confirm(result, confirm):
            self._in_background(self._confirm_quietly(result), _CONFIRM_TASK)
        return result

    async def _stream(self, fetch: Any, session: LoadSession) -> None:
        call = fetch(
            session.request, timeout=session.remaining_s(), metadata=self._core.channel.metadata
        )
        watchdog = _Watchdog(session.first_chunk_watch_s(), call.cancel)
        ended = False  # the call reached its final status: nothing to cancel
        finished = False  # ... and the producer ended it: no copy of it is still running
        try:
            step = Step.CONTINUE
            async for raw in call:
                watchdog.disarm()
                step = await self._fed(session, raw)
                if step is Step.OFFER:  # the bytes come over a data connection of their own
                    step = await self._receive(session, call)
                if step is not Step.CONTINUE:
                    break
                # No chunk yet (a data connection that ended before its first frame): the
                # first-chunk limit still bounds the wait for the stream's outcome.
                watchdog = _Watchdog(session.first_chunk_watch_s(), call.cancel)
            else:
                ended = finished = True
                session.stream_ended()
            if step is Step.DONE:
                async for raw in call:  # drain to the status, so the call ends without a cancel
                    session.feed(raw)
                ended = finished = True
        except grpc.aio.AioRpcError as exc:
            ended = True
            if session.refused_out_of_band(exc.code(), exc.details()):
                # Refused before any copy: the producer does not hold this lend (it
                # restarted, say). `finished` stays False, so the lend is settled below and
                # the next load lends anew instead of naming the dead lend again.
                raise Fallback(
                    f"the producer refused the lent buffer: {exc.details()}", transport="shm"
                ) from None
            session.rpc_failed(exc.code(), exc.details(), timed_out=watchdog.fired)
        except asyncio.CancelledError:
            if caller_cancelled():
                raise  # our caller is being cancelled: the finally below cancels the call
            # The call itself was cancelled: by our watchdog, or by aclose().
            ended = True
            detail = CLIENT_CLOSED if self.closed else "call cancelled"
            session.rpc_failed(grpc.StatusCode.CANCELLED, detail, timed_out=watchdog.fired)
        finally:
            watchdog.disarm()
            if not ended:
                call.cancel()  # the producer's abort signal: the id goes back where it was
            if session.shm is not None and not finished:
                # Cut off: a copy into the caller's memory may still run; wait it out, through
                # further cancels too, or a late copy could land after the load ended. Marked
                # here on the loop as well, before the settle's thread runs, so the staging
                # buffer is marked however that thread goes.
                self._core.shm.expect_late_copies(session.shm.lend_id)
                settle = functools.partial(
                    self._core.shm.settle, session.shm.lend_id, session.settle_within_s()
                )
                await outlast(asyncio.ensure_future(asyncio.to_thread(settle)))

    async def _fed(self, session: LoadSession, raw: bytes) -> Step:
        """`session.feed(raw)`. A shared-memory load's messages name chunks already in memory:
        verifying them, and copying them from the staging buffer, takes as long as the bytes
        are many, so it runs on a load thread while the loop runs on, as a data connection's
        reads do. A gRPC message carries one chunk and is fed on the loop."""
        if session.shm is None:
            return session.feed(raw)
        return await self._on_load_thread(session, functools.partial(session.feed, raw))

    async def _receive(self, session: LoadSession, call: Any) -> Step:
        """Reads the data connection on a load thread while the loop runs on; a cancel of
        the caller, or aclose, closes the connection, which ends the thread. So does a call
        that fails meanwhile (a producer that stopped answering keepalive pings: a frozen
        process keeps its data connection open and silent); the load then ends with the
        call's status, as one over the gRPC stream would."""
        assert session.offer is not None
        receiver = self._core.tcp_receiver(session.offer)
        self._receivers.add(receiver)
        call.add_done_callback(functools.partial(self._call_ended, receiver))
        try:
            run = functools.partial(receiver.run, session)
            return await self._on_load_thread(session, run, receiver.abort)
        finally:
            self._receivers.discard(receiver)

    def _call_ended(self, receiver: TcpReceiver, call: Any) -> None:
        if receiver in self._receivers:  # still reading its data connection
            self._in_background(_stop_reading_unless_ok(call, receiver), "kvpark-call-watch")

    async def _on_load_thread(
        self, session: LoadSession, work: Callable[[], Step], stop: Callable[[], None] | None = None
    ) -> Step:
        """`work()`, a step of the load that writes into the caller's memory, on a load
        thread. A cancel of the caller calls `stop` and waits for the thread all the same, so
        no write lands after the load ended. Once the client closed (before or meanwhile),
        the load ends CANCELLED and the step is ABANDON."""
        if self._core.closed_under(session):  # its threads are shut down
            return Step.ABANDON
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self._threads, work)
        try:
            step = await asyncio.shield(running)
        except asyncio.CancelledError:
            if stop is not None:
                stop()
            with contextlib.suppress(Exception):
                await outlast(running)
            raise
        if step is not Step.DONE and self._core.closed_under(session):
            return Step.ABANDON
        return step

    async def _confirm_quietly(self, result: LoadResult) -> None:
        try:
            await self.confirm(result, timeout=CONFIRM_TIMEOUT_S)
        except KVParkError as exc:  # the producer frees the id after its grace anyway
            log.debug("kvpark: confirming %r failed: %s", result.kv_request_id, exc)

    async def load_or_recompute(
        self,
        kv_request_id: str,
        *,
        recompute: Callable[[int], T] | None = None,
        policy: Policy = "recompute",
        chunk_ids: Iterable[int] | None = None,
        num_chunks: int | None = None,
        into: Any = None,
        expected_epoch: int = 0,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
        confirm: bool | None = None,
    ) -> LoadReport[T]:
        """`load`, then, when it failed: with `policy="recompute"` (the default),
        `recompute(first_missing_chunk)` (awaited if it returns an awaitable) so the engine
        redoes only what is missing; with `policy="fail"`, LoadFailedError and nothing
        recomputed. The report says which path was taken (remote, partial, recompute)."""
        check_policy(policy, recompute)
        args = self._core.load_args(
            kv_request_id,
            chunk_ids=chunk_ids,
            num_chunks=num_chunks,
            into=into,
            expected_epoch=expected_epoch,
            timeout=timeout,
            wait_timeout_s=wait_timeout_s,
            on_chunk=on_chunk,
            fingerprint=fingerprint,
            policy=policy,
        )
        started = await aread_info_before_lending(
            self._core, self.server_info, timeout, into, stages=True
        )
        # Off the event loop: lending a shared buffer can wait on the shm socket. The read
        # above and a wait for a thread are part of the load's time.
        begin = functools.partial(self._core.begin_load, args, started)
        session = await self._begun(begin)
        result = await self._run(session, confirm)
        first = self._core.plan_fallback(result, policy)
        value: Any = None
        if first is not None and recompute is not None:
            value = recompute(first)
            if inspect.isawaitable(value):
                value = await value
        return report(result, first, value)


async def _stop_reading_unless_ok(call: Any, receiver: TcpReceiver) -> None:
    """Stops `receiver` when `call` (done) failed. One that ended OK sent its TransferDone
    after the bytes, which the receiver reads to their end."""
    if await call.code() != grpc.StatusCode.OK:
        receiver.stop_reading()
