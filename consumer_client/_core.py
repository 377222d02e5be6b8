"""What the sync and the async consumer share besides a load: settings, argument checks, what
the client knows of its producer, and the fallback policy. No I/O.

`KVConsumer` and `AsyncKVConsumer` each own one `ClientCore` and differ only in how they wait
(threads vs. asyncio). Keeping the decisions here means the two cannot drift apart.

No call waits for another. A load needs nothing but its own Fetch (the TransferDone carries the
producer's epoch), and a unary call nothing but itself. What the client wants to know of its
producer (`info`: timeouts to check, the chunk limit, the advertised address) is read by one
background ServerInfo call after first use, and again after the producer went away or
answered EPOCH_MISMATCH, never on a call's critical path.
"""

from __future__ import annotations

import contextlib
import logging
import math
import ssl
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc

from kvpark.fingerprints import fingerprint_problem
from kvpark.ids import MAX_CHUNKS, check_id
from kvpark.pb import kvpark_pb2 as pb
from kvpark.shm import FETCH_ROLE

from ._buffers import ChunkBuffers, Destination, IntoBuffer, OwnedBuffer, destination_for
from ._channel import ChannelSettings
from ._data_connections import DataConnections
from ._errors import ClientClosedError, LoadFailedError, RPCError, UsageError, error_for
from ._models import IdStatus, ProducerInfo
from ._park import ParkResult
from ._result import POLICIES, LoadReport, LoadResult, Reason
from ._session import LoadSession, OnChunk, ShmTarget
from ._shm import ShmAccess
from ._tcp import RETRY_AFTER_S, TURNED_AWAY_IN_A_ROW, Fallback, TcpReceiver
from ._timeouts import NO_LIMIT, OUT_OF_BAND_SHARE, Timeout, TimeoutArg, resolve, to_timeout
from .handle import MAX_FETCH_CHUNKS
from .metrics import NO_POLICY, ConsumerMetrics

log = logging.getLogger("kvpark.client")

SERVICE = "/kvpark.v1.KVProducer/"
FETCH_METHOD = SERVICE + "Fetch"
# The producer takes at most this many ids per Lookup or KeepAlive; longer lists are split.
MAX_IDS_PER_CALL = 1_000
# Deadline of the background ServerInfo call when the client's timeout is unbounded.
INFO_TIMEOUT_S = 10.0
# A confirmation is one round trip; it gets this long, and closing a client waits at most
# CONFIRM_FLUSH_S for the ones still queued (an unconfirmed id is freed by the producer after
# its delivery_grace_s anyway).
CONFIRM_TIMEOUT_S = 5.0
CONFIRM_FLUSH_S = 2.0
# How a load in flight when its client closed says so (its reason is CANCELLED).
CLIENT_CLOSED = "client closed"
# How a Lookup or KeepAlive of many ids says its deadline ran out between two requests.
DEADLINE_SPENT = "deadline spent before the last batch of ids"
_UINT64_MAX = 2**64 - 1

# The `transport=` choices: "auto" takes the fastest the producer offers and this client can
# use (shared memory on one host, then zero-copy TCP, then the gRPC stream).
Transport = Literal["auto", "grpc", "tcp", "shm"]
TRANSPORTS: tuple[Transport, ...] = ("auto", "grpc", "tcp", "shm")
T = TypeVar("T")
RecomputeFn = Callable[[int], T]


class TimeoutConfigWarning(UserWarning):
    """The client's load timeout is not below the producer's tombstone_retention_s: a late
    fetch could see UNKNOWN_ID instead of the real reason."""


@dataclass(frozen=True)
class LoadArgs:
    """One load's arguments, checked."""

    kv_request_id: str
    chunk_ids: tuple[int, ...] | None
    into: Any
    destination: Destination
    expected_epoch: int
    timeout: Timeout
    wait_timeout_s: float
    on_chunk: OnChunk | None
    fingerprint: bytes
    policy: str


