"""Consumer pools: one client per producer, for decode workers that load from a fleet.

A decode worker learns where each request's KV is from the request itself (a `KVHandle`, or
its dict from the router). The pool keeps one client — one channel — per producer address,
created on first use with the pool's settings (timeout, token, credentials, transport,
metrics...), and loads by handle with the producer's epoch checked:

    with ConsumerPool(timeout=Timeout(20), token=fetch_token) as pool:
        report = pool.load_or_recompute(handle, into=cache, recompute=engine.prefill_from)

The table `_clients: address -> _Entry` is filled on first use of an address; it holds at most
`max_producers` clients (the least recently used idle one is closed to make room) and closes a
client idle for `idle_close_s` the next time the pool is used, so a fleet whose prefill nodes
come and go does not leak channels. A client in use by a load, or handed out by `client()`, is
never closed under its user.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._async import AsyncKVConsumer
from ._core import T
from ._errors import ClientClosedError, UsageError
from ._result import LoadReport, LoadResult, Policy
from ._session import OnChunk
from ._sync import KVConsumer
from ._timeouts import USE_CLIENT_DEFAULT, TimeoutArg
from .handle import KVHandle

C = TypeVar("C", KVConsumer, AsyncKVConsumer)
DEFAULT_MAX_PRODUCERS = 64
DEFAULT_IDLE_CLOSE_S = 300.0
Handle = KVHandle | Mapping[str, Any] | str
# What the pool's argument check builds its client for: the address is only dialed on a call.
_ANY_TARGET = "localhost:1"


def _what(handle: KVHandle, chunk_ids: Iterable[int] | None = None) -> dict[str, Any]:
    """The load arguments a handle fixes: its chunks (or `chunk_ids`) and its epoch."""
    if chunk_ids is not None:
        return {"chunk_ids": chunk_ids, "expected_epoch": handle.producer_epoch}
    return {"num_chunks": handle.num_chunks or None, "expected_epoch": handle.producer_epoch}


def _close_all(clients: list[KVConsumer]) -> None:
    for client in clients:
        client.close()


def _check_client_args(factory: Callable[..., C], client_args: dict[str, Any]) -> None:
    """UsageError now, at the pool's construction, for arguments every client it creates
    would refuse: a client is built with them and dropped. Building one opens nothing (its
    channel opens on first use), so there is nothing to close."""
    try:
        inspect.signature(factory).bind(_ANY_TARGET, **client_args)
    except TypeError as exc:  # a keyword the clients do not take
        raise UsageError(f"{factory.__name__} arguments: {exc}") from None
    factory(_ANY_TARGET, **client_args)


@dataclass(slots=True)
class _Entry(Generic[C]):
    client: C
    last_used: float
    in_use: int = 0
    # Handed out by `client()` for the caller to keep (a keep-alive loop, say): never closed
    # for idleness or room, only by `drop()` or the pool's close.
    pinned: bool = False

    @property
    def closable(self) -> bool:
        return self.in_use == 0 and not self.pinned


class _Pool(Generic[C]):
    def __init__(
        self,
        factory: Callable[..., C],
        client_args: dict[str, Any],
        max_producers: int,
        idle_close_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_producers, bool) or not isinstance(max_producers, int):
            raise UsageError(f"max_producers: expected an int >= 1, got {max_producers!r}")
        if isinstance(idle_close_s, bool) or not isinstance(idle_close_s, int | float):
            raise UsageError(f"idle_close_s: expected seconds > 0, got {idle_close_s!r}")
        if max_producers < 1 or not idle_close_s > 0:
            raise UsageError("max_producers must be >= 1 and idle_close_s > 0")
        _check_client_args(factory, client_args)
        self._factory: Callable[..., C] = factory
        self._client_args = client_args
        self._max = max_producers
        self._idle_close_s = idle_close_s
        self._clock = clock
        self._clients: OrderedDict[str, _Entry[C]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def _acquire(self, address: str, *, pin: bool = False) -> tuple[_Entry[C], list[C]]:
        """The entry for `address`, marked in use, and the clients to close (idle or evicted),
        to be closed outside the lock."""
        now = self._clock()
        with self._lock:
            if self._closed:
                raise ClientClosedError("the kvpark consumer pool is closed")
            doomed = [
                address_
                for address_, e in self._clients.items()
                if e.closable and now - e.last_used > self._idle_close_s and address_ != address
            ]
            entry = self._clients.get(address)
            if entry is None or entry.client.closed:
                entry = _Entry(self._factory(address, **self._client_args), now)
                self._clients[address] = entry
            self._clients.move_to_end(address)
            entry.in_use += 1
            entry.pinned |= pin
            entry.last_used = now
            idle = [a for a, e in self._clients.items() if e.closable and a not in doomed]
            while len(self._clients) - len(doomed) > self._max and idle:
                doomed.append(idle.pop(0))  # least recently used first
            closing = [self._clients.pop(a).client for a in doomed]
            return entry, closing

    def _release(self, entry: _Entry[C]) -> None:
        with self._lock:
            entry.in_use -= 1
            entry.last_used = self._clock()

    def _take(self, address: str) -> C | None:
        with self._lock:
            entry = self._clients.pop(address, None)
        return None if entry is None else entry.client

    def _take_all(self) -> list[C]:
        with self._lock:
            self._closed = True
            clients = [e.client for e in self._clients.values()]
            self._clients.clear()
        return clients

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def __contains__(self, address: object) -> bool:
        with self._lock:
            return address in self._clients

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._clients)


class ConsumerPool(_Pool[KVConsumer]):
    """`KVConsumer`s keyed by producer address, closed together. Thread-safe. Keyword
    arguments besides the bounds and `clock` (the time idleness is measured in) go to every
    `KVConsumer` it creates."""

    def __init__(
        self,
        *,
        max_producers: int = DEFAULT_MAX_PRODUCERS,
        idle_close_s: float = DEFAULT_IDLE_CLOSE_S,
        clock: Callable[[], float] = time.monotonic,
        **client_args: Any,
    ) -> None:
        super().__init__(KVConsumer, client_args, max_producers, idle_close_s, clock)

    def _checked_out(
        self, address: str, *, pin: bool = False
    ) -> tuple[_Entry[KVConsumer], KVConsumer]:
        entry, closing = self._acquire(address, pin=pin)
        if closing:
            # Closing flushes confirmations (up to a few seconds): not on this load's path.
            threading.Thread(target=_close_all, args=(closing,), daemon=True).start()
        return entry, entry.client

    def load(
        self,
        handle: Handle,
        *,
        into: Any = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
        chunk_ids: Iterable[int] | None = None,
    ) -> LoadResult:
        """Loads the KV a handle names (all its chunks, or `chunk_ids`) from its producer."""
        h = KVHandle.coerce(handle)
        entry, client = self._checked_out(h.producer)
        try:
            return client.load(
                h.kv_request_id,
                **_what(h, chunk_ids),
                into=into,
                timeout=timeout,
                wait_timeout_s=wait_timeout_s,
                on_chunk=on_chunk,
                fingerprint=fingerprint,
            )
        finally:
            self._release(entry)

    def load_or_recompute(
        self,
        handle: Handle,
        *,
        recompute: Callable[[int], T] | None = None,
        policy: Policy = "recompute",
        into: Any = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
    ) -> LoadReport[T]:
        """`KVConsumer.load_or_recompute` for the request a handle names."""
        h = KVHandle.coerce(handle)
        entry, client = self._checked_out(h.producer)
        try:
            return client.load_or_recompute(
                h.kv_request_id,
                **_what(h),
                recompute=recompute,
                policy=policy,
                into=into,
                timeout=timeout,
                wait_timeout_s=wait_timeout_s,
                on_chunk=on_chunk,
                fingerprint=fingerprint,
            )
        finally:
            self._release(entry)

    def client(self, address: str) -> KVConsumer:
        """The client for a producer address, created on first use, for the caller to keep
        (its unary calls, a keep-alive loop): it stays open until `drop(address)` or the
        pool's close, however idle, and does not count against `max_producers`' evictions."""
        entry, client = self._checked_out(address, pin=True)
        self._release(entry)
        return client

    def drop(self, address: str) -> None:
        """Closes the client for a producer gone for good (a no-op for an unknown address)."""
        client = self._take(address)
        if client is not None:
            client.close()

    def close(self) -> None:
        for client in self._take_all():
            client.close()

    def __enter__(self) -> ConsumerPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()


class AsyncConsumerPool(_Pool[AsyncKVConsumer]):
    """`AsyncKVConsumer`s keyed by producer address, closed together."""

    def __init__(
        self,
        *,
        max_producers: int = DEFAULT_MAX_PRODUCERS,
        idle_close_s: float = DEFAULT_IDLE_CLOSE_S,
        clock: Callable[[], float] = time.monotonic,
        **client_args: Any,
    ) -> None:
        super().__init__(AsyncKVConsumer, client_args, max_producers, idle_close_s, clock)
        self._closing: set[asyncio.Task[None]] = set()

    def _checked_out(
        self, address: str, *, pin: bool = False
    ) -> tuple[_Entry[AsyncKVConsumer], AsyncKVConsumer]:
        entry, closing = self._acquire(address, pin=pin)
        for client in closing:
            # Not awaited on this load's path (closing flushes confirmations), and nothing
            # between the acquire and the caller's try/finally can be cancelled.
            task = asyncio.get_running_loop().create_task(client.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return entry, entry.client

    async def load(
        self,
        handle: Handle,
        *,
        into: Any = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
        chunk_ids: Iterable[int] | None = None,
    ) -> LoadResult:
        """As `ConsumerPool.load`."""
        h = KVHandle.coerce(handle)
        entry, client = self._checked_out(h.producer)
        try:
            return await client.load(
                h.kv_request_id,
                **_what(h, chunk_ids),
                into=into,
                timeout=timeout,
                wait_timeout_s=wait_timeout_s,
                on_chunk=on_chunk,
                fingerprint=fingerprint,
            )
        finally:
            self._release(entry)

    async def load_or_recompute(
        self,
        handle: Handle,
        *,
        recompute: Callable[[int], T] | None = None,
        policy: Policy = "recompute",
        into: Any = None,
        timeout: TimeoutArg = USE_CLIENT_DEFAULT,
        wait_timeout_s: float = 0.0,
        on_chunk: OnChunk | None = None,
        fingerprint: bytes | None = None,
    ) -> LoadReport[T]:
        """As `ConsumerPool.load_or_recompute`."""
        h = KVHandle.coerce(handle)
        entry, client = self._checked_out(h.producer)
        try:
            return await client.load_or_recompute(
                h.kv_request_id,
                **_what(h),
                recompute=recompute,
                policy=policy,
                into=into,
                timeout=timeout,
                wait_timeout_s=wait_timeout_s,
                on_chunk=on_chunk,
                fingerprint=fingerprint,
            )
        finally:
            self._release(entry)

    async def client(self, address: str) -> AsyncKVConsumer:
        """As `ConsumerPool.client`."""
        entry, client = self._checked_out(address, pin=True)
        self._release(entry)
        return client

    async def drop(self, address: str) -> None:
        """As `ConsumerPool.drop`."""
        client = self._take(address)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        for client in self._take_all():
            await client.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> AsyncConsumerPool:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()
