"""The data listener: where TRANSPORT_TCP connections arrive (the `data_listen` key).

A Fetch that goes out of band asks for a ticket (`expect`): 32 random bytes, bound to that one
Fetch, handed to its consumer in the DataOffer. A connection to this listener counts only once
it has presented a ticket that is waiting (single use: the ticket is gone once used) within the
handshake timeout; anything else — no ticket, an unknown, forged or reused one, a slow or
broken TLS handshake — is closed with nothing sent. A ticket also dies with its Fetch
(`forget`), so a connection can never attach to a transfer that already ended.

A connection whose Fetch ended with the end frame (the consumer keeps its data connections)
comes back here (`keep`) and waits, idle, for that consumer's next ticket; it counts as a new
connection for that ticket, with the same rules minus the TLS handshake it already made. Idle
connections cost a file descriptor and socket buffers, no thread: at most MAX_IDLE are kept
(the longest idle is closed first), each at most IDLE_TIMEOUT_S, longer than the bundled
clients keep theirs, so a consumer normally closes first and never sends a ticket into a
connection that is being closed.

One thread watches the listening socket (a selector); each new connection's handshake (TLS,
then the ticket) runs on a short-lived thread, bounded in number and per source host, so a
slow or hostile peer never holds up the event loop or the next consumer. The event loop itself
watches the idle connections: a kept connection's ticket is one 32-byte read that never waits
(a ticket that did not come in whole goes to a handshake thread), and taking it where the Fetch
waits spares each reused transfer two hand-overs between threads, each a wake-up and a turn at
the GIL on a busy producer (docs/performance.md). The Fetch writes to the socket it is handed
from worker threads (producer_service/transports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

from kvpark.address import Address
from kvpark.tcp_frames import ACCEPTED, TICKET_BYTES

from .logs import LOGGER_NAME
from .metrics import ProducerMetrics

log = logging.getLogger(LOGGER_NAME)

# Handshakes (TLS + ticket) in progress at once; more connections wait in the listen backlog.
MAX_HANDSHAKES = 64
# ... of which one host's new connections may take this many once half the slots are busy:
# a connection takes its slot before it has shown anything, so without this a single peer that
# connects and stays silent (no ticket, no token, no certificate needed) could hold every slot
# and send every consumer's new data connection to the gRPC stream. Below half, any host may
# take more (a decode host opening many connections at once), so one host holds at most half.
MAX_HANDSHAKES_PER_HOST = MAX_HANDSHAKES // 4
HANDSHAKE_TIMEOUT_S = 5.0
# Kept connections waiting for their consumer's next ticket.
MAX_IDLE = 1024
# The most file descriptors the listener holds at once: its socket, wake-up pair and selector,
# the handshakes in progress and the kept connections (a connection a Fetch took is that
# call's).
DESCRIPTORS = 4 + MAX_HANDSHAKES + MAX_IDLE
IDLE_TIMEOUT_S = 60.0
# How often the listener thread looks at `stop`, and the event loop at idle connections that
# timed out (while there are any).
_TICK_S = 0.25


class DataListener:
    def __init__(
        self,
        address: Address,
        *,
        tls: ssl.SSLContext | None,
        loop: asyncio.AbstractEventLoop,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        metrics: ProducerMetrics | None = None,
    ) -> None:
        self._metrics = metrics
        self._address = address
        self._tls = tls
        self._loop = loop
        self._timeout = handshake_timeout_s
        self.idle_timeout_s = IDLE_TIMEOUT_S  # read on every `_sweep`
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # ticket -> the Fetch's future for its connection. Added by `expect`, removed by the
        # connection that presents the ticket or by `forget` when the Fetch ends.
        self._waiting: dict[bytes, asyncio.Future[socket.socket]] = {}
        # Tickets taken out of `_waiting` by a connection whose ACCEPTED byte is being sent;
        # `forget` drops them too, so a send that fails puts back only a ticket whose Fetch
        # still waits.
        self._answering: set[bytes] = set()
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        # Source host -> its new connections' handshakes in progress, and their sum (under
        # `_lock`).
        self._host_handshakes: Counter[str] = Counter()
        self._handshakes_running = 0
        self._stopping = threading.Event()
        # Wakes the listener thread (to accept again, or to stop).
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Idle connections, longest idle first: socket -> when it became idle. Only the event
        # loop touches it; `_sweep` closes the ones idle too long while there are any.
        self._idle: OrderedDict[socket.socket, float] = OrderedDict()
        self._sweep_timer: asyncio.TimerHandle | None = None
        # False while MAX_HANDSHAKES run, or until `_resume_at` after accept failed: the
        # listening socket is out of the selector.
        self._accepting = True
        self._resume_at = 0.0
        self.port = 0
        self.refused = 0  # connections closed without a valid ticket
        self.accepted = 0  # new connections that presented a valid ticket
        self.reused = 0  # tickets taken on a kept connection

    @property
    def tls(self) -> bool:
        return self._tls is not None

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self._address.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self._address.host, self._address.port))
        except OSError:
            listener.close()  # the caller reports the error; the socket must not leak
            raise
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="kvpark-data", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stops taking connections and closes the idle ones (on the event loop's thread)."""
        with self._lock:
            self._stopping.set()
            self._wake()
        if self._thread is not None:
            self._thread.join(5)
        if self._listener is not None:
            self._listener.close()
        self._close_idle(float("inf"))
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        with self._lock:
            self._wake_r.close()
            self._wake_w.close()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            self._loop.call_soon_threadsafe(_cancel, future)

    # ------------------------------------------------------------------------------ tickets
    def expect(self) -> tuple[bytes, asyncio.Future[socket.socket]]:
        """A new single-use ticket, and the future its connection arrives on (event loop)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        future: asyncio.Future[socket.socket] = self._loop.create_future()
        with self._lock:
            self._waiting[ticket] = future
        return ticket, future

    def forget(self, ticket: bytes) -> None:
        """The Fetch ended: its ticket opens nothing any more."""
        with self._lock:
            self._waiting.pop(ticket, None)
            self._answering.discard(ticket)

    def keep(self, conn: socket.socket) -> None:
        """A Fetch ended with the end frame on `conn`: wait on it for the consumer's next
        ticket (on the event loop's thread)."""
        if self._stopping.is_set():
            conn.close()
            return
        if isinstance(conn, ssl.SSLSocket) and conn.pending():
            # TLS already holds the next ticket's bytes: the socket would never turn readable.
            self._next_ticket(conn)
            return
        try:
            self._loop.add_reader(conn, self._next_ticket, conn)
        except (OSError, ValueError) as exc:  # closed meanwhile
            log.debug("kept data connection ended: %s", exc)
            conn.close()
            return
        self._idle[conn] = time.monotonic()
        self._close_idle(float("-inf"), keep_at_most=MAX_IDLE)  # the longest idle go first
        self._idle_changed()
        if self._sweep_timer is None:
            self._sweep_timer = self._loop.call_later(_TICK_S, self._sweep)

    def _sweep(self) -> None:
        """Closes the connections idle longer than `idle_timeout_s`, every _TICK_S while any
        are idle."""
        self._sweep_timer = None
        self._close_idle(time.monotonic() - self.idle_timeout_s)
        if self._idle and not self._stopping.is_set():
            self._sweep_timer = self._loop.call_later(_TICK_S, self._sweep)

    def _wake(self) -> None:
        """Wakes the listener thread (under the lock, so the socket pair is still open)."""
        # Full: a wake-up is pending anyway. Closed: stopped, nothing to wake.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    @property
    def idle(self) -> int:
        """Kept connections waiting for a ticket."""
        return len(self._idle)

    @property
    def accepting(self) -> bool:
        """Whether new connections are taken now; False while every handshake slot is busy
        (they wait in the backlog) or for a tick after accept failed."""
        return self._accepting

    # ---------------------------------------------------------------------------- threads
    def _serve(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                try:
                    self._turn(selector)
                except Exception:  # never end the thread: no new data connection would work
                    log.exception("data listener: unexpected error; going on")

    def _turn(self, selector: selectors.BaseSelector) -> None:
        for key, _ in selector.select(_TICK_S):
            if key.fileobj is self._listener:
                self._accept(selector)
            else:  # woken up: to stop, or a handshake slot freed
                with contextlib.suppress(BlockingIOError):
                    while self._wake_r.recv(4096):
                        pass
        resume = not self._accepting and time.monotonic() >= self._resume_at
        if resume and self._handshakes.acquire(blocking=False):
            self._handshakes.release()  # a handshake ended: accept again
            assert self._listener is not None
            selector.register(self._listener, selectors.EVENT_READ)
            self._accepting = True

    def _accept(self, selector: selectors.BaseSelector) -> None:
        """Accepts what waits, each with a handshake thread. With MAX_HANDSHAKES running, the
        listener is left out of the selector (further connections wait in the backlog) until
        one ends: this thread never blocks on a peer."""
        assert self._listener is not None
        while True:
            if not self._handshakes.acquire(blocking=False):
                selector.unregister(self._listener)
                self._accepting = False
                return
            try:
                conn, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                self._handshakes.release()
                return
            except OSError as exc:  # out of descriptors, a connection reset before accept
                self._handshakes.release()
                log.warning("data listener: accept failed: %s; pausing accepts", exc)
                # The listener stays readable: accepting again at once would spin this thread.
                selector.unregister(self._listener)
                self._accepting = False
                self._resume_at = time.monotonic() + _TICK_S
                return
            if not self._host_may_start(peer):
                self._handshakes.release()
                limit = MAX_HANDSHAKES_PER_HOST
                self._refuse(conn, peer, ConnectionRefusedError(f"{limit} handshakes at once"))
                continue
            self._start_handshake(conn, peer, kept=False)

    def _host_may_start(self, peer: Any) -> bool:
        """Counts a new connection's handshake against its host, unless half the slots are
        busy and the host has MAX_HANDSHAKES_PER_HOST in progress already."""
        host = _host_of(peer)
        with self._lock:
            busy = self._handshakes_running >= MAX_HANDSHAKES // 2
            if busy and self._host_handshakes[host] >= MAX_HANDSHAKES_PER_HOST:
                return False
            self._host_handshakes[host] += 1
            self._handshakes_running += 1
            return True

    def _handshake_ended(self, peer: Any, kept: bool) -> None:
        """Gives back the slots a handshake held."""
        if not kept:
            host = _host_of(peer)
            with self._lock:
                self._host_handshakes[host] -= 1
                self._handshakes_running -= 1
                if not self._host_handshakes[host]:
                    del self._host_handshakes[host]
        self._handshakes.release()

    def _close_idle(self, before: float, keep_at_most: int = MAX_IDLE) -> None:
        """Closes the connections idle since `before`, and the longest idle beyond
        `keep_at_most` (event loop)."""
        while self._idle:
            conn, since = next(iter(self._idle.items()))
            if since >= before and len(self._idle) <= keep_at_most:
                return
            self._unwatch(conn)
            conn.close()

    def _unwatch(self, conn: socket.socket) -> None:
        """Takes an idle connection out of the event loop's watch."""
        del self._idle[conn]
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # closed fd or loop
            self._loop.remove_reader(conn)
        self._idle_changed()

    def _idle_changed(self) -> None:
        if self._metrics is not None:
            self._metrics.data_connections_idle.set(len(self._idle))

    def _count(self, connection: str) -> None:
        if self._metrics is not None:
            self._metrics.count_data_connection(connection)

    def _start_handshake(
        self, conn: socket.socket, peer: Any, *, kept: bool, prefix: bytes = b""
    ) -> None:
        """Runs `_handshake` on a thread of its own, in a slot of `_handshakes` the caller
        acquired."""
        try:
            threading.Thread(
                target=self._handshake,
                args=(conn, peer, kept, prefix),
                name="kvpark-data-hs",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # no thread to be had (a tight pids limit): refuse this one
            self._handshake_ended(peer, kept)
            self._refuse(conn, peer, exc)

    def _next_ticket(self, conn: socket.socket) -> None:
        """A kept connection turned readable (event loop). Its ticket is taken right here
        when it came in whole (the usual case: 32 bytes, one segment), else on a handshake
        thread: a read here never waits. Starting a thread costs 0.5-3 ms on a busy producer
        (the new thread must get the GIL before `start` returns), more than the rest of the
        exchange."""
        if conn in self._idle:
            self._unwatch(conn)
        peer = "a kept connection"
        ticket = bytearray(TICKET_BYTES)
        try:
            conn.setblocking(False)
            got = conn.recv_into(ticket)
        except (BlockingIOError, ssl.SSLWantReadError):  # TLS: the record is not all here
            got = -1
        except (OSError, ssl.SSLError) as exc:
            log.debug("kept data connection ended: %s", exc)
            conn.close()
            return
        if got == 0:  # the consumer closed a connection it kept: no news
            conn.close()
        elif got == TICKET_BYTES:
            try:
                future = self._answer(conn, bytes(ticket), kept=True)
            except (OSError, ssl.SSLError) as exc:
                self._refuse(conn, peer, exc)
            else:
                _deliver(future, conn)
        elif self._handshakes.acquire(blocking=False):
            self._start_handshake(conn, peer, kept=True, prefix=bytes(ticket[: max(got, 0)]))
        else:  # no handshake thread free: the consumer connects anew within its attempt
            conn.close()

    def _handshake(self, conn: socket.socket, peer: Any, kept: bool, prefix: bytes) -> None:
        # One deadline for the whole handshake: a socket timeout bounds each recv, and a
        # peer trickling its ticket a byte at a time would otherwise hold its slot for ever.
        deadline = time.monotonic() + self._timeout
        try:
            conn.settimeout(self._timeout)
            if not kept:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls is not None:  # CPython bounds the TLS handshake as one call
                    conn = self._tls.wrap_socket(conn, server_side=True)
            ticket = bytearray(TICKET_BYTES)
            view = memoryview(ticket)
            view[: len(prefix)] = prefix
            got = len(prefix)
            while got < TICKET_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no whole ticket within the handshake timeout")
                conn.settimeout(left)
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("the connection ended before its ticket")
                got += n
            future = self._answer(conn, bytes(ticket), kept)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._refuse(conn, peer, exc)
        else:
            try:
                self._loop.call_soon_threadsafe(_deliver, future, conn)
            except RuntimeError:  # the event loop is closed: the producer is going away
                conn.close()
        finally:
            self._handshake_ended(peer, kept)
            if not self._accepting:
                with self._lock:
                    if not self._stopping.is_set():
                        self._wake()  # the listener thread accepts again

    def _answer(
        self, conn: socket.socket, ticket: bytes, kept: bool
    ) -> asyncio.Future[socket.socket]:
        """Sends the ACCEPTED byte and returns the future of the Fetch waiting for `ticket`,
        for the caller to `_deliver` `conn` to on the event loop; raises
        ConnectionRefusedError when no Fetch waits for it."""
        with self._lock:
            future = self._waiting.pop(ticket, None)
            if future is not None:
                self._answering.add(ticket)
        if future is None:
            raise ConnectionRefusedError("no Fetch waits for this ticket")
        # One byte into a socket whose consumer has read all we sent: it never waits, so the
        # event loop sends it without blocking, and fails the connection if it ever had to.
        # The ticket then stays good for the new connection the consumer makes next.
        try:
            if conn.send(ACCEPTED) != len(ACCEPTED):
                raise ConnectionError("no room for the ACCEPTED byte")
        except BaseException:
            with self._lock:
                # Not when its Fetch ended meanwhile (`forget` ran, or its future is done):
                # put back then, the ticket would wait for ever, for nobody.
                if ticket in self._answering and not future.done():
                    self._waiting.setdefault(ticket, future)
            raise
        finally:
            with self._lock:
                self._answering.discard(ticket)
        conn.setblocking(True)
        if kept:
            self.reused += 1
        else:
            self.accepted += 1
        self._count("kept" if kept else "new")
        return future

    def _refuse(self, conn: socket.socket, peer: Any, exc: Exception) -> None:
        self.refused += 1
        self._count("refused")
        log.debug("data connection from %s refused: %s", peer, exc)
        conn.close()


def _host_of(peer: Any) -> str:
    """The source host of an accepted connection's address (IPv4 or IPv6 tuple)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _deliver(future: asyncio.Future[socket.socket], conn: socket.socket) -> None:
    if future.done():  # the Fetch gave up meanwhile
        conn.close()
    else:
        future.set_result(conn)


def _cancel(future: asyncio.Future[socket.socket]) -> None:
    if not future.done():
        future.cancel()
