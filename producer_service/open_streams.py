"""A bound on the calls anyone may hold open on the services that need no token: health
`Watch`, server reflection, and health calls still waiting for their request.

Health and reflection stay open so that orchestrators and tools can probe a producer whose
kvpark methods need a token (kvpark.producer.auth). A unary health `Check` ends at once, but a
`Watch` or a reflection stream lasts as long as its caller likes, and every open call takes one
of grpc's concurrent-call slots. Those slots are `max_concurrent_rpcs`, kept for the kvpark
calls (kvpark.producer.call_limit), plus RESERVED_SLOTS for these services: unbounded, a peer
with no token could take the reserve and leave probes refused. So at most OPEN_STREAMS such
streams run at once, with or without tokens; more are refused RESOURCE_EXHAUSTED at once.

A handler that takes one request would start only once it arrived, so a caller that opens a
`Check` or a `Watch` and never sends its message would hold a slot unseen; such handlers are
started at once and wait a bounded time for their request
(kvpark.producer.first_message). A `Watch` counts as a stream from its start; a `Check` counts
only while it waits, against a limit of its own, so monitors' streams never refuse a probe, and
a probe, which sends its request at once, is refused only while others hold every waiting place
with calls that send nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .call_limit import CallLimit
from .first_message import read_first, started_at_once
from .servicer import SERVICE_NAME

OPEN_STREAMS = 16  # a few monitors and tools at once
REFUSED = f"too many open health and reflection streams (at most {OPEN_STREAMS})"
WAITING_REFUSED = f"too many health calls waiting for their request (at most {OPEN_STREAMS})"
# grpc's slots kept for these services above `max_concurrent_rpcs`: the open streams and the
# Checks waiting for their request, OPEN_STREAMS each, and as many again for calls that end as
# soon as they are answered (a probe's Check, a refusal on its way out, a kvpark call between
# its handler's end and its status), so a probe always finds a slot.
RESERVED_SLOTS = 3 * OPEN_STREAMS


class OpenStreams(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Bounds the calls of every service but kvpark's (those are call_limit's); runs on the
    server's event loop only."""

    def __init__(self, limit: int = OPEN_STREAMS) -> None:
        self.limit = limit
        self._streams = CallLimit(limit, REFUSED)
        self.waiting = 0  # unary health calls whose request has not come yet

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if details.method.lstrip("/").partition("/")[0] == SERVICE_NAME:
            return handler
        return self.bounded(handler)

    def bounded(self, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        """`handler` with its streaming behaviour counted against the limit; a unary one
        counted only while it waits for its request (no handler: an unknown method, as is)."""
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return started_at_once(handler, self._read_waiting)
        return self._streams.counted(handler)  # a Watch counted from its start, its wait too

    async def _read_waiting(self, context: Any) -> Any:
        # Apart from the streams, so that monitors' Watch streams never refuse a probe.
        if self.waiting >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, WAITING_REFUSED)
        self.waiting += 1
        try:
            return await read_first(context)
        finally:
            self.waiting -= 1
