"""kvpark consumer client: load a request's KV from a producer, or learn fast why not.

A decode worker imports this to fetch the KV chunks a prefill worker parked on a kvpark
producer, straight into its own buffer, under a load timeout, with every chunk's CRC32C
verified, and to fall back to local recompute of exactly what is missing (spec §5):

    from kvpark.client import KVConsumer, Timeout

    with KVConsumer("prefill-7:50051", timeout=Timeout(20, first_chunk_s=2)) as client:
        report = client.load_or_recompute(
            kv_request_id, num_chunks=n, into=kv_buffer, expected_epoch=epoch,
            recompute=lambda first_missing: engine.prefill(request, from_chunk=first_missing),
        )
        report.path      # LoadPath.REMOTE / PARTIAL / RECOMPUTE
        report.reason    # None, or e.g. Reason.REAPED, Reason.TIMEOUT, Reason.UNAVAILABLE

`AsyncKVConsumer` has the same methods as coroutines (`aclose` for `close`), and
`ConsumerRegistry` / `AsyncConsumerRegistry` keep one client per producer target.

Expected outcomes are values (`LoadResult`, `ReleaseResult`, `IdStatus`); exceptions mean
misuse, misconfiguration or, for the unary calls, a call that did not get through:

    KVParkError
    ├── UsageError (also ValueError, TypeError)    bad arguments: id, chunk ids, timeout, into
    │   └── BufferTooSmallError                    the chunks do not fit in `into`
    ├── ClientClosedError (also RuntimeError)      the client or registry was closed
    ├── RPCError                                   .code (grpc.StatusCode), .details
    │   ├── TransportError                         UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ...
    │   ├── RequestRejectedError                   INVALID_ARGUMENT, OUT_OF_RANGE
    │   ├── AuthError                              UNAUTHENTICATED, PERMISSION_DENIED
    │   └── ProtocolError                          UNIMPLEMENTED, INTERNAL, UNKNOWN, ...
    └── LoadFailedError                            load_or_recompute(fallback="raise"); .result

`load` never raises TransportError: a load that did not get through is a `LoadResult` with
`Reason.UNAVAILABLE` / `TIMEOUT` / ... . `classify_status` is the one place that maps every
`grpc.StatusCode`.
"""

from __future__ import annotations

from kvpark.alloc import tune_allocator

from ._async import AsyncKVConsumer
from ._core import TimeoutConfigWarning
from ._errors import (
    AuthError,
    BufferTooSmallError,
    ClientClosedError,
    KVParkError,
    LoadFailedError,
    ProtocolError,
    RequestRejectedError,
    RPCError,
    StatusRule,
    TransportError,
    UsageError,
    classify_status,
)
from ._models import IdStatus, ProducerInfo, ReleaseResult, State
from ._result import LoadPath, LoadReport, LoadResult, Reason
from ._sync import KVConsumer
from ._timeouts import Timeout
from .keepalive import AsyncKeepAlive, KeepAlive, KeepAliveStatistics
from .registry import AsyncConsumerRegistry, ConsumerRegistry

__all__ = [
    "AsyncConsumerRegistry",
    "AsyncKVConsumer",
    "AsyncKeepAlive",
    "AuthError",
    "BufferTooSmallError",
    "ClientClosedError",
    "ConsumerRegistry",
    "IdStatus",
    "KVConsumer",
    "KVParkError",
    "KeepAlive",
    "KeepAliveStatistics",
    "LoadFailedError",
    "LoadPath",
    "LoadReport",
    "LoadResult",
    "ProducerInfo",
    "ProtocolError",
    "RPCError",
    "Reason",
    "ReleaseResult",
    "RequestRejectedError",
    "State",
    "StatusRule",
    "Timeout",
    "TimeoutConfigWarning",
    "TransportError",
    "UsageError",
    "classify_status",
    "tune_allocator",
]
