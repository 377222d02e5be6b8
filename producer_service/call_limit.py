"""A bound on calls running at once, counted by kvpark itself: how `max_concurrent_rpcs` is
enforced on the kvpark service.

grpc's own `maximum_concurrent_rpcs` counts every call on the server, health and reflection
included. Legitimate kvpark calls can hold a slot for long (a Fetch waits up to
`max_fetch_wait_s` for its chunks, or writes to a consumer that stopped reading until
`fetch_stall_timeout_s`), so with grpc's cap alone a busy producer refuses its own health
`Check` RESOURCE_EXHAUSTED, and a liveness probe restarts a producer that answers — which draws
a new epoch and loses every parked id. So the kvpark methods are counted here, each call from
the moment its handler starts until it ends (a streaming one for its whole stream, however it
ends: done, error, cancel or deadline), and the call beyond the limit is refused
RESOURCE_EXHAUSTED at once; grpc's cap is set higher by what health and reflection may take
(kvpark.producer.open_streams), so a probe always finds a slot.

Handlers that take one request are started at once (kvpark.producer.first_message), so the wait
for the request counts too: no call holds a grpc slot without being counted here.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

from .first_message import started_at_once


class CallLimit:
    """Counts the calls of the handlers it wraps; runs on the server's event loop only."""

    def __init__(self, limit: int, refused: str) -> None:
        self.limit = limit
        self.refused = refused  # the RESOURCE_EXHAUSTED message of a call beyond the limit
        self.running = 0

    def service(self, handlers: grpc.GenericRpcHandler) -> grpc.GenericRpcHandler:
        """`handlers` (a service's method table) with every call of theirs counted."""
        return _CountedService(self, handlers)

    def counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler`, started at once, with its calls counted against the limit."""
        handler = started_at_once(handler)
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._counted(handler.stream_unary))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._counted(handler.stream_stream))
        return handler

    def _counted(self, behaviour: Any) -> Any:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
                await self._enter(context)
                try:
                    async for response in behaviour(requests, context):
                        yield response
                finally:
                    self.running -= 1

            return stream

        async def call(requests: Any, context: Any) -> Any:  # or a stream written with write
            await self._enter(context)
            try:
                return await behaviour(requests, context)
            finally:
                self.running -= 1

        return call

    async def _enter(self, context: Any) -> None:
        if self.running >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.refused)
        self.running += 1


class _CountedService(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generic handler whose method handlers are counted by `limit`. Each method's wrapped
    handler is built once (its behaviours hold no state of a call); an unknown method is
    answered None, and not remembered, so a caller cannot grow the table."""

    def __init__(self, limit: CallLimit, handlers: grpc.GenericRpcHandler) -> None:
        self._limit = limit
        self._handlers = handlers
        self._counted: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        counted = self._counted.get(details.method)
        if counted is None:
            handler = self._handlers.service(details)
            if handler is None:
                return None
            counted = self._counted[details.method] = self._limit.counted(handler)
        return counted