class ClientCore:
    def __init__(
        self,
        channel: ChannelSettings,
        *,
        timeout: Timeout | float | None,
        confirm: bool,
        transport: str = "auto",
        data_tls: ssl.SSLContext | None = None,
        shm_socket: str | None = None,
        role: str = FETCH_ROLE,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        if not isinstance(confirm, bool):
            raise UsageError(f"confirm: expected True or False, got {confirm!r}")
        if transport not in TRANSPORTS:
            raise UsageError(
                f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}"
            )
        if data_tls is not None and not isinstance(data_tls, ssl.SSLContext):
            raise UsageError("data_tls: expected an ssl.SSLContext")
        if metrics is not None and not isinstance(metrics, ConsumerMetrics):
            raise UsageError("metrics: expected a kvpark.ConsumerMetrics")
        self.metrics = metrics
        self.transport = transport
        self.data_tls = data_tls
        self.channel = channel
        self.shm = ShmAccess(
            shm_socket,
            channel.token,
            role,
            producer_epoch=lambda: self.info.producer_epoch if self.info else None,
            advertised_path=lambda: self.info.shm_socket if self.info else None,
        )
        self.data_connections = DataConnections()
        self.timeout = to_timeout(timeout)
        self.confirm = confirm
        self.info: ProducerInfo | None = None
        self.closed = False
        # True while a background ServerInfo call is out (at most one at a time).
        self.info_pending = False
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        # After a data connection failed: TCP is left out of the loads' offers until
        # `_tcp_down_until`, then one load at a time tries it until one gets through.
        self._tcp_failed = False
        self._tcp_down_until = 0.0
        self._tcp_turned_away = 0  # new data connections closed unanswered since one worked

    @property
    def target(self) -> str:
        return self.channel.target

    # ------------------------------------------------------------------------ what we know
    def want_info(self) -> bool:
        """True (and the caller must then read ServerInfo in the background) when the client
        knows nothing of its producer and nobody is asking yet."""
        with self._lock:
            if self.closed or self.info is not None or self.info_pending:
                return False
            self.info_pending = True
            return True

    def info_done(self, info: ProducerInfo | None) -> None:
        """The background ServerInfo call ended (`info` None: it failed; the next call will
        try again)."""
        with self._lock:
            self.info_pending = False
            if info is not None:
                self.info = info
        if info is not None:
            self.check_timeout(self.timeout)
            self.check_transports(info)
            if info.max_chunk_bytes > self.channel.max_chunk_bytes:
                self._warn_once(
                    "chunk-limit",
                    f"producer {self.target} accepts {info.max_chunk_bytes}-byte chunks, above "
                    f"this client's max_chunk_bytes ({self.channel.max_chunk_bytes}): larger "
                    "chunks will fail; pass max_chunk_bytes= to the client",
                )

    def set_info(self, info: ProducerInfo) -> ProducerInfo:
        """A ServerInfo read by an explicit call."""
        with self._lock:
            self.info = info
        self.check_timeout(self.timeout)
        self.check_transports(info)
        return info

    def info_timeout_s(self) -> float:
        return self.timeout.total_s or INFO_TIMEOUT_S

    def note_status(self, code: grpc.StatusCode | None, reason: Reason | None = None) -> None:
        """After UNAVAILABLE or EPOCH_MISMATCH the producer may be a new process: forget what
        the client knew of it (the next call reads it again, in the background)."""
        if code == grpc.StatusCode.UNAVAILABLE or reason is Reason.EPOCH_MISMATCH:
            with self._lock:
                self.info = None

    def note_epoch(self, epoch: int) -> None:
        """An answer came from another producer process than the one ServerInfo described (it
        restarted and no call saw UNAVAILABLE): forget that ServerInfo, so that shared memory
        is not checked against a dead process's epoch (and refused) for ever."""
        with self._lock:
            if epoch and self.info is not None and self.info.producer_epoch != epoch:
                self.info = None

    def note_park(self, result: ParkResult) -> None:
        """What a Park call's ending says of the producer, as for a load (`finish_load`): an
        answer names its process's epoch, and UNAVAILABLE may mean a new process. Every park
        result goes through here, a `park()`'s and a `batch()`'s alike."""
        self.note_epoch(result.producer_epoch)
        self.note_status(result.grpc_code, result.reason)

    def check_timeout(self, timeout: Timeout) -> None:
        """Warns once per client if `timeout` can outlast the producer's tombstones."""
        info = self.info
        if info is None:
            return
        longest = timeout.total_s
        if longest is not None and longest < info.tombstone_retention_s:
            return
        shown = "unbounded" if longest is None else f"{longest:g}s"
        self._warn_once(
            "timeout",
            f"kvpark client load timeout ({shown}) is not below producer {self.target}'s "
            f"tombstone_retention_s ({info.tombstone_retention_s:g}s): a late fetch could see "
            "UNKNOWN_ID instead of the real reason",
            TimeoutConfigWarning,
        )

    def check_transports(self, info: ProducerInfo) -> None:
        """Warns once per client if the producer offers zero-copy TCP that this client cannot
        take: over a TLS channel the data connection needs its own `data_tls` context, and
        without one every load quietly goes over the slower gRPC stream."""
        if info.data_address and self.transport in ("auto", "tcp") and not self.tcp_usable():
            self._warn_once(
                "data-tls",
                f"producer {self.target} offers zero-copy TCP, but this client has a TLS "
                "channel and no data_tls: loads go over the gRPC stream; pass data_tls= "
                "(an ssl.SSLContext) to use it",
            )

    def _warn_once(self, key: str, message: str, category: type[Warning] | None = None) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message)
        if category is not None:
            warnings.warn(message, category, stacklevel=4)

    def check_open(self) -> None:
        if self.closed:
            raise ClientClosedError(f"the kvpark client for {self.target} is closed")

    def tcp_receiver(self, offer: pb.DataOffer) -> TcpReceiver:
        """The reader of the data connection `offer` names, with this client's TLS and kept
        connections."""
        return TcpReceiver(
            offer,
            self.target,
            self.data_tls,
            self.channel.tls_server_name,
            self.tcp_worked,
            self.data_connections,
        )

    def closed_under(self, session: LoadSession) -> bool:
        """Whether the client closed while this load was in flight; it then ends CANCELLED
        (or ok, when every requested chunk is in and verified)."""
        if not self.closed:
            return False
        session.rpc_failed(grpc.StatusCode.CANCELLED, CLIENT_CLOSED, timed_out=False)
        return True

    def start_call(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Starts a call on a sync channel. A close() from another thread can shut the channel
        after the caller took its stub and before the call starts; grpc then raises a bare
        ValueError ("Cannot invoke RPC on closed channel"), which is ClientClosedError here, as
        is a unary call that close() cancelled meanwhile."""
        try:
            return call(*args, **kwargs)
        except ValueError:
            self.check_open()
            raise
        except grpc.RpcError as exc:  # a unary call cancelled by close(), interceptors or not
            if exc.code() is grpc.StatusCode.CANCELLED:
                self.check_open()
            raise

    # ------------------------------------------------------------------------------ requests
    def call_deadline(self, timeout: TimeoutArg) -> float | None:
        """A unary call's gRPC deadline under the timeout rule (None: no deadline)."""
        return resolve(timeout, self.timeout).total_s

    def share_deadline(
        self, method: str, requests: list[Any], timeout: TimeoutArg
    ) -> Iterator[tuple[Any, Timeout]]:
        """Each of one call's requests (ids split MAX_IDS_PER_CALL to a request) with what is
        left of its deadline: the caller's timeout bounds the requests together, as it bounds
        any call. A deadline spent before the last request is that call's DEADLINE_EXCEEDED."""
        total_s = self.call_deadline(timeout)
        end = None if total_s is None else time.monotonic() + total_s
        for request in requests:
            if end is None:
                yield request, NO_LIMIT
                continue
            left_s = end - time.monotonic()
            if left_s <= 0:
                raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, DEADLINE_SPENT, method)
            yield request, Timeout(left_s)

    def load_args(
        self,
        kv_request_id: str,
        *,
        chunk_ids: Iterable[int] | None,
        num_chunks: int | None,
        into: Any,
        expected_epoch: int,
        timeout: TimeoutArg,
        wait_timeout_s: float,
        on_chunk: OnChunk | None,
        fingerprint: bytes | None = None,
        policy: str = NO_POLICY,
    ) -> LoadArgs:
        """A load's arguments checked (UsageError), before anything is sent: misuse is
        reported at once, never after a ServerInfo read that waits on the producer."""
        self.check_open()
        kid = valid_id(kv_request_id)
        ids = _chunk_ids(chunk_ids, num_chunks)
        if isinstance(expected_epoch, bool) or not isinstance(expected_epoch, int):
            raise UsageError(f"expected_epoch: expected an int, got {expected_epoch!r}")
        if not 0 <= expected_epoch <= _UINT64_MAX:
            raise UsageError(f"expected_epoch: out of range for uint64: {expected_epoch}")
        wait = _seconds("wait_timeout_s", wait_timeout_s)
        if on_chunk is not None and not callable(on_chunk):
            raise UsageError("on_chunk: expected a callable")
        if fingerprint is not None and (problem := fingerprint_problem(fingerprint)):
            raise UsageError(f"fingerprint: {problem}")
        load_timeout = resolve(timeout, self.timeout)
        self.check_timeout(load_timeout)
        destination = destination_for(into)
        if isinstance(destination, ChunkBuffers):
            destination.check_count(ids)
        return LoadArgs(
            kid, ids, into, destination, expected_epoch, load_timeout, wait, on_chunk,
            bytes(fingerprint or b""), policy,
        )  # fmt: skip

    def begin_load(self, args: LoadArgs, started: float | None = None) -> LoadSession:
        """Starts a load's session: lends its shared buffer when shared memory is for it.
        `started`: when the caller began the load (the epoch read, the async client's wait
        for a thread are part of its time)."""
        if started is None:
            started = time.monotonic()  # lending a buffer below is part of the load's time
        self.check_open()
        destination, load_timeout = args.destination, args.timeout
        # Lending takes a share of the load's first limit (the size-scaled budget included),
        # counted from the load's start, so the epoch read before it is part of that share.
        limits = [load_timeout.first_limit_s(), load_timeout.budget_s(destination.capacity)]
        bounds = [limit for limit in limits if limit is not None]
        lend_by = started + OUT_OF_BAND_SHARE * min(bounds) if bounds else None
        shm = self._shm_target(args.into, destination, lend_by)
        accept, tcp_probe = self.accept_transports()
        session = LoadSession(
            kv_request_id=args.kv_request_id,
            chunk_ids=args.chunk_ids,
            destination=destination,
            timeout=load_timeout,
            expected_epoch=args.expected_epoch,
            wait_timeout_s=args.wait_timeout_s,
            on_chunk=args.on_chunk,
            max_chunk_bytes=self.channel.max_chunk_bytes,
            fingerprint=args.fingerprint,
            accept=(pb.TRANSPORT_SHM, *accept) if shm else accept,
            shm=shm,
            clock=time.monotonic,
            started=started,
        )
        session.policy = args.policy
        session.tcp_probe = tcp_probe
        return session

    def _shm_target(
        self, into: Any, destination: Destination, lend_by: float | None
    ) -> ShmTarget | None:
        """Where a load's chunks land over shared memory: `into` itself when it lies in a
        buffer this client lent (one copy, by the producer), else a lent staging buffer (one
        copy more, by the client: also for one destination per chunk, scattered from there);
        None when shared memory is not for this load, or its destinations are asked for one
        at a time (a callable: no size to stage). Lending ends by `lend_by`
        (time.monotonic()), both tries together."""
        if self.transport not in ("auto", "shm") or isinstance(destination, OwnedBuffer):
            return None
        capacity = destination.capacity
        if capacity is None:
            return None

        def left() -> float | None:
            return None if lend_by is None else max(0.0, lend_by - time.monotonic())

        if isinstance(destination, IntoBuffer):
            lent = self.shm.lend_of(destination.array_view, left())
            if lent is not None:
                lend_id, view, offset, length = lent
                return ShmTarget(lend_id, view, offset, length, direct=True)
        staged = self.shm.staging(capacity, left())
        if staged is None:
            return None
        lend_id, view, _buffer = staged
        return ShmTarget(lend_id, view, 0, capacity, direct=False)

    @property
    def uses_shm(self) -> bool:
        return self.transport in ("auto", "shm")

    def lends_blind(self, stages: bool = False) -> bool:
        """True when a call is about to lend over shared memory (the caller made a shared
        buffer, or asked for "shm", or, with `stages`, the call copies what is not in a shared
        buffer into a lent staging buffer over the socket the client was given) while the
        producer's epoch is unknown. The call then reads ServerInfo first, once per client:
        the shm socket's producer is checked against it before a buffer is lent, so nothing
        is lent to another process's socket, and the producer's advertised socket is known,
        so the first such call does not go over the gRPC stream for no reason."""
        staged = stages and self.shm.has_socket
        wanted = self.transport == "shm" or (
            self.transport == "auto" and (self.shm.has_buffers or staged)
        )
        return wanted and self.info is None and not self.closed

    def accept_transports(self) -> tuple[tuple[pb.Transport, ...], float | None]:
        """What a Fetch offers to take, best first (the producer picks what it has), and
        `_tcp_turn`'s pause when this load is the one that tries TCP again. TCP goes in when it
        can work: over TLS only with `data_tls`, since the channel's credentials cannot be
        reused for a plain socket."""
        if self.transport == "grpc":
            return (), None
        turn = self.transport in ("auto", "tcp") and self.tcp_usable() and self._tcp_turn()
        if turn is False:
            return (pb.TRANSPORT_GRPC,), None
        return (pb.TRANSPORT_TCP, pb.TRANSPORT_GRPC), None if turn is True else turn

    def tcp_usable(self) -> bool:
        return self.channel.credentials is None or self.data_tls is not None

    def _tcp_turn(self) -> bool | float:
        """Whether this load may offer TCP. After a data connection failed, no load does for
        RETRY_AFTER_S, then one load per RETRY_AFTER_S tries it, until one gets through: a data
        port that a firewall drops would otherwise cost every load its connect attempt. The
        load that tries gets the pause it set (a float): `end_load` gives it back when no
        DataOffer let the load try."""
        with self._lock:
            now = time.monotonic()
            if now < self._tcp_down_until:
                return False
            if not self._tcp_failed:
                return True
            self._tcp_down_until = now + RETRY_AFTER_S  # this load tries; the rest wait
            return self._tcp_down_until

    def _tcp_turn_unused(self, pause_until: float) -> None:
        """The load whose turn it was to try TCP again never got to try: no DataOffer came
        (its id was gone, the producer picked another transport). The next load tries at once
        rather than after another RETRY_AFTER_S over the gRPC stream. A load that got a
        DataOffer keeps the pause whatever came of it: it connected and spent the time the
        pause saves (or, rarely, had no time left to connect, and the next try waits)."""
        with self._lock:
            if self._tcp_failed and self._tcp_down_until == pause_until:
                self._tcp_down_until = 0.0

    def tcp_worked(self) -> None:
        """A data connection was accepted: TCP is offered again on every load."""
        with self._lock:
            self._tcp_failed = False
            self._tcp_down_until = 0.0
            self._tcp_turned_away = 0

    def fall_back(self, session: LoadSession, why: Fallback) -> LoadSession:
        """The load over the gRPC stream, after its shm or tcp path failed before the first
        byte (counted in the metrics; a failed data connection also pauses TCP)."""
        path_failed = why.path_failed
        if why.transport == "tcp":
            session.tcp_probe = None  # a DataOffer came: the turn is used (`_tcp_turn_unused`)
            if why.turned_away:
                with self._lock:
                    self._tcp_turned_away += 1
                    path_failed = self._tcp_turned_away >= TURNED_AWAY_IN_A_ROW
        if why.transport == "tcp" and path_failed:
            with self._lock:
                self._tcp_failed = True
                self._tcp_down_until = time.monotonic() + RETRY_AFTER_S
            log.warning(
                "kvpark: zero-copy TCP to %s not used for %.0fs: %s; loading %r over the gRPC "
                "stream", self.target, RETRY_AFTER_S, why, session.kv_request_id,
            )  # fmt: skip
        else:
            log.info("kvpark: %s; loading %r over the gRPC stream", why, session.kv_request_id)
        if self.metrics is not None:
            self.metrics.record_transport_fallback(why.transport)
        return session.over_grpc()

    def end_load(self, session: LoadSession) -> None:
        """Gives back what the load held, however it ended (a fallback, an exception)."""
        if session.staged:
            session.staged = False
            self.shm.unstage()
        if session.tcp_probe is not None and session.offer is None:
            self._tcp_turn_unused(session.tcp_probe)

    def finish_load(self, session: LoadSession) -> LoadResult:
        self.note_epoch(session.producer_epoch)
        info = self.info
        result = session.result(info.producer_epoch if info else None)
        self.note_status(result.grpc_code, result.reason)
        if self.metrics is not None:
            self.metrics.record_load(result, session.policy)
        return result

    def plan_fallback(self, result: LoadResult, policy: str) -> int | None:
        """`fallback_plan`, counted in the client's metrics."""
        try:
            first = fallback_plan(result, policy)
        finally:
            if self.metrics is not None and not result.ok:
                known = len(result.chunk_ids) - result.chunks_loaded if result.chunk_ids else 0
                recomputed = known if policy == "recompute" else 0
                self.metrics.record_fallback(result, policy, recomputed)
        return first

    def should_confirm(self, result: LoadResult, confirm: bool | None) -> bool:
        wanted = self.confirm if confirm is None else confirm
        return wanted and result.ok and result.delivery_id != 0 and not self.closed


