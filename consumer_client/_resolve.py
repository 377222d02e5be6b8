"""Opening a data connection within the load's budget, name lookup included.

`socket.create_connection` resolves the host with `getaddrinfo`, which no timeout bounds: a DNS
server that is slow or drops a packet (resolv.conf's default is 5 s per try, two tries; cluster
DNS under load is known for exactly these 5 s stalls) would hold a load far past its deadline,
for the sync client on the caller's own thread. Here the lookup runs on a thread of its own
that the load waits for at most its connect budget. A lookup that takes longer goes on without
it, and its answer serves the loads after; answers are kept CACHE_S, so a burst of new
connections to one producer resolves once, and loads that ask meanwhile share the lookup in
flight; an answer none of whose addresses took a connection is dropped at once. An IP
address is never looked up.

`create_connection` also gives each address a name resolves to the whole timeout, so a host
with two addresses, the first one dead, could take twice the budget. Here the addresses share
what is left of it: each attempt gets an equal part of the remainder.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from kvpark.address import Address

# How long a host's addresses are used before they are looked up again: long enough that a
# burst of loads resolves once, short enough to follow a producer that moved (a pod
# rescheduled under the same DNS name).
CACHE_S = 30.0

AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, tuple[object, ...]]


class LookupTimedOut(TimeoutError):
    """The name lookup outlasted the load's budget. It says nothing about the path: the
    lookup goes on, and its answer serves the next load."""


_lock = threading.Lock()
_cache: dict[tuple[str, int], tuple[float, list[AddrInfo]]] = {}  # key: (expires, answer)
_in_flight: dict[tuple[str, int], Future[list[AddrInfo]]] = {}


def connect(address: Address, timeout_s: float) -> socket.socket:
    """A TCP connection to `address`, name lookup and every address tried within
    `timeout_s`. TimeoutError when that runs out; the OSError of the last attempt (or the
    lookup's socket.gaierror) when no address takes the connection."""
    deadline = time.monotonic() + timeout_s
    candidates = addresses(address, timeout_s)
    failure: OSError = OSError(f"{address.host} resolves to no address")
    for i, (family, kind, proto, sockaddr) in enumerate(candidates):
        left = deadline - time.monotonic()
        if left <= 0:
            failure = TimeoutError(f"connecting to {address} timed out")
            break
        sock = socket.socket(family, kind, proto)
        sock.settimeout(left / (len(candidates) - i))  # an equal part for each one left
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            failure = exc
            continue
        return sock
    # None of the addresses took it: the name may point elsewhere by now (a producer's pod
    # rescheduled under the same DNS name), so the next connection looks it up again.
    with _lock:
        _cache.pop((address.host, address.port), None)
    raise failure


def addresses(address: Address, timeout_s: float) -> list[AddrInfo]:
    """What `address` resolves to for a TCP connection, waited for at most `timeout_s`
    (TimeoutError); an IP address at once. The lookup's own failure (socket.gaierror), or an
    OSError when no thread could be started for it."""
    try:
        ip = ipaddress.ip_address(address.host)
    except ValueError:
        pass
    else:
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        sockaddr = (address.host, address.port) + ((0, 0) if ip.version == 6 else ())
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, sockaddr)]
    key = (address.host, address.port)
    with _lock:
        cached = _cache.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        lookup = _in_flight.get(key)
        if lookup is None:
            lookup = _in_flight[key] = Future()
            # A daemon thread, not an executor's: a lookup that never returns must not hold
            # up the process's exit.
            thread = threading.Thread(
                target=_look_up, args=(key, lookup), name="kvpark-resolve", daemon=True
            )
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had (a pids limit): a failed lookup
                del _in_flight[key]  # the next load asks again
                lookup.set_exception(OSError(f"looking up {address.host}: {exc}"))
    try:
        return lookup.result(timeout=max(0.0, timeout_s))
    except FutureTimeout:
        raise LookupTimedOut(
            f"looking up {address.host} took longer than {timeout_s:.3g}s"
        ) from None


def _look_up(key: tuple[str, int], lookup: Future[list[AddrInfo]]) -> None:
    host, port = key
    try:
        answer = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except BaseException as exc:  # a failed lookup is not kept: the next load asks again
        with _lock:
            _in_flight.pop(key, None)
        lookup.set_exception(exc)
        return
    found: list[AddrInfo] = [
        (family, kind, proto, tuple(sockaddr)) for family, kind, proto, _, sockaddr in answer
    ]
    now = time.monotonic()
    with _lock:
        _in_flight.pop(key, None)
        # Expired answers go as new ones come, so a client that meets many hosts (producers
        # that come and go) keeps only the ones it used lately.
        for old in [k for k, (expires, _) in _cache.items() if expires <= now]:
            del _cache[old]
        _cache[key] = (now + CACHE_S, found)
    lookup.set_result(found)
