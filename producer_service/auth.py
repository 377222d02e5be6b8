"""Bearer tokens by role, checked before any handler runs (docs/protocol.md, "Roles").

Two roles: the prefill side holds `park_token` (Park, and Release to give an id up); the
decode side holds `fetch_token` (Fetch, KeepAlive, Lookup, and Release to confirm a delivery it
received: a Release that names a delivery_id). GetServerInfo takes either role's token. A role
with no token configured is open. The interceptor decides by method; the one rule that needs
the request (giving up vs confirming) is applied by the servicer with `refuse_give_up`. Tokens
travel as the standard `authorization: Bearer <token>` metadata so proxies and other languages'
clients need nothing special.

Answers: no or unknown token -> UNAUTHENTICATED; a valid token of the other role ->
PERMISSION_DENIED. Neither answer depends on the id or says anything about it (the interceptor
runs before the request is even read). Comparisons are constant-time (`hmac.compare_digest`)
against every configured token, so timing does not tell which token was close. Health and
reflection stay open so orchestrators can probe (kvpark.producer.open_streams bounds how many
of their calls anyone may hold).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from .logs import LOGGER_NAME, RateLimitedWarnings
from .servicer import SERVICE_NAME

PARK_ROLE = "park"
FETCH_ROLE = "fetch"

# Method -> roles whose token is accepted.
_METHOD_ROLES: dict[str, frozenset[str]] = {
    "Park": frozenset({PARK_ROLE}),
    # Either role gets in; only the park role may give an id up (see `refuse_give_up`).
    "Release": frozenset({PARK_ROLE, FETCH_ROLE}),
    "Fetch": frozenset({FETCH_ROLE}),
    "KeepAlive": frozenset({FETCH_ROLE}),
    "Lookup": frozenset({FETCH_ROLE}),
    "GetServerInfo": frozenset({PARK_ROLE, FETCH_ROLE}),
}
# Release without a delivery_id gives an id up: the park role's right alone.
_GIVE_UP_ROLES = frozenset({PARK_ROLE})
# Methods that answer with a stream, to build a refusal handler whose answer has their shape.
_STREAMS_RESPONSES = frozenset({"Fetch"})


def _bearer(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode("utf-8", "surrogateescape")
            return None
    return None


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        park_token: str | None,
        fetch_token: str | None,
        on_suppressed: Callable[[str], None] = lambda kind: None,
    ) -> None:
        # Refused calls are logged (code and peer, never the token) at most once per peer per
        # 10 s; the rest are counted through `on_suppressed("auth")` (the producer's metric).
        self._warnings = RateLimitedWarnings(logging.getLogger(LOGGER_NAME), on_suppressed)
        self._tokens: dict[str, bytes] = {}
        if park_token:
            self._tokens[PARK_ROLE] = park_token.encode()
        if fetch_token:
            self._tokens[FETCH_ROLE] = fetch_token.encode()

    def role_of(self, presented: bytes | None) -> str | None:
        """The role whose token was presented, compared in constant time against all."""
        if presented is None:
            return None
        found = None
        for role, token in self._tokens.items():
            if hmac.compare_digest(presented, token):
                found = role
        return found

    def refuse_role(self, token: str | None, role: str) -> str | None:
        """For the shm socket, which has no gRPC metadata: None when `token` may act as
        `role` (or the role has no token), else why not."""
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        refusal = self._decide(f"lend a buffer for {role}", frozenset({role}), metadata)
        return None if refusal is None else refusal[1]

    def refuse_give_up(self, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """None when the caller may give ids up with Release (the park role's right), else
        the status to refuse it with."""
        return self._decide("give an id up", _GIVE_UP_ROLES, metadata)

    def open_methods(self) -> tuple[str, ...]:
        """The kvpark methods this interceptor lets through without any token: those of a
        role with no token configured (empty when both roles have one). Release counts as
        open only when giving ids up is; confirming a delivery is the fetch role's part."""
        return tuple(
            m
            for m in _METHOD_ROLES
            if (self.refuse_give_up(()) if m == "Release" else self.decide(m, ())) is None
        )

    def decide(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may proceed, else the status to refuse it with."""
        roles = _METHOD_ROLES.get(method)
        if roles is None:
            return None
        return self._decide(f"call {method}", roles, metadata)

    def _decide(
        self, action: str, roles: frozenset[str], metadata: Any
    ) -> tuple[grpc.StatusCode, str] | None:
        if any(role not in self._tokens for role in roles):
            return None  # a role with no token configured is open
        role = self.role_of(_bearer(metadata))
        if role is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token"
        if role not in roles:
            return grpc.StatusCode.PERMISSION_DENIED, f"the {role} token may not {action}"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service, _, method = details.method.lstrip("/").partition("/")
        if service != SERVICE_NAME:  # health and reflection: open (open_streams bounds them)
            return await continuation(details)
        refusal = self.decide(method, details.invocation_metadata)
        if refusal is None:
            return await continuation(details)
        return _refusing_handler(method in _STREAMS_RESPONSES, *refusal, warnings=self._warnings)


def _refusing_handler(
    streams_responses: bool,
    code: grpc.StatusCode,
    message: str,
    *,
    warnings: RateLimitedWarnings,
) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request. It is always registered
    as a stream-request kind, whatever the method's own shape: grpc runs a unary-request
    handler only once the request message has arrived, so a peer that sends headers and never
    a message would hold one of grpc's concurrent-call slots for as long as its connection
    lives (kvpark.producer.first_message). A stream-request handler starts at once, and the
    wire is the same for every cardinality, so the client still reads the status as usual."""

    async def refuse(request_iterator: Any, context: Any) -> None:
        peer = context.peer()
        warnings.warn("auth", peer, "call refused", lambda: {"code": code.name, "peer": peer})
        await context.abort(code, message)

    if streams_responses:

        async def refuse_stream(request_iterator: Any, context: Any) -> Any:
            await refuse(request_iterator, context)
            yield  # pragma: no cover - makes this an async generator

        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)