class ClientBase:
    """The read-only surface every client shares (consumers and parkers, sync and async)."""

    _core: ClientCore

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def timeout(self) -> Timeout:
        """The default timeout of every call."""
        return self._core.timeout

    @property
    def info(self) -> ProducerInfo | None:
        """The producer's ServerInfo, read in the background after first use (None until then,
        and again after the producer went away or answered EPOCH_MISMATCH)."""
        return self._core.info

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}{', closed' if self.closed else ''})"


def read_info_before_lending(
    core: ClientCore,
    server_info: Callable[..., Any],
    timeout: TimeoutArg,
    into: Any = None,
    *,
    stages: bool = False,
) -> float:
    """One ServerInfo call when `core.lends_blind(stages)`, inside the call's own limits (see
    `_info_read_limit`). Returns when the call began, so that the call's deadlines and its
    elapsed time count the read. A producer that cannot be reached is left for the call to
    report, as a value."""
    started = time.monotonic()
    if core.lends_blind(stages):
        with contextlib.suppress(RPCError):
            server_info(timeout=_info_read_limit(core, timeout, into))
    return started


async def aread_info_before_lending(
    core: ClientCore,
    server_info: Callable[..., Awaitable[Any]],
    timeout: TimeoutArg,
    into: Any = None,
    *,
    stages: bool = False,
) -> float:
    """As `read_info_before_lending`, for the async clients."""
    started = time.monotonic()
    if core.lends_blind(stages):
        with contextlib.suppress(RPCError):
            await server_info(timeout=_info_read_limit(core, timeout, into))
    return started


