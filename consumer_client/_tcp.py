"""The consumer's end of a TRANSPORT_TCP load: connect, present the ticket, read frames
straight into the destination (kvpark.tcp_frames), and let the session check each chunk.

It runs on the calling thread (sync client) or a worker thread (async client): `recv_into`
and the CRC release the GIL. The gRPC call stays open beside it; its TransferDone still says
how the transfer ended, and a cancel of that call still tells the producer to stop.

A connection the client kept from an earlier load to the same data address carries the ticket
when there is one (consumer_client/_data_connections.py); a transfer that ends with the end
frame leaves its connection there for the next load. Any other end closes it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import cast

from kvpark.address import Address, target_address
from kvpark.pb import kvpark_pb2 as pb
from kvpark.tcp_frames import (
    ACCEPTED,
    FrameError,
    is_end,
    recv_exactly,
    recv_header,
    recv_payload,
)

from ._data_connections import DataConnections
from ._resolve import LookupTimedOut, connect
from ._result import Reason
from ._session import LoadSession, Step
from ._timeouts import CONCLUSIVE_TIMEOUT_S, OUT_OF_BAND_SHARE

# Connecting, TLS and the ticket exchange take a few round trips on a working network. A path
# that does not work (a data port that a firewall drops) must fall back while the load has
# time: the whole attempt gets at most CONNECT_TIMEOUT_S (a SYN lost once is retried by the
# kernel only after 1 s, so this also falls back rather than wait out a retransmission) and at
# most OUT_OF_BAND_SHARE of what is left of the load's budget.
CONNECT_TIMEOUT_S = 1.0
# How long a client leaves TCP out of its Fetches after a data connection failed for a reason
# that will not go away by itself (refused, unreachable, dropped, a TLS mismatch).
RETRY_AFTER_S = 10.0
# A producer closing a new data connection before any answer turns away that one load (a host
# over its share of handshake slots, say). So many in a row, with no accepted connection in
# between, is a path that never works (an mTLS certificate refused, a proxy with nothing
# behind it): TCP is then left out for RETRY_AFTER_S like any failed path.
TURNED_AWAY_IN_A_ROW = 3
# The share of that attempt a kept connection gets to have its ticket accepted (the producer's
# event loop answers it in its next turn: well under a millisecond when alive, unless that
# loop stalls); the rest is for a new connection when it does not: one that died without a
# word (the producer's host gone, a NAT that forgot it) costs only this.
KEPT_SHARE = 0.5


class Fallback(Exception):
    """The out-of-band path failed before its first byte: the load goes on over the gRPC
    stream. `transport` names that path ("tcp" or "shm"); `path_failed` is False when the
    failure says nothing about the path (no time left to try, a ticket the producer no longer
    waited for), so the client keeps using it; `turned_away` when the producer closed the new
    connection before any answer, which says something only when it keeps happening."""

    def __init__(
        self, why: str, *, transport: str, path_failed: bool = True, turned_away: bool = False
    ) -> None:
        super().__init__(why)
        self.transport = transport
        self.path_failed = path_failed
        self.turned_away = turned_away


def host_of(target: str) -> str | None:
    """The host a gRPC target dials (for a DataOffer that names only a port), or None."""
    address = target_address(target)
    return None if address is None else address.host


@functools.lru_cache(maxsize=256)
def data_address(offered: str, target: str) -> Address:
    """Where a DataOffer's `offered` address points for a client that dials `target`: an
    offer of ":PORT" names the host the client dials. ValueError saying why when it points
    nowhere. Cached: every load of a client is offered the same address, and parsing it
    (IP address checks included) is a visible part of a small load's CPU."""
    text = offered
    if text.startswith(":"):  # the host this client dials for the gRPC call
        host = host_of(target)
        if host is None:
            raise ValueError(f"cannot tell the producer's host from {target!r}")
        text = str(Address(host, 0))[: -len(":0")] + text
    try:
        return Address.parse(text)
    except ValueError as exc:
        raise ValueError(f"bad data address {offered!r}: {exc}") from None


