"""What the sync and the async client share besides a load: settings, channel options,
metadata, argument checks, first-contact bookkeeping and the fallback policy. No I/O.

`KVConsumer` and `AsyncKVConsumer` each own one `ClientCore` and differ only in how they wait
(threads vs. asyncio). Keeping the decisions here means the two cannot drift apart.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar

import grpc

from kvpark.ids import check_id
from kvpark.pb import kvpark_pb2 as pb

from ._buffers import destination_for
from ._errors import ClientClosedError, LoadFailedError, UsageError
from ._models import IdStatus, ProducerInfo
from ._result import LoadPath, LoadReport, LoadResult, Reason
from ._session import LoadSession, OnChunk
from ._timeouts import Timeout

log = logging.getLogger("kvpark.client")

SERVICE = "/kvpark.v1.KVProducer/"
FETCH_METHOD = SERVICE + "Fetch"
# Room for a FetchResponse's framing around a max_chunk_bytes payload (a few bytes are
# needed; the producer uses the same margin).
FRAME_MARGIN_BYTES = 64 * 1024
# Receive limit before ServerInfo is known: the spec's default max_chunk_bytes (16 MiB). First
# contact raises it (by rebuilding the idle channel) if the producer allows larger chunks.
DEFAULT_MAX_CHUNK_BYTES = 16 * 1024 * 1024
# Unary calls (ServerInfo, Lookup, KeepAlive, Release) answer in about a round trip.
DEFAULT_RPC_TIMEOUT_S = 10.0
# Transport keepalive while a call is open: a producer that vanished without closing the
# connection (network cut, frozen host) is noticed within about PING + TIMEOUT seconds. The
# producer permits pings every 1 s. A killed process is noticed at once (the kernel resets
# the connection), without waiting for a ping.
KEEPALIVE_PING_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
# Reconnect quickly after a producer restart: a decode worker should see the new process (and
# its EPOCH_MISMATCH answers) within a second or two, not after grpc's default 120 s backoff.
# (Not grpc.min_reconnect_backoff_ms: grpc core also uses it as the minimum time a connection
# attempt may take, default 20 s; lowering it fails slow handshakes, e.g. TLS on a busy node.)
RECONNECT_BACKOFF_MS = (100, 2_000)  # initial, max
MAX_IDS_PER_CALL = 10_000
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1

Fallback = Literal["recompute", "raise"]
T = TypeVar("T")


class TimeoutConfigWarning(UserWarning):
    """The client's load timeout is not below the producer's tombstone_retention_s: a late
    fetch could see UNKNOWN_ID instead of the real reason (spec §5)."""


class ClientCore:
    def __init__(
        self,
        target: str,
        *,
        timeout: Timeout | float | None,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        channel_options: Sequence[tuple[str, Any]],
        interceptors: Sequence[Any],
    ) -> None:
        if not isinstance(target, str) or not target:
            raise UsageError(f"target: expected 'host:port', got {target!r}")
        if token is not None and (not isinstance(token, str) or not token or "\n" in token):
            raise UsageError("token: expected a non-empty one-line string")
        self.target = target
        self.timeout = Timeout.coerce(timeout, Timeout())
        self.credentials = credentials
        self.interceptors = tuple(interceptors)
        self.metadata: tuple[tuple[str, str], ...] | None = (
            (("authorization", f"Bearer {token}"),) if token else None
        )
        self._extra_options = dict(channel_options)
        self.max_chunk_bytes = DEFAULT_MAX_CHUNK_BYTES
        self.info: ProducerInfo | None = None
        self.closed = False
        self._warned = False
        self._warn_lock = threading.Lock()

    # ------------------------------------------------------------------------------ channel
    def channel_options(self) -> list[tuple[str, Any]]:
        options: dict[str, Any] = {
            "grpc.max_receive_message_length": self.max_chunk_bytes + FRAME_MARGIN_BYTES,
            "grpc.keepalive_time_ms": KEEPALIVE_PING_MS,
            "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
            "grpc.keepalive_permit_without_calls": 0,
            "grpc.http2.max_pings_without_data": 0,
            "grpc.initial_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[0],
            "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[1],
            # Larger HTTP/2 frames and socket reads for multi-MiB chunks: fewer, bigger copies
            # in gRPC's receive path (docs/performance.md: -12 % client CPU per GB).
            "grpc.http2.max_frame_size": 16 * 1024 * 1024 - 1,
            "grpc.experimental.tcp_min_read_chunk_size": 4 * 1024 * 1024,
            "grpc.experimental.tcp_max_read_chunk_size": 8 * 1024 * 1024,
        }
        options.update(self._extra_options)  # the caller's options win
        return list(options.items())

    def accept_info(self, info: ProducerInfo, *, channel_fresh: bool) -> bool:
        """Records a ServerInfo read. True when the channel must be rebuilt because the
        producer accepts chunks larger than the channel's receive limit; that is only done
        while the channel has carried nothing but this ServerInfo call (closing a busy one
        would cancel its loads), otherwise larger chunks fail as RPC_ERROR and we say so."""
        self.info = info
        self.check_timeout(self.timeout)
        if info.max_chunk_bytes <= self.max_chunk_bytes:
            return False
        if channel_fresh:
            self.max_chunk_bytes = info.max_chunk_bytes
            return True
        log.warning(
            "producer %s now accepts %d-byte chunks, above this client's receive limit of %d: "
            "recreate the client to load them",
            self.target,
            info.max_chunk_bytes,
            self.max_chunk_bytes,
        )
        return False

    def note_status(self, code: grpc.StatusCode | None) -> None:
        """After UNAVAILABLE the producer may come back as a new process: read ServerInfo
        again on the next contact."""
        if code == grpc.StatusCode.UNAVAILABLE:
            self.info = None

    def check_timeout(self, timeout: Timeout) -> None:
        """Warns once per client if `timeout` can outlast the producer's tombstones."""
        info = self.info
        if info is None or self._warned:
            return
        longest = timeout.longest_s
        if longest is not None and longest < info.tombstone_retention_s:
            return
        with self._warn_lock:
            if self._warned:
                return
            self._warned = True
        shown = "unbounded" if longest is None else f"{longest:g}s"
        message = (
            f"kvpark client load timeout ({shown}) is not below producer {self.target}'s "
            f"tombstone_retention_s ({info.tombstone_retention_s:g}s): a late fetch could see "
            "UNKNOWN_ID instead of the real reason"
        )
        log.warning(message)
        warnings.warn(message, TimeoutConfigWarning, stacklevel=4)

    def check_open(self) -> None:
        if self.closed:
            raise ClientClosedError(f"the kvpark client for {self.target} is closed")

    # ------------------------------------------------------------------------------ requests
    def begin_load(
        self,
        kv_request_id: str,
        *,
        chunk_ids: Iterable[int] | None,
        num_chunks: int | None,
        into: Any,
        expected_epoch: int,
        timeout: Timeout | float | None,
        wait_timeout_s: float,
        on_chunk: OnChunk | None,
    ) -> LoadSession:
        """Checks a load's arguments (UsageError) and starts its session."""
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
        load_timeout = Timeout.coerce(timeout, self.timeout)
        self.check_timeout(load_timeout)
        return LoadSession(
            kv_request_id=kid,
            chunk_ids=ids,
            destination=destination_for(into),
            timeout=load_timeout,
            expected_epoch=expected_epoch,
            wait_timeout_s=wait,
            on_chunk=on_chunk,
        )

    def finish_load(self, session: LoadSession) -> LoadResult:
        result = session.result(self.info.producer_epoch if self.info else None)
        self.note_status(result.grpc_code)
        if result.reason is Reason.EPOCH_MISMATCH:
            self.info = None  # the producer restarted: re-read its ServerInfo
        return result


