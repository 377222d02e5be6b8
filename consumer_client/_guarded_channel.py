"""A sync gRPC channel that refuses new calls once closed, for channels with interceptors.

grpc's sync interceptors build a fresh multicallable on the underlying channel for every call
they pass on, and grpc (1.85) crashes the whole process with a segmentation fault when a
multicallable is built on a closed channel. A client's close() can come while a call is still
starting: a background confirmation held up in an interceptor (an auth refresh, a retry's
back-off), or a keep-alive. This wrapper makes building one after close() fail as a call the
close cancelled: an RpcError with status CANCELLED, which the clients already turn into
ClientClosedError (a park, a unary call) or a CANCELLED load or streamed batch. grpc's
interceptors hold an exception raised while a call is built and raise it when the call is
read (a stream's next message, a future's result), and a blocking unary call's interceptor
returns an RpcError as the call itself, then asks it for its result: so it is also a finished
call. The lock keeps close() from landing in the middle of a build.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

CLOSED_MESSAGE = "the client closed its channel"


class ChannelClosed(grpc.RpcError, grpc.Call, grpc.Future):  # type: ignore[misc]
    """A call built after close(): it ends as one that close() cancelled. grpc's interceptors
    hand an RpcError raised while building a call back as that call itself (then ask it for
    its result, or iterate it), so this is a finished, failed call as well as the error."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return CLOSED_MESSAGE

    def initial_metadata(self) -> None:
        return None

    def trailing_metadata(self) -> None:
        return None

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def add_callback(self, callback: Any) -> bool:
        return False  # the call has ended: a callback is never run

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def exception(self, timeout: float | None = None) -> BaseException:
        return self

    def traceback(self, timeout: float | None = None) -> Any:
        return self.__traceback__

    def add_done_callback(self, fn: Any) -> None:
        fn(self)

    def __iter__(self) -> ChannelClosed:
        return self

    def __next__(self) -> Any:
        raise self


class GuardedChannel(grpc.Channel):  # type: ignore[misc]
    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._closed = False

    def _build(self, kind: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._closed:
                raise ChannelClosed(CLOSED_MESSAGE)
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
