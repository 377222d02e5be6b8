"""`AsyncKVConsumer`: the asyncio client, on `grpc.aio`, with the sync client's method names.

Same decisions as `KVConsumer` (they live in `_core` and `_session`); only the waiting differs:
the first-chunk watchdog is a `loop.call_later` that cancels the call, and a locally cancelled
aio call surfaces as `asyncio.CancelledError`, which is told apart from a cancellation of the
caller's own task (`Task.cancelling()`) — the latter always propagates.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvpark.pb import kvpark_pb2 as pb
from kvpark.pb import kvpark_pb2_grpc

from ._core import (
    DEFAULT_RPC_TIMEOUT_S,
    FETCH_METHOD,
    ClientBase,
    Fallback,
    T,
    check_fallback,
    fallback_plan,
    keepalive_requests,
    lookup_requests,
    report,
    rpc_timeout,
    states_of,
    valid_id,
)
from ._errors import error_for, error_from_rpc
from ._models import IdStatus, ProducerInfo, ReleaseResult
from ._result import LoadReport, LoadResult
from ._session import LoadSession, OnChunk, Step
from ._timeouts import Timeout
from .keepalive import AsyncKeepAlive


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


class AsyncKVConsumer(ClientBase):
    """An asyncio kvpark client for one producer (`target`, "host:port").

    Use as an async context manager or call `aclose()`. The channel is opened on first use
    (inside the running loop) and reused; first contact reads the producer's ServerInfo.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: Timeout | float | None = None,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] = (),
    ) -> None:
        super().__init__(
            target,
            timeout=timeout,
            token=token,
            credentials=credentials,
            channel_options=channel_options,
            interceptors=interceptors,
        )
        self._lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._fetch: Any = None

    # ---------------------------------------------------------------------------- lifecycle
    async def aclose(self) -> None:
        """Closes the channel; in-flight loads end CANCELLED. Idempotent."""
        self._core.closed = True
        channel, self._channel = self._channel, None
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

    def _open(self) -> None:
        core = self._core
        kwargs: dict[str, Any] = {"options": core.channel_options()}
        if core.interceptors:
            kwargs["interceptors"] = core.interceptors
        if core.credentials is not None:
            channel = grpc.aio.secure_channel(core.target, core.credentials, **kwargs)
        else:
            channel = grpc.aio.insecure_channel(core.target, **kwargs)
        self._channel = channel
        self._fresh = True
        self._stub = kvpark_pb2_grpc.KVProducerStub(channel)
        # Raw bytes in and out: kvpark.wire parses chunks as views, no protobuf copies.
        self._fetch = channel.unary_stream(FETCH_METHOD)

    async def _contact(self, timeout: float | None, *, refresh: bool = False) -> Any:
        """Opens the channel and reads ServerInfo on first contact (or when `refresh`, or after
        the producer went away); returns the stub. Raises grpc.aio.AioRpcError."""
        async with self._lock:
            self._core.check_open()
            if self._channel is None:
                self._open()
            if refresh or self._core.info is None:
                msg = await self._stub.GetServerInfo(
                    pb.GetServerInfoRequest(), timeout=timeout, metadata=self._core.metadata
                )
                if self._accept_info(msg):
                    assert self._channel is not None
                    await self._channel.close()
                    self._open()
            self._fresh = False
            return self._stub

    # -------------------------------------------------------------------------- unary calls
    async def _unary(
        self, method: str | None, request: Any, timeout: float | None, *, refresh: bool = False
    ) -> Any:
        """Contact, then one unary call (`method` None: contact only); gRPC errors become our
        exceptions (classify_status)."""
        timeout = rpc_timeout(timeout)
        try:
            stub = await self._contact(timeout, refresh=refresh)
            if method is None:
                return None
            call = getattr(stub, method)
            return await call(request, timeout=timeout, metadata=self._core.metadata)
        except grpc.aio.AioRpcError as exc:
            self._core.note_status(exc.code())
            raise error_from_rpc(exc, method or "GetServerInfo") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller is being cancelled
            # The call was cancelled under us, by aclose() (or a channel rebuilt after
            # ServerInfo): an error of ours, not a cancellation of a task nobody cancelled.
            self._core.check_open()  # closed: ClientClosedError
            what = method or "GetServerInfo"
            raise error_for(grpc.StatusCode.CANCELLED, "call cancelled", what) from None

    async def server_info(
        self, *, refresh: bool = False, timeout: float | None = DEFAULT_RPC_TIMEOUT_S
    ) -> ProducerInfo:
        """The producer's epoch, limits and timeouts, read on first contact; `refresh` reads
        them again (e.g. for pool_free_bytes)."""
        await self._unary(None, None, timeout, refresh=refresh)
        assert self._core.info is not None
        return self._core.info

    async def lookup(
        self, kv_request_ids: Iterable[str], *, timeout: float | None = DEFAULT_RPC_TIMEOUT_S
    ) -> list[IdStatus]:
        """The state of each id, in order."""
        out: list[IdStatus] = []
        for request in lookup_requests(kv_request_ids):
            out += states_of(await self._unary("Lookup", request, timeout))
        return out

    async def extend_leases(
        self,
        kv_request_ids: Iterable[str],
        extend_s: float = 0.0,
        *,
        timeout: float | None = DEFAULT_RPC_TIMEOUT_S,
    ) -> list[IdStatus]:
        """One KeepAlive call: leases last at least `extend_s` more (0 = the producer's
        unbound_store_timeout_s). Returns each id's state. See `keep_alive` for the loop."""
        out: list[IdStatus] = []
        for request in keepalive_requests(kv_request_ids, extend_s):
            out += states_of(await self._unary("KeepAlive", request, timeout))
        return out

    async def release(
        self, kv_request_id: str, *, timeout: float | None = DEFAULT_RPC_TIMEOUT_S
    ) -> ReleaseResult:
        """Gives an id up on the producer (frees its memory, tombstones it RELEASED)."""
        kid = valid_id(kv_request_id)
        msg = await self._unary("Release", pb.ReleaseRequest(kv_request_id=kid), timeout)
        return ReleaseResult.from_proto(kid, msg)

    def keep_alive(
        self,
        kv_request_ids: Iterable[str] = (),
        *,
        interval_s: float | None = None,
        extend_s: float = 0.0,
    ) -> AsyncKeepAlive:
        """Keeps leases alive from a task while requests wait in the decode queue:
        `async with client.keep_alive(ids) as ka: ...`; `ka.add()` / `ka.discard()` as the
        queue changes. Stops cleanly on exit."""
        self._core.check_open()
        return AsyncKeepAlive(self, kv_request_ids, interval_s=interval_s, extend_s=extend_s)

    # -------------------------------------------------------------------------------- loads
    async def load(
        self,
        kv_request_id: str,
        *,
        chunk_ids: Iterable[int] | None = None,
        num_chunks: int | None = None,
        into: Any = None,
        expected_epoch: int = 0,
        timeout: Timeout | float | None = None,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
    ) -> LoadResult:
        """Loads an id's chunks (all of them, `num_chunks` = 0..N-1, or `chunk_ids` in that
        order) into `into` (or a new array), under `timeout`. Failures are values: see
        `LoadResult.reason`. Raises only for misuse (UsageError, BufferTooSmallError,
        ClientClosedError) and for statuses that mean misconfiguration (AuthError, ...)."""
        session = self._core.begin_load(
            kv_request_id,
            chunk_ids=chunk_ids,
            num_chunks=num_chunks,
            into=into,
            expected_epoch=expected_epoch,
            timeout=timeout,
            wait_timeout_s=wait_timeout_s,
            on_chunk=on_chunk,
        )
        try:
            await self._contact(session.contact_timeout_s(DEFAULT_RPC_TIMEOUT_S))
        except grpc.aio.AioRpcError as exc:
            session.contact_failed(exc.code(), exc.details())
        if not session.decided and not session.out_of_time():
            await self._stream(session)
        return self._core.finish_load(session)

    async def _stream(self, session: LoadSession) -> None:
        call = self._fetch(
            session.request, timeout=session.remaining_s(), metadata=self._core.metadata
        )
        watchdog = _Watchdog(session.first_chunk_remaining_s(), call.cancel)
        ended = False  # the call reached its final status: nothing to cancel
        try:
            step = Step.CONTINUE
            async for raw in call:
                watchdog.disarm()
                step = session.feed(raw)
                if step is not Step.CONTINUE:
                    break
            else:
                ended = True
                session.stream_ended()
            if step is Step.DONE:
                async for raw in call:  # drain to the status, so the call ends without a cancel
                    session.feed(raw)
                ended = True
        except grpc.aio.AioRpcError as exc:
            ended = True
            session.rpc_failed(exc.code(), exc.details(), timed_out=watchdog.fired)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller is being cancelled: the finally below cancels the call
            # The call itself was cancelled: by our watchdog, or by aclose().
            ended = True
            detail = "client closed" if self.closed else "call cancelled"
            session.rpc_failed(grpc.StatusCode.CANCELLED, detail, timed_out=watchdog.fired)
        finally:
            watchdog.disarm()
            if not ended:
                call.cancel()  # the producer's abort signal: the id goes back to PARKED

    async def load_or_recompute(
        self,
        kv_request_id: str,
        *,
        recompute: Callable[[int], T] | None = None,
        fallback: Fallback = "recompute",
        **load_args: Any,
    ) -> LoadReport[T]:
        """`load`, then on any failure `recompute(first_missing_chunk)` (awaited if it returns
        an awaitable) so the engine redoes only what is missing. `fallback="raise"` raises
        LoadFailedError instead. The report says which path was taken and why."""
        check_fallback(fallback, recompute)
        result = await self.load(kv_request_id, **load_args)
        first = fallback_plan(result, fallback)
        value: Any = None
        if first is not None and recompute is not None:
            value = recompute(first)
            if inspect.isawaitable(value):
                value = await value
        return report(result, first, value)