class ClientBase:
    """What `KVConsumer` and `AsyncKVConsumer` share that does not wait on anything: settings,
    first-contact state and their read-only surface."""

    def __init__(self, target: str, **settings: Any) -> None:
        # `settings` are ClientCore's keyword arguments, spelled out on the public classes.
        self._core = ClientCore(target, **settings)
        # True while the open channel has carried nothing but first contact (it may then be
        # rebuilt with a larger receive limit without disturbing any call).
        self._fresh = False

    @property
    def target(self) -> str:
        return self._core.target

    @property
    def timeout(self) -> Timeout:
        """The default load timeout."""
        return self._core.timeout

    @property
    def info(self) -> ProducerInfo | None:
        """The producer's ServerInfo as of first contact (None before it, and again after the
        producer went away or answered EPOCH_MISMATCH, until the next contact)."""
        return self._core.info

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r}{', closed' if self.closed else ''})"

    def _accept_info(self, msg: Any) -> bool:
        """Records a ServerInfo answer; True when the channel must be rebuilt."""
        return self._core.accept_info(ProducerInfo.from_proto(msg), channel_fresh=self._fresh)


# ------------------------------------------------------------------------ unary messages
def lookup_requests(kv_request_ids: Iterable[str]) -> list[Any]:
    return [pb.LookupRequest(kv_request_ids=b) for b in batches(valid_ids(kv_request_ids))]


