"""Data connections a client keeps between TCP loads, per producer data address.

A TCP load that ended with the producer's end frame leaves its connection idle at both ends
(kvpark.tcp_frames); the next load to that address sends its ticket on it instead of
connecting again. That spares each load after the first a connect, a TLS handshake (a few
round trips and the key exchange's CPU on both sides) and TCP's window ramp on a fresh
connection (~1.5 ms of an 8 MB load on loopback, docs/performance.md).

A connection is kept at most IDLE_S, well under the producer's 60 s, so the client is the one
that closes it and never sends a ticket into a connection the producer is closing. Every use
closes this client's connections idle that long, to any address, and at most once per
SWEEP_EVERY_S those of every other client in the process too: a pool's client of a producer
that left the fleet gets no loads of its own to do it. One the
producer closed anyway (it restarted, it hit its limit) shows as readable before use and is
dropped then; one that dies between that check and the ticket is the receiver's to retry on a
new connection (consumer_client/_tcp.py).
"""

from __future__ import annotations

import select
import socket
import threading
import time
import weakref
from collections.abc import Hashable

# How long a connection may sit idle here before it is closed instead of used.
IDLE_S = 30.0
# Kept connections per address: as many as loads to one producer usually run at once.
MAX_PER_ADDRESS = 64
# How often a use also closes the idle connections of every other client in the process.
SWEEP_EVERY_S = 1.0

# Every client's kept connections, and when they may be swept next (under _EVERY_LOCK).
_EVERY: weakref.WeakSet[DataConnections] = weakref.WeakSet()
_EVERY_LOCK = threading.Lock()
_next_sweep = 0.0


class DataConnections:
    """Idle data connections by address key; safe to use from any thread."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: dict[Hashable, list[tuple[socket.socket, float]]] = {}
        self._closed = False
        with _EVERY_LOCK:
            _EVERY.add(self)

    def take(self, key: Hashable) -> socket.socket | None:
        """The most recently kept connection to `key` that still looks usable, or None."""
        _sweep_others(self)
        while True:
            with self._lock:
                expired = self._expired()
                kept = self._idle.get(key)
                sock = kept.pop()[0] if kept else None
            for old in expired:
                old.close()
            if sock is None or _quiet(sock):
                return sock
            sock.close()

    def give(self, key: Hashable, sock: socket.socket) -> None:
        """Keeps `sock`, idle at a frame boundary, for the next load to `key`."""
        _sweep_others(self)
        with self._lock:
            expired = self._expired()
            kept = self._idle.setdefault(key, [])
            if self._closed or len(kept) >= MAX_PER_ADDRESS:
                expired.append(sock)
            else:
                kept.append((sock, time.monotonic()))
        for old in expired:
            old.close()

    def _expired(self) -> list[socket.socket]:
        """Takes the connections idle for IDLE_S out (under the lock), to every address, not
        only the one in use: a burst's extra connections, and those to a producer this
        client no longer loads from (it left the fleet, it was replaced), are closed by the
        client rather than left half-closed once the producer closed its end. Each list is
        oldest first, so this looks at one connection per address still in use."""
        now, expired = time.monotonic(), []
        for key, kept in list(self._idle.items()):
            while kept and now - kept[0][1] >= self._idle_s:
                expired.append(kept.pop(0)[0])
            if not kept:
                del self._idle[key]
        return expired

    def close_expired(self) -> None:
        with self._lock:
            expired = self._expired()
        for old in expired:
            old.close()

    def idle(self, key: Hashable) -> int:
        with self._lock:
            return len(self._idle.get(key, ()))

    def close(self) -> None:
        """Closes every kept connection; later ones are closed as they are given."""
        with self._lock:
            self._closed = True
            kept, self._idle = self._idle, {}
        for connections in kept.values():
            for sock, _ in connections:
                sock.close()


def _sweep_others(me: DataConnections) -> None:
    """Closes the expired connections of every client but `me`, at most once per
    SWEEP_EVERY_S however many loads run (a pool may hold hundreds of clients)."""
    global _next_sweep
    with _EVERY_LOCK:
        now = time.monotonic()
        if now < _next_sweep:
            return
        _next_sweep = now + SWEEP_EVERY_S
        others = [pool for pool in _EVERY if pool is not me]
    for other in others:
        other.close_expired()


def _quiet(sock: socket.socket) -> bool:
    """Whether an idle connection is open and has nothing to read: the producer sends nothing
    between transfers, so anything readable is its close (or a reset)."""
    if sock.fileno() < 0:
        return False
    poller = select.poll()  # not select(): descriptors above 1023 are common in a server
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)