class TcpReceiver:
    """One data connection. `abort()` or `stop_reading()` (from another thread) ends a `run`
    in progress."""

    def __init__(
        self,
        offer: pb.DataOffer,
        target: str,
        tls: ssl.SSLContext | None,
        server_name: str | None = None,
        on_connected: Callable[[], None] | None = None,
        connections: DataConnections | None = None,
    ) -> None:
        self._offer = offer
        self._target = target
        self._tls = tls
        # The name to verify the producer's certificate against: the channel's override when
        # it has one (the data address is then a pod IP the certificate does not name), else
        # the data address's host.
        self._server_name = server_name
        # Told once the producer accepted the ticket: the path works.
        self._on_connected = on_connected
        self._sock: socket.socket | None = None
        self._aborted = False
        # `stop_reading` ran (from another thread): the connection is not kept. `_sock` is
        # handed over under `_lock`, so a connection either goes back to `connections` whole
        # or is shut down here, never shut down after another load took it.
        self._stopped = False
        self._lock = threading.Lock()
        # Where this connection goes when its transfer ends with the end frame, and under
        # which key (None: the client keeps no connections).
        self._connections = connections
        self._key: tuple[str, int, bool, str | None] | None = None

    def abort(self) -> None:
        """The load was abandoned (the client closed, the caller cancelled): a `run` in
        progress returns ABANDON."""
        self._aborted = True
        self.stop_reading()

    def stop_reading(self) -> None:
        """Ends a `run` in progress as if the producer had closed the connection: `run`
        returns CONTINUE and the load reads its call's status. For a call that failed while
        its bytes were read (a producer that stopped answering keepalive pings): a frozen
        process or a host gone silent leaves the data connection open, and the read would
        otherwise wait out the load's deadline."""
        with self._lock:
            self._stopped = True
            sock = self._sock
        if sock is not None:
            # close() alone does not wake a thread blocked in recv on this socket (Linux), and
            # the connection stays open until that recv returns: shut it down first.
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            sock.close()

    def _connect(self, budget_s: float) -> socket.socket:
        """The data connection, ticket accepted, within `budget_s` in all; Fallback when that
        cannot be had."""
        offer = self._offer
        try:
            address = data_address(offer.address, self._target)
        except ValueError as exc:
            raise _failed(str(exc)) from None
        if offer.tls and self._tls is None:
            raise _failed("the data connection needs TLS and the client has no data_tls")
        if budget_s <= 0:
            raise Fallback("no time left to connect", transport="tcp", path_failed=False)
        deadline = time.monotonic() + budget_s
        self._key = (address.host, address.port, offer.tls, self._server_name)
        kept = self._ticket_on_kept(min(deadline, time.monotonic() + budget_s * KEPT_SHARE))
        if kept is not None:
            return kept
        left = _until(deadline)
        fresh_s = deadline - time.monotonic()  # what the new connection had, for `conclusive`
        connected = False
        try:
            sock = connect(address, left())
            connected = True
            self._sock = sock
            self._check_aborted()  # abort() ran while we connected: it could not close this
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if offer.tls and self._tls is not None:
                sock.settimeout(left())  # the whole handshake, as one call
                sock = self._tls.wrap_socket(
                    sock, server_hostname=self._server_name or address.host
                )
                self._sock = sock
            answer = _present(sock, offer.ticket, left)
        except FrameError:
            # The producer closed the connection without a word: it no longer waited for this
            # ticket (the Fetch ended meanwhile, or its handshake took too long there), unless
            # we cut it off ourselves.
            turned_away = not self._stopped
            self.abort()
            raise Fallback(
                f"data connection to {address}: the ticket was not taken",
                transport="tcp", path_failed=False, turned_away=turned_away,
            ) from None  # fmt: skip
        except (OSError, ssl.SSLError) as exc:
            # A failure we caused (an abort, or `stop_reading` after the call failed), a
            # timeout with little time to try, or a connection the producer took and then
            # closed before any answer (it refuses what it cannot take now: a host over its
            # share of handshake slots, a ticket of a Fetch that ended) says nothing about the
            # path, unless the last keeps happening (TURNED_AWAY_IN_A_ROW); nor does a slow
            # name lookup, whose answer serves the next load.
            closed_by_producer = (
                connected and not self._stopped and isinstance(exc, _CLOSED_BY_PEER)
            )
            conclusive = (
                not self._stopped
                and not closed_by_producer
                and not isinstance(exc, LookupTimedOut)
                and (not isinstance(exc, TimeoutError) or fresh_s >= CONCLUSIVE_TIMEOUT_S)
            )
            self.abort()
            raise Fallback(
                f"data connection to {address}: {exc or type(exc).__name__}",
                transport="tcp", path_failed=conclusive, turned_away=closed_by_producer,
            ) from None  # fmt: skip
        if answer != ACCEPTED:
            self.abort()
            raise Fallback(
                f"data connection to {address}: the ticket was not accepted",
                transport="tcp", path_failed=False,
            )  # fmt: skip
        self._check_aborted()  # an abort that ran before `self._sock` named the TLS socket
        if self._on_connected is not None:
            self._on_connected()
        return sock

    def _check_aborted(self) -> None:
        """Fallback (not a path failure) when `abort` ran: it may have run before `_sock`
        named the socket just made, so this closes it too."""
        if self._aborted:
            self.abort()
            raise Fallback("the load was abandoned", transport="tcp", path_failed=False)

    def _ticket_on_kept(self, deadline: float) -> socket.socket | None:
        """A kept connection to this address with the ticket accepted, or None (none kept,
        or it failed by `deadline`: then the caller connects anew with the same ticket).
        Raises Fallback when the load was abandoned meanwhile."""
        assert self._key is not None
        kept = None if self._connections is None else self._connections.take(self._key)
        if kept is None:
            return None
        self._sock = kept
        try:
            answer = _present(kept, self._offer.ticket, _until(deadline))
        except (OSError, ssl.SSLError):  # FrameError too: it died while idle
            answer = b""
        if answer == ACCEPTED:
            self._check_aborted()
            if self._on_connected is not None:
                self._on_connected()
            return kept
        kept.close()
        self._check_aborted()
        return None

    def run(self, session: LoadSession) -> Step:
        """Reads every frame into the session's destination. CONTINUE: read the gRPC stream
        on for the outcome; ABANDON: the session gave up (cancel the call). Raises Fallback
        before the first byte, BufferTooSmallError as `place` does."""
        # The first limit the load meets: no chunk has come yet, so a first-chunk limit
        # counts too, and a data port that does not answer leaves it time for the stream.
        limits = [s for s in (session.remaining_s(), session.first_chunk_remaining_s())
                  if s is not None]  # fmt: skip
        share = min(limits) * OUT_OF_BAND_SHARE if limits else CONNECT_TIMEOUT_S
        sock = self._connect(min(CONNECT_TIMEOUT_S, share))
        ended = False  # the end frame came: the connection is idle and may be kept
        bounded = cast(socket.socket, _Bounded(sock, session))
        try:
            if self._stopped:  # it ran before `_sock` named this socket, which it missed
                return Step.ABANDON if self._aborted else Step.CONTINUE
            while True:
                header = recv_header(bounded)
                if header is None:
                    return Step.CONTINUE  # the producer is done: the TransferDone says how
                if is_end(header):
                    ended = True
                    return Step.CONTINUE  # ... and keeps the connection for our next load
                chunk_id, crc32c, nbytes = header
                refused = session.expected_chunk(chunk_id, nbytes)
                if refused is not None:
                    return refused
                parts = session.parts_for(chunk_id, nbytes)
                landed_crc = recv_payload(bounded, parts, nbytes)
                step = session.landed(chunk_id, crc32c, parts, nbytes, landed_crc)
                if step is not Step.CONTINUE:
                    return step
        except _ReadTimedOut:
            return session.give_up(Reason.TIMEOUT, "load timeout on the data connection")
        except (_ReadFailed, FrameError) as exc:
            if self._aborted:
                return Step.ABANDON
            # The producer broke the connection (it failed the transfer, or died), or the
            # network did: the gRPC call tells which.
            session.data_connection_broke(str(exc))
            return Step.CONTINUE
        finally:
            self._release(ended)

    def _release(self, ended: bool) -> None:
        """Keeps the connection for the next load when its transfer ended with the end frame
        (and nobody stopped the reading meanwhile), else closes it."""
        with self._lock:
            sock, self._sock = self._sock, None
            keep = ended and not self._stopped and self._connections is not None
        if sock is None:
            return
        if keep:
            assert self._key is not None and self._connections is not None
            self._connections.give(self._key, sock)
        else:
            sock.close()


