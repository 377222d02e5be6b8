"""A sync gRPC channel that refuses new calls once closed, for channels with interceptors.

grpc's sync interceptors build a fresh multicallable on the underlying channel for every call
they pass on, and grpc (1.85) crashes the whole process with a segmentation fault when a
multicallable is built on a closed channel. A client's close() can come while a call is still
starting: a background confirmation held up in an interceptor (an auth refresh, a retry's
back-off), or a keep-alive. This wrapper makes building one after close() raise the ValueError
grpc itself raises for a call on a closed channel, which the clients turn into
ClientClosedError; the lock keeps close() from landing in the middle of a build.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

CLOSED_MESSAGE = "Cannot invoke RPC on closed channel!"  # grpc's own words for the case


class GuardedChannel(grpc.Channel):  # type: ignore[misc]
    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._closed = False

    def _build(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ValueError(CLOSED_MESSAGE)
            return getattr(self._channel, kind)(*args, **kwargs)

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._build("unary_unary", *args, **kwargs)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._build("unary_stream", *args, **kwargs)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._build("stream_unary", *args, **kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._build("stream_stream", *args, **kwargs)

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        self._channel.subscribe(*args, **kwargs)

    def unsubscribe(self, *args: Any, **kwargs: Any) -> None:
        self._channel.unsubscribe(*args, **kwargs)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._channel.close()

    def __enter__(self) -> GuardedChannel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