def keepalive_requests(kv_request_ids: Iterable[str], extend_s: float) -> list[Any]:
    extend = extend_seconds(extend_s)
    ids = valid_ids(kv_request_ids)
    return [pb.KeepAliveRequest(kv_request_ids=b, extend_s=extend) for b in batches(ids)]


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


def rpc_timeout(value: float | None) -> float | None:
    return None if value is None else (_seconds("timeout", value) or None)


def extend_seconds(value: float) -> float:
    return _seconds("extend_s", value)


def _chunk_ids(chunk_ids: Iterable[int] | None, num_chunks: int | None) -> tuple[int, ...] | None:
    if chunk_ids is not None and num_chunks is not None:
        raise UsageError("give chunk_ids or num_chunks, not both")
    if num_chunks is not None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
            raise UsageError(f"num_chunks: expected an int, got {num_chunks!r}")
        if not 1 <= num_chunks <= _UINT32_MAX + 1:
            raise UsageError(f"num_chunks: expected >= 1, got {num_chunks}")
        return tuple(range(num_chunks))
    if chunk_ids is None:
        return None  # all chunks of the id, as many as the producer has
    if isinstance(chunk_ids, str | bytes):
        raise UsageError("chunk_ids: expected a collection of ints")
    ids = tuple(chunk_ids)
    if not ids:
        raise UsageError("chunk_ids: empty (pass None for all chunks)")
    for cid in ids:
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid <= _UINT32_MAX:
            raise UsageError(f"chunk_ids: {cid!r} is not a uint32 chunk id")
    if len(set(ids)) != len(ids):
        raise UsageError("chunk_ids: repeats a chunk")
    return ids


# -------------------------------------------------------------------------------- fallback
def check_fallback(fallback: str, recompute: object) -> None:
    if fallback not in ("recompute", "raise"):
        raise UsageError(f"fallback: expected 'recompute' or 'raise', got {fallback!r}")
    if fallback == "recompute" and not callable(recompute):
        raise UsageError("recompute: expected a callable taking the first missing chunk id")


def fallback_plan(result: LoadResult, fallback: str) -> int | None:
    """The chunk id to recompute from (None: nothing to do), or LoadFailedError."""
    if result.ok:
        return None
    if fallback == "raise":
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
    return LoadReport(
        result=result,
        path=LoadPath.REMOTE if first is None else result.path,
        recomputed_from=first,
        recompute_value=value,
    )


RecomputeFn = Callable[[int], T]
