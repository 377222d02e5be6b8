"""kvpark: KV-cache handoff for disaggregated LLM serving.

A prefill worker parks a request's KV on the producer next to it; a decode worker loads it,
verified, into its own buffer, or learns at once why not and recomputes. The public surface is
this module; everything else is private or lives in a submodule:

- `kvpark.producer`: the gRPC server (`kvpark-producer`, `python -m kvpark.producer`);
- `kvpark.client`: the clients' implementation and the `kvpark` command line;
- `kvpark.pb`: the stubs generated from `protos/kvpark/v1/kvpark.proto`.

docs/architecture.md maps the modules; docs/protocol.md is the contract.
"""

from __future__ import annotations

from .client import (
    USE_CLIENT_DEFAULT,
    AsyncConsumerPool,
    AsyncKVConsumer,
    AsyncKVParker,
    AuthError,
    BufferTooSmallError,
    ClientClosedError,
    ConsumerMetrics,
    ConsumerPool,
    IdStatus,
    KVConsumer,
    KVHandle,
    KVParker,
    KVParkError,
    LoadFailedError,
    LoadPath,
    LoadReport,
    LoadResult,
    ParkResult,
    ProducerInfo,
    ProtocolError,
    Reason,
    ReleaseResult,
    RequestRejectedError,
    RPCError,
    State,
    Timeout,
    TransportError,
    UsageError,
    fingerprint,
)
from .version import __version__

__all__ = [
    "USE_CLIENT_DEFAULT",
    "AsyncConsumerPool",
    "AsyncKVConsumer",
    "AsyncKVParker",
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
    "LoadFailedError",
    "LoadPath",
    "LoadReport",
    "LoadResult",
    "ParkResult",
    "ProducerInfo",
    "ProtocolError",
    "RPCError",
    "Reason",
    "ReleaseResult",
    "RequestRejectedError",
    "State",
    "Timeout",
    "TransportError",
    "UsageError",
    "__version__",
    "fingerprint",
]
