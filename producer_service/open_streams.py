"""A bound on the streams anyone may hold open without a token: health `Watch` and server
reflection.

Health and reflection stay open so that orchestrators and tools can probe a producer whose
kvpark methods need a token (kvpark.producer.auth). A unary health `Check` ends at once, but a
`Watch` or a reflection stream lasts as long as its caller likes, and every open call takes
one of the server's `max_concurrent_rpcs`: a peer with no token could hold them all and leave
Park and Fetch refused RESOURCE_EXHAUSTED for everyone. So at most OPEN_STREAMS such streams
run at once; more are refused RESOURCE_EXHAUSTED at once, and probes (unary `Check`) are
never refused.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

OPEN_STREAMS = 16  # a few monitors and tools at once; far below max_concurrent_rpcs
REFUSED = f"too many open health and reflection streams (at most {OPEN_STREAMS})"


class OpenStreams:
    """Counts the open-service streams running; runs on the server's event loop only."""

    def __init__(self, limit: int = OPEN_STREAMS) -> None:
        self.limit = limit
        self.running = 0

    def bounded(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """`handler` with its streaming behaviour counted against the limit; unary calls
        (and no handler: an unknown method) as they are."""
        if handler is None:
            return None
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._counted(handler.unary_stream))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._counted(handler.stream_stream))
        return handler

    def _counted(self, behaviour: Any) -> Any:
        if inspect.isasyncgenfunction(behaviour):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await self._enter(context)
                try:
                    async for response in behaviour(request, context):
                        yield response
                finally:
                    self.running -= 1

            return stream

        async def call(request: Any, context: Any) -> Any:  # writes with context.write
            await self._enter(context)
            try:
                return await behaviour(request, context)
            finally:
                self.running -= 1

        return call

    async def _enter(self, context: Any) -> None:
        if self.running >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSED)
        self.running += 1
