"""`KVConsumer`: the blocking client, on grpc's sync API (no event loop in a thread).

Thread-safe: one client (one channel) serves every thread of a decode worker; loads run
concurrently as independent streams, and no call waits for another (the lock below only guards
opening the channel, never a call). All decisions are in `_core` and `_session`; this module
only waits: it iterates the Fetch stream on the caller's thread, arms the first-chunk watchdog
(`_alarms.py`; the total timeout is the call's gRPC deadline; a TCP data connection's reads
are bounded by both, `_tcp.py`), watches the call while a data connection is read for long
(`_call_watch.py`), and cancels the call when the session gives up on it. Background work
runs on daemon threads: one ServerInfo read after first use, the alarms (one thread), a call
watch per load that reads a data connection for more than a second, and the confirmations
of deliveries (one worker thread, so a load returns as soon as it is verified).
"""

from __future__ import annotations

import logging
import ssl
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc

from ._alarms import Alarms
from ._call_watch import WATCH_AFTER_S, CallWatch
from ._channel import DEFAULT_MAX_CHUNK_BYTES, ChannelSettings
from ._core import (
    CONFIRM_FLUSH_S,
    CONFIRM_TIMEOUT_S,
    FETCH_METHOD,
    ClientBase,
    ClientCore,
    T,
    Transport,
    check_policy,
    confirm_request,
    keepalive_requests,
    lookup_requests,
    read_info_before_lending,
    release_request,
    report,
    states_of,
)
from ._errors import ClientClosedError, KVParkError, error_from_rpc
from ._models import IdStatus, ProducerInfo, ReleaseResult
from ._result import LoadReport, LoadResult, Policy
from ._session import LoadSession, OnChunk, Step
from ._tcp import Fallback, TcpReceiver
from ._timeouts import DEFAULT_TIMEOUT, USE_CLIENT_DEFAULT, Timeout, TimeoutArg
from .keepalive import KeepAlive
from .metrics import ConsumerMetrics

log = logging.getLogger("kvpark.client")


def _read_what_is_left(call: Any) -> None:
    """Reads the events a Fetch call is still due. The call is read on the caller's thread
    (the channel's SingleThreadedUnaryStream option, `_channel.py`), and grpc frees its native
    state only once every event it is due has been read: after a cancel nobody else reads
    them (without the option, grpc's channel thread did), and each cut-off load would leak
    ~20 KiB. A cancel completes every pending operation, so this returns at once. grpc has no
    public call for it: where the call is not grpc's own single-threaded one (e.g. an
    interceptor's wrapper), nothing is read."""
    state = getattr(call, "_state", None)
    consume = getattr(call, "_consume_next_event", None)
    if state is None or consume is None:
        return
    while state.due:
        consume()


