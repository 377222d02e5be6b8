"""A bound on the calls anyone may hold open without a token: health `Watch`, server
reflection, and health calls still waiting for their request.

Health and reflection stay open so that orchestrators and tools can probe a producer whose
kvpark methods need a token (kvpark.producer.auth). A unary health `Check` ends at once, but a
`Watch` or a reflection stream lasts as long as its caller likes, and every open call takes
one of the server's `max_concurrent_rpcs`: a peer with no token could hold them all and leave
Park and Fetch refused RESOURCE_EXHAUSTED for everyone. So at most OPEN_STREAMS such streams
run at once; more are refused RESOURCE_EXHAUSTED at once.

grpc starts a handler that takes one request only once that request arrived, so a caller
that opens a `Check` or a `Watch` and never sends its message would hold a slot unseen. Such
handlers are therefore run as stream-request ones that start at once, and the wait for the
request lasts at most FIRST_MESSAGE_S. A `Watch` counts as a stream from its start; a `Check`
counts only while it waits, against a limit of its own, so monitors' streams never refuse a
probe, and a probe, which sends its request at once, is refused only while others hold every
waiting place with calls that send nothing.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

OPEN_STREAMS = 16  # a few monitors and tools at once; far below max_concurrent_rpcs
REFUSED = f"too many open health and reflection streams (at most {OPEN_STREAMS})"
WAITING_REFUSED = f"too many health calls waiting for their request (at most {OPEN_STREAMS})"
# How long an open call may take to send its one request message.
FIRST_MESSAGE_S = 5.0


class OpenStreams:
    """Counts the open-service streams running; runs on the server's event loop only."""

    def __init__(self, limit: int = OPEN_STREAMS) -> None:
        self.limit = limit
        self.running = 0
        self.waiting = 0  # unary health calls whose request has not come yet

    def bounded(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """`handler` with its streaming behaviour counted against the limit; unary calls
        (and no handler: an unknown method) as they are."""
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return handler._replace(
                request_streaming=True,
                unary_unary=None,
                stream_unary=self._request_first(handler.unary_unary),
            )
        if handler.unary_stream is not None:
            return handler._replace(
                request_streaming=True,
                unary_stream=None,
                # Counted for its whole life, the wait for its request included.
                stream_stream=self._counted(self._request_first(handler.unary_stream, False)),
            )
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=self._counted(handler.stream_stream))
        return handler

    def _request_first(self, behaviour: Any, count_wait: bool = True) -> Any:
        """`behaviour` (one request) as a stream-request behaviour: its request read first,
        the wait bounded by FIRST_MESSAGE_S and (`count_wait`) counted against the limit."""

        async def request_of(context: Any) -> Any:
            if count_wait:
                # Apart from the streams, so that monitors' Watch streams never refuse a probe.
                if self.waiting >= self.limit:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, WAITING_REFUSED)
                self.waiting += 1
            try:
                async with asyncio.timeout(FIRST_MESSAGE_S):
                    request = await context.read()
            except TimeoutError:
                request = None
            finally:
                if count_wait:
                    self.waiting -= 1
            if request is None or request is grpc.aio.EOF:
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no request message within {FIRST_MESSAGE_S:g}s",
                )
            return request

        if inspect.isasyncgenfunction(behaviour):

            async def stream(_requests: Any, context: Any) -> AsyncIterator[Any]:
                request = await request_of(context)
                async for response in behaviour(request, context):
                    yield response

            return stream

        async def call(_requests: Any, context: Any) -> Any:
            return await behaviour(await request_of(context), context)

        return call

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