class _Bounded:
    """The data socket, each `recv_into` bounded by what is left of the load: its total
    deadline, and before the first chunk its first-chunk deadline (the DataOffer disarmed the
    client's first-chunk watchdog). A socket timeout is per call, so setting it once would let
    a producer that trickles bytes and then goes silent hold the load up to twice its budget.
    Setting it before every read costs a system call per read (thousands per load), so it is
    set again only when the bound moved or RESET_S passed since: a read then ends at most
    RESET_S after the bound."""

    RESET_S = 0.05

    def __init__(self, sock: socket.socket, session: LoadSession) -> None:
        self._sock = sock
        self._session = session
        self._bound: float | None = None
        self._set_at = -math.inf

    def recv_into(self, view: memoryview) -> int:
        session = self._session
        bound = session.deadline
        first = session.first_chunk_deadline
        if first is not None and session.chunks_loaded == 0 and (bound is None or first < bound):
            bound = first
        try:
            if bound is not None:
                now = time.monotonic()
                if bound != self._bound or now - self._set_at > self.RESET_S:
                    if now >= bound:
                        raise TimeoutError("load deadline passed")
                    self._sock.settimeout(bound - now)
                    self._bound, self._set_at = bound, now
            elif self._bound is not None or self._set_at == -math.inf:
                self._sock.settimeout(None)
                self._bound, self._set_at = None, 0.0
            return self._sock.recv_into(view)
        except TimeoutError as exc:
            raise _ReadTimedOut(str(exc)) from exc
        except OSError as exc:
            raise _ReadFailed(str(exc)) from exc


