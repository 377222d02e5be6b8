"""kvpark's clients: the decode side's consumers and the prefill side's parkers.

The public names are re-exported by `kvpark` itself (`from kvpark import KVConsumer, ...`); the
modules here are the implementation. A decode worker loads a request's KV into its own buffer
(one buffer, or one destination per chunk of a paged cache), verified chunk by chunk, or learns
at once why not and recomputes exactly what is missing:

    from kvpark import KVConsumer, Timeout

    with KVConsumer("prefill-7:50051", timeout=Timeout(20, first_chunk_s=2)) as client:
        report = client.load_or_recompute(
            kv_request_id, num_chunks=n, into=kv_buffer, expected_epoch=epoch,
            recompute=lambda first_missing: engine.prefill(request, from_chunk=first_missing),
        )
        report.path      # LoadPath.REMOTE / PARTIAL / RECOMPUTE
        report.reason    # None, or e.g. Reason.REAPED, Reason.TIMEOUT, Reason.UNAVAILABLE

`AsyncKVConsumer` has the same methods as coroutines (`aclose` for `close`); `KVParker` and
`AsyncKVParker` park (parker.py). A park's `ParkResult.handle` (a `KVHandle`) says where the
KV is; `ConsumerPool` / `AsyncConsumerPool` load by handle from whichever producer it names,
one client per producer; `ConsumerMetrics` counts a worker's loads for Prometheus.

Expected outcomes are values (`LoadResult`, `ParkResult`, `ReleaseResult`, `IdStatus`);
exceptions mean misuse, misconfiguration or, for the unary calls, a call that did not get
through:

    KVParkError
    ├── UsageError (also ValueError)               bad arguments: id, chunk ids, timeout, into
    │   └── BufferTooSmallError                    the chunks do not fit in `into`
    ├── ClientClosedError (also RuntimeError)      the client or pool was closed
    ├── RPCError                                   .code (grpc.StatusCode), .details
    │   ├── TransportError                         UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ...
    │   ├── RequestRejectedError                   INVALID_ARGUMENT, OUT_OF_RANGE
    │   ├── AuthError                              UNAUTHENTICATED, PERMISSION_DENIED
    │   └── ProtocolError                          UNIMPLEMENTED, INTERNAL, UNKNOWN, ...
    └── LoadFailedError                            load_or_recompute(policy="fail"); .result

`load` and `park` never raise TransportError: a call that did not get through is a result with
`Reason.UNAVAILABLE` / `TIMEOUT` / ... . `classify_status` is the one place that maps every
`grpc.StatusCode`.
"""

from __future__ import annotations

from kvpark.fingerprints import fingerprint

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
from ._models import IdStatus, ProducerInfo, ProducerStats, ReleaseResult, State
from ._park import ParkResult
from ._result import LoadPath, LoadReport, LoadResult, Reason
from ._sync import KVConsumer
from ._timeouts import USE_CLIENT_DEFAULT, Timeout
from .handle import KVHandle
from .keepalive import AsyncKeepAlive, KeepAlive, KeepAliveStatistics
from .metrics import ConsumerMetrics
from .parker import AsyncKVParker, AsyncParkBatch, KVParker, ParkBatch
from .pool import AsyncConsumerPool, ConsumerPool

__all__ = [
    "USE_CLIENT_DEFAULT",
    "AsyncConsumerPool",
    "AsyncKVConsumer",
    "AsyncKVParker",
    "AsyncKeepAlive",
    "AsyncParkBatch",
    "AuthError",
    "BufferTooSmallError",
    "ClientClosedError",
    "ConsumerMetrics",
    "ConsumerPool",
    "IdStatus",
    "KVConsumer",
    "KVHandle",
    "KVParkError",
    "KVParker",
    "KeepAlive",
    "KeepAliveStatistics",
    "LoadFailedError",
    "LoadPath",
    "LoadReport",
    "LoadResult",
    "ParkBatch",
    "ParkResult",
    "ProducerInfo",
    "ProducerStats",
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
    "fingerprint",
]