def _info_read_limit(core: ClientCore, timeout: TimeoutArg, into: Any) -> float | None:
    """The longest the ServerInfo read before lending may take: no longer than the call's
    first chunk may, nor than a load of `into` may in all (its size-scaled budget)."""
    limits = resolve(timeout, core.timeout)
    size = None if into is None else destination_for(into).capacity
    bounds = [b for b in (limits.first_limit_s(), limits.budget_s(size)) if b is not None]
    return min(bounds, default=None)


# ------------------------------------------------------------------------ unary messages
def lookup_requests(kv_request_ids: Iterable[str]) -> list[Any]:
    return [pb.LookupRequest(kv_request_ids=b) for b in batches(valid_ids(kv_request_ids))]


def keepalive_requests(kv_request_ids: Iterable[str], extend_s: float) -> list[Any]:
    extend = extend_seconds(extend_s)
    ids = valid_ids(kv_request_ids)
    return [pb.KeepAliveRequest(kv_request_ids=b, extend_s=extend) for b in batches(ids)]


def release_request(kv_request_id: str, delivery_id: int = 0) -> Any:
    return pb.ReleaseRequest(kv_request_id=valid_id(kv_request_id), delivery_id=delivery_id)


def confirm_request(result: LoadResult) -> Any:
    if not isinstance(result, LoadResult):
        raise UsageError(f"confirm: expected a LoadResult, got {type(result).__name__}")
    if not (result.ok and result.delivery_id):
        raise UsageError("confirm: only a successful load names a delivery to confirm")
    return release_request(result.kv_request_id, result.delivery_id)