# The data connection's own failures, apart from an OSError or TimeoutError raised by the
# caller's code that runs between reads (an `into` callable, `on_chunk`): those reach the
# caller as on the gRPC stream, not taken for a broken connection or the load's timeout.
class _ReadTimedOut(Exception):
    """A read of the data connection reached the load's bound."""


class _ReadFailed(Exception):
    """A read of the data connection failed: the producer closed or reset it, or it broke."""


# How a connection the peer closed on us shows: a reset (it closed with our ticket unread), a
# broken pipe, or over TLS an end of file in the middle of the handshake.
_CLOSED_BY_PEER = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


def _until(deadline: float) -> Callable[[], float]:
    """The time left until `deadline`, for each socket call of an attempt in turn (not a
    fresh timeout per call); TimeoutError once it passed."""

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        return remaining

    return left


def _present(sock: socket.socket, ticket: bytes, left: Callable[[], float]) -> bytes:
    """Sends the ticket and returns the producer's one-byte answer, each step within what
    `left()` says the attempt has left."""
    sock.settimeout(left())
    sock.sendall(ticket)
    answer = bytearray(1)
    sock.settimeout(left())
    recv_exactly(sock, memoryview(answer))
    return bytes(answer)


def _failed(why: str) -> Fallback:
    """A data path that cannot work as configured: not tried again for a while."""
    return Fallback(why, transport="tcp")