class KVConsumer(ClientBase):
    """A blocking kvpark client for one producer (`target`, "host:port").

    `timeout` is the default of every call (README, "Timeouts"); `confirm` whether successful
    loads are confirmed to the producer (see `confirm`). Use as a context manager or call
    `close()`. The channel is opened on first use and reused.
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
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._fetch: Any = None
        self._confirmer: ThreadPoolExecutor | None = None
        self._alarms = Alarms()
        self._pending: set[futures.Future[None]] = set()
        # The keep-alives this client started, ended by its close (held weakly: a keep-alive
        # dropped by its caller is no business of the client's).
        self._keep_alives: weakref.WeakSet[KeepAlive] = weakref.WeakSet()
        # The data connections loads are reading: close aborts them, as closing the channel
        # ends the loads on the gRPC stream.
        self._receivers: set[TcpReceiver] = set()

    # ---------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Closes the channel: loads in flight end CANCELLED, other calls ClientClosedError.
        Confirmations already queued get up to CONFIRM_FLUSH_S to go out first; any left then
        are dropped (the producer frees those ids after its delivery_grace_s). Idempotent."""
        with self._lock:
            pending = set(self._pending)
        if pending:  # before closing: they need the channel
            futures.wait(pending, timeout=CONFIRM_FLUSH_S)
        with self._lock:
            self._core.closed = True  # from here on no call opens a channel, nothing queues
            confirmer, self._confirmer = self._confirmer, None
            channel, self._channel = self._channel, None
            receivers = list(self._receivers)
        for receiver in receivers:
            receiver.abort()
        if confirmer is not None:
            confirmer.shutdown(wait=False, cancel_futures=True)
        for keep_alive in list(self._keep_alives):
            keep_alive.client_closed()
        self._core.shm.close()
        self._core.data_connections.close()
        self._alarms.close()
        if channel is not None:
            channel.close()

    def __enter__(self) -> KVConsumer:
        self._core.check_open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    def _stubs(self) -> tuple[Any, Any]:
        """(stub, raw Fetch callable) of the open channel, opened on first use."""
        with self._lock:
            self._core.check_open()
            if self._channel is None:
                self._channel = self._core.channel.open_sync()
                self._stub = kvpark_pb2_grpc.KVProducerStub(self._channel)
                # Raw bytes in and out: kvpark.wire parses chunks as views, no protobuf copies.
                self._fetch = self._channel.unary_stream(FETCH_METHOD)
            stub, fetch = self._stub, self._fetch
        if self._core.want_info():
            threading.Thread(
                target=self._read_info, args=(stub,), name="kvpark-info", daemon=True
            ).start()
        return stub, fetch

    def _read_info(self, stub: Any) -> None:
        info = None
        try:
            msg = self._core.start_call(
                stub.GetServerInfo,
                pb.GetServerInfoRequest(),
                timeout=self._core.info_timeout_s(),
                metadata=self._core.channel.metadata,
            )
            info = ProducerInfo.from_proto(msg)
        except grpc.RpcError as exc:
            log.debug("kvpark: ServerInfo from %s failed: %s", self.target, exc.code())
        except ClientClosedError:
            pass  # closed before the answer came: nobody waits for it
        finally:
            self._core.info_done(info)

    # -------------------------------------------------------------------------- unary calls
    def _unary(self, method: str, request: Any, timeout: TimeoutArg) -> Any:
        """One unary call under the timeout rule; gRPC errors become our exceptions."""
        deadline = self._core.call_deadline(timeout)
        stub, _ = self._stubs()
        try:
            return self._core.start_call(
                getattr(stub, method),
                request,
                timeout=deadline,
                metadata=self._core.channel.metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED:
                self._core.check_open()  # cancelled by close(): ClientClosedError
            self._core.note_status(exc.code())
            raise error_from_rpc(exc, method) from None

    def server_info(
        self, *, refresh: bool = False, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ProducerInfo:
        """The producer's epoch, limits and timeouts. Answered from what the client knows
        unless `refresh` or it knows nothing yet (then one GetServerInfo call)."""
        known = self._core.info
        if known is not None and not refresh:
            return known
        msg = self._unary("GetServerInfo", pb.GetServerInfoRequest(), timeout)
        return self._core.set_info(ProducerInfo.from_proto(msg))

    def lookup(
        self, kv_request_ids: Iterable[str], *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> list[IdStatus]:
        """The state of each id, in order."""
        out: list[IdStatus] = []
        requests = lookup_requests(kv_request_ids)
        for request, left in self._core.share_deadline("Lookup", requests, timeout):
            out += states_of(self._unary("Lookup", request, left))
        return out

    def extend_leases(
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
            out += states_of(self._unary("KeepAlive", request, left))
        return out

    def release(
        self, kv_request_id: str, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Gives an id up on the producer (frees its memory, tombstones it RELEASED). Needs
        the park role's token when the producer has one."""
        request = release_request(kv_request_id)
        return ReleaseResult.from_proto(
            request.kv_request_id, self._unary("Release", request, timeout)
        )

    def confirm(
        self, result: LoadResult, *, timeout: TimeoutArg = USE_CLIENT_DEFAULT
    ) -> ReleaseResult:
        """Confirms a successful load's delivery: the producer frees the id now rather than
        after its delivery_grace_s. Loads do this by themselves in the background unless
        `confirm=False`; call it when you turned that off."""
        request = confirm_request(result)
        return ReleaseResult.from_proto(
            request.kv_request_id, self._unary("Release", request, timeout)
        )

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
    ) -> KeepAlive:
        """Starts keeping leases alive from a background thread while requests wait in the
        decode queue; it runs when returned. `with client.keep_alive(ids) as ka: ...`, and
        `ka.add()` / `ka.discard()` as the queue changes; `ka.stop()` or leaving the block
        stops it."""
        self._core.check_open()
        keep_alive = KeepAlive(self, kv_request_ids, interval_s=interval_s, extend_s=extend_s)
        # Added under the lock close() marks the client closed under: a close that came in
        # meanwhile either finds this keep-alive, or is seen here. Missed, the keep-alive
        # would run for good (with no id in its set it makes no call to find the client gone).
        with self._lock:
            closed = self._core.closed
            if not closed:
                self._keep_alives.add(keep_alive)
        if closed:
            keep_alive.stop()
            self._core.check_open()  # raises ClientClosedError
        return keep_alive

    # -------------------------------------------------------------------------------- loads
    def load(
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
        the background unless `confirm` (default: the client's) is False."""
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
        started = read_info_before_lending(self._core, self.server_info, timeout, into, stages=True)
        session = self._core.begin_load(args, started)
        return self._run(session, confirm)

    def _run(self, session: LoadSession, confirm: bool | None) -> LoadResult:
        """Runs a load: its transport, the fallback to the gRPC stream, the confirmation."""
        try:
            _, fetch = self._stubs()  # a client closed meanwhile raises: the session ends too
            try:
                self._stream(fetch, session)
            except Fallback as why:
                # A data connection aborted by close falls back too: no stream to go on with.
                if not self._core.closed_under(session):
                    session = self._core.fall_back(session, why)
                    self._stream(fetch, session)
        finally:
            self._core.end_load(session)
        result = self._core.finish_load(session)
        if self._core.should_confirm(result, confirm):
            self._confirm_later(result)
        return result

    def _stream(self, fetch: Any, session: LoadSession) -> None:
        call = self._core.start_call(
            fetch,
            session.request,
            timeout=session.remaining_s(),
            metadata=self._core.channel.metadata,
        )
        alarms = self._alarms
        watchdog = alarms.arm(session.first_chunk_watch_s(), call.cancel)
        ended = False  # the call reached its final status: nothing to cancel
        finished = False  # ... and the producer ended it: no copy of it is still running
        interrupted = False  # a signal's exception cut the load off: see below
        try:
            step = Step.CONTINUE
            for raw in call:
                alarms.disarm(watchdog)
                step = session.feed(raw)
                if step is Step.OFFER:  # the bytes come over a data connection of their own
                    assert session.offer is not None
                    step = self._receive(session, call)
                if step is not Step.CONTINUE:
                    break
                # No chunk yet (a data connection that ended before its first frame): the
                # first-chunk limit still bounds the wait for the stream's outcome.
                watchdog = alarms.arm(session.first_chunk_watch_s(), call.cancel)
            else:
                ended = finished = True
                session.stream_ended()
            if step is Step.DONE:
                for raw in call:  # drain to the status, so the call ends without a cancel
                    session.feed(raw)
                ended = finished = True
        except grpc.RpcError as exc:
            ended = True
            if session.refused_out_of_band(exc.code(), exc.details()):
                # Refused before any copy: the producer does not hold this lend (it
                # restarted, say). `finished` stays False, so the lend is settled below and
                # the next load lends anew instead of naming the dead lend again.
                raise Fallback(
                    f"the producer refused the lent buffer: {exc.details()}", transport="shm"
                ) from None
            session.rpc_failed(exc.code(), exc.details(), timed_out=watchdog.fired)
        except BaseException as exc:
            # KeyboardInterrupt or SystemExit from a signal handler can land inside grpc's own
            # reading of the call, after it took an event and before it recorded it; grpc then
            # still waits for that event, and draining the call would block for ever. Such a
            # load leaves its call's native state (~20 KiB) behind instead.
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            alarms.disarm(watchdog)
            if not ended:
                call.cancel()  # the producer's abort signal: the id goes back where it was
            if not interrupted:
                _read_what_is_left(call)
            if session.shm is not None and not finished:
                # Cut off: a copy into the caller's memory may still run; wait it out.
                self._core.shm.settle(session.shm.lend_id, session.settle_within_s())

    def _receive(self, session: LoadSession, call: Any) -> Step:
        """Reads the data connection on the calling thread; close() aborts it, and the load
        then ends CANCELLED. Past WATCH_AFTER_S a thread reads `call` meanwhile, and what it
        read is fed here."""
        assert session.offer is not None
        receiver = self._core.tcp_receiver(session.offer)
        with self._lock:
            reading = not self._core.closed
            if reading:
                self._receivers.add(receiver)
        if not reading and self._core.closed_under(session):
            return Step.ABANDON
        watch = CallWatch(call, receiver.stop_reading)
        alarm = self._alarms.arm(WATCH_AFTER_S, watch.start)
        step = Step.ABANDON  # unless `run` returns: the call is then given up on
        try:
            step = receiver.run(session)
        finally:
            self._alarms.disarm(alarm)
            with self._lock:
                self._receivers.discard(receiver)
            message = watch.finish(cancel=step is not Step.CONTINUE)
        if message is not None and step is Step.CONTINUE:
            step = session.feed(message)
        if step is not Step.DONE and self._core.closed_under(session):
            return Step.ABANDON
        return step

    def _confirm_later(self, result: LoadResult) -> None:
        with self._lock:
            if self._core.closed:
                return
            if self._confirmer is None:
                self._confirmer = ThreadPoolExecutor(1, thread_name_prefix="kvpark-confirm")
            job = self._confirmer.submit(self._confirm_quietly, result)
            self._pending.add(job)
        job.add_done_callback(self._pending.discard)

    def _confirm_quietly(self, result: LoadResult) -> None:
        try:
            self.confirm(result, timeout=CONFIRM_TIMEOUT_S)
        except KVParkError as exc:  # the producer frees the id after its grace anyway
            log.debug("kvpark: confirming %r failed: %s", result.kv_request_id, exc)

    def load_or_recompute(
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
        `recompute(first_missing_chunk)` so the engine redoes only what is missing (chunk 0:
        everything); with `policy="fail"`, LoadFailedError and nothing recomputed. The report
        says which path was taken (remote, partial, recompute) and why."""
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
        started = read_info_before_lending(self._core, self.server_info, timeout, into, stages=True)
        session = self._core.begin_load(args, started)
        result = self._run(session, confirm)
        first = self._core.plan_fallback(result, policy)
        value = None if first is None or recompute is None else recompute(first)
        return report(result, first, value)
