"""Registries: one client per producer target, for decode workers that talk to many producers.

A decode worker learns each request's producer from the router (`target`, often one per prefill
node). The registry hands out one client per target, created on first use with the shared
settings (timeout, token, credentials, options), so every producer gets exactly one channel,
and `close()` / `aclose()` closes them all together.

    with ConsumerRegistry(timeout=Timeout(20)) as producers:
        result = producers[target].load(kid, num_chunks=n, into=buf)

The table `_clients: target -> client` is filled by `get()` and emptied only by closing the
registry; a worker that sees producers come and go for good can `drop(target)` one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._async import AsyncKVConsumer
from ._errors import ClientClosedError
from ._sync import KVConsumer

C = TypeVar("C", KVConsumer, AsyncKVConsumer)


class _Registry(Generic[C]):
    def __init__(self, factory: Callable[..., C], client_args: dict[str, Any]) -> None:
        self._factory: Callable[..., C] = factory
        self._client_args = client_args
        self._clients: dict[str, C] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, target: str) -> C:
        """The client for `target`, created on first use."""
        with self._lock:
            if self._closed:
                raise ClientClosedError("the kvpark client registry is closed")
            client = self._clients.get(target)
            if client is None or client.closed:
                client = self._factory(target, **self._client_args)
                self._clients[target] = client
            return client

    __getitem__ = get

    def __contains__(self, target: object) -> bool:
        return target in self._clients

    def __len__(self) -> int:
        return len(self._clients)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._clients))

    @property
    def closed(self) -> bool:
        return self._closed

    def _take_all(self) -> list[C]:
        with self._lock:
            self._closed = True
            clients = list(self._clients.values())
            self._clients.clear()
        return clients

    def _take(self, target: str) -> C | None:
        with self._lock:
            return self._clients.pop(target, None)


class ConsumerRegistry(_Registry[KVConsumer]):
    """`KVConsumer`s keyed by target, closed together. Thread-safe.

    Keyword arguments are passed to every `KVConsumer` it creates."""

    def __init__(self, **client_args: Any) -> None:
        super().__init__(KVConsumer, client_args)

    def drop(self, target: str) -> None:
        """Closes and forgets one target's client."""
        client = self._take(target)
        if client is not None:
            client.close()

    def close(self) -> None:
        for client in self._take_all():
            client.close()

    def __enter__(self) -> ConsumerRegistry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()


class AsyncConsumerRegistry(_Registry[AsyncKVConsumer]):
    """`AsyncKVConsumer`s keyed by target, closed together.

    Keyword arguments are passed to every `AsyncKVConsumer` it creates."""

    def __init__(self, **client_args: Any) -> None:
        super().__init__(AsyncKVConsumer, client_args)

    async def drop(self, target: str) -> None:
        """Closes and forgets one target's client."""
        client = self._take(target)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        for client in self._take_all():
            await client.aclose()

    async def __aenter__(self) -> AsyncConsumerRegistry:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        await self.aclose()
