"""The client's exceptions and THE one mapping from gRPC status codes to them.

Loads report expected failures as values (`LoadResult.reason`); unary calls (`server_info`,
`lookup`, `extend_leases`, `release`) raise. Both consult `classify_status`, the only place
that knows what a `grpc.StatusCode` means for kvpark; its table names every member of
`grpc.StatusCode` explicitly and a test iterates over the enum to prove it.

The rule that sorts codes: a status that says *this call* did not get through (transport down,
deadline, overload) ends a load with a reason, so the engine recomputes; a status that says
*the caller or its configuration is wrong* (malformed request, bad or missing token, not a
kvpark producer) raises even from `load`, because recomputing every request would hide a bug
that makes the whole KV tier useless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from ._result import LoadResult, Reason


class KVParkError(Exception):
    """Base of every exception the client raises."""


class UsageError(KVParkError, ValueError):
    """Misuse: bad arguments (id, chunk ids, timeout, buffer). Also a ValueError."""


class BufferTooSmallError(UsageError):
    """The producer's chunks do not fit in the caller's `into` buffer, or a chunk does not
    exactly fill a destination given as several buffers (it was sized for KV of another shape:
    a bug or a prefill/decode configuration mismatch, so it is raised rather than silently
    recomputed). The Fetch is cancelled and the delivery is not confirmed, so the
    producer keeps the bytes: the id goes back to where it was (PARKED with its lease, or
    DELIVERED with its grace), or, if every chunk had been sent, stays DELIVERED for
    `delivery_grace_s`; either way a retry with a larger buffer can load it meanwhile.
    `chunks_loaded` chunks (`bytes_loaded` bytes) had landed, verified, at the start of `into`."""

    def __init__(self, message: str, *, needed: int, available: int, chunks_loaded: int,
                 bytes_loaded: int) -> None:  # fmt: skip
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.chunks_loaded = chunks_loaded
        self.bytes_loaded = bytes_loaded


class ClientClosedError(KVParkError, RuntimeError):
    """A call on a client (or registry, or keep-alive) that was closed."""


class RPCError(KVParkError):
    """A call that the producer or the transport did not complete. `code` is the gRPC status,
    `details` its message."""

    def __init__(self, message: str, *, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class TransportError(RPCError):
    """The call did not get through: unreachable, deadline, cancelled, overloaded. Retry later
    or elsewhere."""


class RequestRejectedError(RPCError):
    """The producer called the request malformed (INVALID_ARGUMENT, OUT_OF_RANGE): a bug in
    the caller, e.g. chunk ids beyond the id's total_chunks."""


class AuthError(RPCError):
    """UNAUTHENTICATED (missing or unknown token) or PERMISSION_DENIED (the other role's
    token): a deployment configuration problem."""


class ProtocolError(RPCError):
    """The peer is not a kvpark producer this client understands, or it broke the contract
    (UNIMPLEMENTED, INTERNAL, UNKNOWN, DATA_LOSS, ...)."""


class LoadFailedError(KVParkError):
    """`load_or_recompute(policy="fail")` and the load failed; `result` says how."""

    def __init__(self, result: LoadResult) -> None:
        super().__init__(
            f"load of {result.kv_request_id!r} failed: {result.reason} "
            f"({result.chunks_loaded} chunks loaded){': ' + result.detail if result.detail else ''}"
        )
        self.result = result


@dataclass(frozen=True, slots=True)
class StatusRule:
    """What one gRPC status code means to kvpark."""

    code: grpc.StatusCode
    # The reason a load ends with; None = the status means misuse and `load` raises `error`.
    load_reason: Reason | None
    # The exception a unary call raises (and `load` too when load_reason is None).
    error: type[RPCError]


_S = grpc.StatusCode
# Every member of grpc.StatusCode, explicitly (a test iterates over the enum).
_TABLE: dict[grpc.StatusCode, tuple[Reason | None, type[RPCError]]] = {
    # Not an error; seen here only if something reported success as a failure.
    _S.OK: (Reason.PROTOCOL_ERROR, ProtocolError),
    # Our own cancel (timeout) is decided before this table; anything else that cancels (the
    # channel closing, the peer resetting the stream) ends the load.
    _S.CANCELLED: (Reason.CANCELLED, TransportError),
    # A producer handler crashed, or a proxy answered something unparseable.
    _S.UNKNOWN: (Reason.RPC_ERROR, ProtocolError),
    # Malformed request: bad id, chunk id out of range (docs/protocol.md, Outcomes). A caller
    # bug: raise.
    _S.INVALID_ARGUMENT: (None, RequestRejectedError),
    # The gRPC deadline (our total load timeout) passed.
    _S.DEADLINE_EXCEEDED: (Reason.TIMEOUT, TransportError),
    # kvpark answers in-band; these come from proxies or a foreign server.
    _S.NOT_FOUND: (Reason.RPC_ERROR, ProtocolError),
    _S.ALREADY_EXISTS: (Reason.RPC_ERROR, ProtocolError),
    # A valid token of the other role (docs/protocol.md, Roles): configuration, raise.
    _S.PERMISSION_DENIED: (None, AuthError),
    # A message over our receive limit, or a producer/proxy shedding load.
    _S.RESOURCE_EXHAUSTED: (Reason.RPC_ERROR, TransportError),
    _S.FAILED_PRECONDITION: (Reason.RPC_ERROR, ProtocolError),
    # Concurrency conflict in some proxy: retryable.
    _S.ABORTED: (Reason.RPC_ERROR, TransportError),
    # Like INVALID_ARGUMENT for ranges: a caller bug.
    _S.OUT_OF_RANGE: (None, RequestRejectedError),
    # The target is not a kvpark.v1 producer (wrong port, wrong version): configuration, raise.
    _S.UNIMPLEMENTED: (None, ProtocolError),
    # The transport broke something (e.g. a frame it could not decode) or a handler crashed.
    _S.INTERNAL: (Reason.RPC_ERROR, ProtocolError),
    # Connection refused, reset, peer gone (SIGKILL), keepalive ping unanswered.
    _S.UNAVAILABLE: (Reason.UNAVAILABLE, TransportError),
    _S.DATA_LOSS: (Reason.RPC_ERROR, ProtocolError),
    # Missing or unknown token (docs/protocol.md, Roles): configuration, raise.
    _S.UNAUTHENTICATED: (None, AuthError),
}


def classify_status(code: grpc.StatusCode | None) -> StatusRule:
    """What a gRPC status code means for a load and for a unary call. The only place that
    interprets status codes; a code this grpc version does not list is an RPC_ERROR."""
    if code is None:  # a call that ended without a status: treat as a broken transport
        code = _S.UNKNOWN
    reason, error = _TABLE.get(code, (Reason.RPC_ERROR, ProtocolError))
    return StatusRule(code, reason, error)


def error_for(code: grpc.StatusCode | None, details: str | None, what: str) -> RPCError:
    """The exception for a failed unary call (`what` names it for the message)."""
    rule = classify_status(code)
    name = rule.code.name
    text = details or ""
    return rule.error(f"{what}: {name}{': ' + text if text else ''}", code=rule.code, details=text)


def error_from_rpc(exc: grpc.RpcError, what: str) -> RPCError:
    """`error_for` applied to a grpc.RpcError (sync) or grpc.aio.AioRpcError."""
    call: Any = exc
    return error_for(call.code(), call.details(), what)
