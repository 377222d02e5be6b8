"""Handlers that take one request, run so that they start as soon as their call arrives.

grpc starts a handler that takes one request only once that request has arrived. Until then
the call holds one of grpc's `maximum_concurrent_rpcs` slots, yet no handler runs, so nothing
kvpark counts can see it: a caller that opens such calls and never sends their message (or
sends it slowly) would hold slots unseen, for as long as its connection lives. Calls whose
number is bounded (kvpark.producer.call_limit, kvpark.producer.open_streams) therefore run
such handlers as stream-request ones, which grpc starts at once, and read the request
themselves, waiting for it at most FIRST_MESSAGE_S. The wire is the same for every
cardinality, so the client sees no difference.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

# How long an open call may take to send its one request message. A client sends it together
# with the call's headers; even 1,000 ids of a Lookup are a few hundred KiB.
FIRST_MESSAGE_S = 5.0

# Reads a call's request from its context (`read_first`, or one that also counts the wait).
Read = Callable[[Any], Awaitable[Any]]


async def read_first(context: Any) -> Any:
    """The call's request message; the call is ended DEADLINE_EXCEEDED when none came within
    FIRST_MESSAGE_S (or the caller closed its side without one)."""
    try:
        async with asyncio.timeout(FIRST_MESSAGE_S):
            request = await context.read()
    except TimeoutError:
        request = None
    if request is None or request is grpc.aio.EOF:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"no request message within {FIRST_MESSAGE_S:g}s"
        )
    return request


def started_at_once(handler: grpc.RpcMethodHandler, read: Read = read_first) -> Any:
    """`handler` with a one-request behaviour run as a stream-request one that gets its request
    from `read(context)`; a stream-request handler as it is."""
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def call(_requests: Any, context: Any) -> Any:
            return await unary(await read(context), context)

        return handler._replace(request_streaming=True, unary_unary=None, stream_unary=call)
    if handler.unary_stream is not None:
        return handler._replace(
            request_streaming=True,
            unary_stream=None,
            stream_stream=_streaming(handler.unary_stream, read),
        )
    return handler


def _streaming(behaviour: Any, read: Read) -> Any:
    if inspect.isasyncgenfunction(behaviour):

        async def stream(_requests: Any, context: Any) -> AsyncIterator[Any]:
            request = await read(context)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def call(_requests: Any, context: Any) -> Any:  # writes with context.write
        return await behaviour(await read(context), context)

    return call