def states_of(reply: Any) -> list[IdStatus]:
    return [IdStatus.from_proto(s) for s in reply.states]


# ---------------------------------------------------------------------------------- checks
def valid_id(kv_request_id: object) -> str:
    try:
        return check_id(kv_request_id)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def valid_ids(kv_request_ids: Iterable[str] | str) -> list[str]:
    if isinstance(kv_request_ids, str):
        raise UsageError("kv_request_ids: expected a collection of ids, got one string")
    ids = [valid_id(kid) for kid in kv_request_ids]
    if not ids:
        raise UsageError("kv_request_ids: empty")
    return ids


def batches(ids: Sequence[str]) -> list[Sequence[str]]:
    """The producer takes at most MAX_IDS_PER_CALL ids per call."""
    return [ids[i : i + MAX_IDS_PER_CALL] for i in range(0, len(ids), MAX_IDS_PER_CALL)]


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"{name}: expected seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{name}: expected finite seconds >= 0, got {value!r}")
    return float(value)


def extend_seconds(value: float) -> float:
    return _seconds("extend_s", value)


def _chunk_ids(chunk_ids: Iterable[int] | None, num_chunks: int | None) -> tuple[int, ...] | None:
    if chunk_ids is not None and num_chunks is not None:
        raise UsageError("give chunk_ids or num_chunks, not both")
    if num_chunks is not None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
            raise UsageError(f"num_chunks: expected an int, got {num_chunks!r}")
        if not 1 <= num_chunks <= MAX_FETCH_CHUNKS:
            raise UsageError(
                f"num_chunks: expected 1..{MAX_FETCH_CHUNKS} (one Fetch), got {num_chunks}"
            )
        return tuple(range(num_chunks))
    if chunk_ids is None:
        return None  # all chunks of the id, as many as the producer has
    if isinstance(chunk_ids, str | bytes):
        raise UsageError("chunk_ids: expected a collection of ints")
    ids = tuple(chunk_ids)
    if not ids:
        raise UsageError("chunk_ids: empty (pass None for all chunks)")
    for cid in ids:
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < MAX_CHUNKS:
            raise UsageError(f"chunk_ids: {cid!r} is not a chunk id (0..2**32-2)")
    if len(set(ids)) != len(ids):
        raise UsageError("chunk_ids: repeats a chunk")
    return ids


# -------------------------------------------------------------------------------- fallback
def check_policy(policy: str, recompute: object) -> None:
    if policy not in POLICIES:
        raise UsageError(f"policy: expected 'recompute' or 'fail', got {policy!r}")
    if policy == "recompute" and not callable(recompute):
        raise UsageError("recompute: expected a callable taking the first missing chunk id")


def fallback_plan(result: LoadResult, policy: str) -> int | None:
    """The chunk id to recompute from (None: nothing to do), or LoadFailedError."""
    if result.ok:
        return None
    if policy == "fail":
        raise LoadFailedError(result)
    first = result.first_missing_chunk
    if first is None:  # not built so (a failed result always misses a chunk); stay total
        first = result.chunks_loaded
    log.info(
        "load %r: %s; recomputing from chunk %s (%s)",
        result.kv_request_id,
        result.reason,
        first,
        result.path,
    )
    return first


def report(result: LoadResult, first: int | None, value: T | None) -> LoadReport[T]:
    return LoadReport(result=result, recomputed_from=first, recompute_value=value)
