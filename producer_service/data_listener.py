"""The data listener: where TRANSPORT_TCP connections arrive (the `data_listen` key).

A Fetch that goes out of band asks for a ticket (`expect`): 32 random bytes, bound to that one
Fetch, handed to its consumer in the DataOffer. A connection to this listener counts only once
it has presented a ticket that is waiting (single use: the ticket is gone once used) within the
handshake timeout; anything else — no ticket, an unknown, forged or reused one, a slow or
broken TLS handshake — is closed with nothing sent. A ticket also dies with its Fetch
(`forget`), so a connection can never attach to a transfer that already ended.

Connections are accepted on a thread of their own and each handshake (TLS, then the ticket)
runs on a short-lived thread, bounded in number, so a slow or hostile peer never holds up the
event loop or the next consumer. The Fetch writes to the socket it is handed from worker
threads (producer_service/transports.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import ssl
import threading
from typing import Any

from kvpark.address import Address
from kvpark.tcp_frames import ACCEPTED, TICKET_BYTES, recv_exactly

from .logs import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

# Handshakes (TLS + ticket) in progress at once; more connections wait in the listen backlog.
MAX_HANDSHAKES = 64
HANDSHAKE_TIMEOUT_S = 5.0


class DataListener:
    def __init__(
        self,
        address: Address,
        *,
        tls: ssl.SSLContext | None,
        loop: asyncio.AbstractEventLoop,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self._address = address
        self._tls = tls
        self._loop = loop
        self._timeout = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # ticket -> the Fetch's future for its connection. Added by `expect`, removed by the
        # connection that presents the ticket or by `forget` when the Fetch ends.
        self._waiting: dict[bytes, asyncio.Future[socket.socket]] = {}
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._stopping = threading.Event()
        self.port = 0
        self.refused = 0  # connections closed without a valid ticket

    @property
    def tls(self) -> bool:
        return self._tls is not None

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self._address.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self._address.host, self._address.port))
        listener.listen(128)
        listener.settimeout(0.25)  # lets the accept thread see `stop`
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="kvpark-data", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._listener is not None:
            self._listener.close()
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

    # ---------------------------------------------------------------------------- threads
    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue
            self._handshakes.acquire()
            threading.Thread(
                target=self._handshake, args=(conn, peer), name="kvpark-data-hs", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(self._timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            ticket = bytearray(TICKET_BYTES)
            recv_exactly(conn, memoryview(ticket))
            with self._lock:
                future = self._waiting.pop(bytes(ticket), None)
            if future is None:
                raise ConnectionRefusedError("no Fetch waits for this ticket")
            conn.sendall(ACCEPTED)
            conn.settimeout(None)
            self._loop.call_soon_threadsafe(_deliver, future, conn)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.refused += 1
            log.debug("data connection from %s refused: %s", peer, exc)
            conn.close()
        finally:
            self._handshakes.release()


def _deliver(future: asyncio.Future[socket.socket], conn: socket.socket) -> None:
    if future.done():  # the Fetch gave up meanwhile
        conn.close()
    else:
        future.set_result(conn)


def _cancel(future: asyncio.Future[socket.socket]) -> None:
    if not future.done():
        future.cancel()
