"""How every kvpark client opens its one channel: target, token, credentials, options.

`KVConsumer`, `KVParker` and their async twins each own one channel to one producer, built
from one `ChannelSettings`, so the transport settings that matter for multi-MiB messages
(receive limit, keepalive, reconnect backoff, frame and read sizes) cannot drift apart between
the decode side and the prefill side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc.experimental import ChannelOptions

from kvpark.tokens import TOKEN_EXPECTED, is_valid_token

from ._errors import UsageError
from ._guarded_channel import GuardedChannel

# Room for a message's framing around a max_chunk_bytes payload (a few bytes are needed; the
# producer uses the same margin).
FRAME_MARGIN_BYTES = 64 * 1024
# The largest chunk a client receives or sends unless told otherwise. Above the producer's
# default max_chunk_bytes (16 MiB), so a producer configured for larger chunks works too; a
# client learns the producer's own limit from ServerInfo and warns when it is larger.
DEFAULT_MAX_CHUNK_BYTES = 64 * 1024 * 1024
# Transport keepalive while a call is open: a producer that vanished without closing the
# connection (network cut, frozen host) is noticed within about PING + TIMEOUT seconds. The
# producer permits pings every 1 s. A killed process is noticed at once (the kernel resets
# the connection), without waiting for a ping.
KEEPALIVE_PING_MS = 2_000
KEEPALIVE_TIMEOUT_MS = 2_000
# Reconnect quickly after a producer restart: a worker should see the new process (and its
# EPOCH_MISMATCH answers) within a second or two, not after grpc's default 120 s backoff.
# (Not grpc.min_reconnect_backoff_ms: grpc core also uses it as the minimum time a connection
# attempt may take, default 20 s; lowering it fails slow handshakes, e.g. TLS on a busy node.)
RECONNECT_BACKOFF_MS = (100, 2_000)  # initial, max
# How soon a channel that lost its producer may look its name up again. grpc's default is
# 30 s: a producer rescheduled under the same DNS name on another host (a pod, a compose
# service's new container) would stay unreachable that long, every load failing over to
# recompute, while a fresh channel reaches it at once. One lookup a second while failing costs
# the resolver nothing.
DNS_RESOLUTION_MIN_MS = 1_000


@dataclass(frozen=True, slots=True)
class ChannelSettings:
    target: str
    # The bearer token, kept out of every repr (it also goes to the shm socket).
    token: str | None = field(repr=False)
    metadata: tuple[tuple[str, str], ...] | None = field(repr=False)
    credentials: grpc.ChannelCredentials | None
    options: tuple[tuple[str, Any], ...]
    interceptors: tuple[Any, ...]
    max_chunk_bytes: int

    @classmethod
    def build(
        cls,
        target: str,
        *,
        token: str | None,
        credentials: grpc.ChannelCredentials | None,
        channel_options: Sequence[tuple[str, Any]],
        interceptors: Sequence[Any],
        max_chunk_bytes: int,
    ) -> ChannelSettings:
        problem = target_problem(target)
        if problem is not None:
            raise UsageError(f"target: {problem}")
        if token is not None and not is_valid_token(token):
            raise UsageError(f"token: expected {TOKEN_EXPECTED} (value not shown)")
        if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int):
            raise UsageError(f"max_chunk_bytes: expected an int, got {max_chunk_bytes!r}")
        if not 0 < max_chunk_bytes <= 2**31 - 1 - FRAME_MARGIN_BYTES:
            raise UsageError(f"max_chunk_bytes: out of range: {max_chunk_bytes}")
        limit = max_chunk_bytes + FRAME_MARGIN_BYTES
        options: dict[str, Any] = {
            "grpc.max_receive_message_length": limit,
            "grpc.max_send_message_length": limit,
            "grpc.keepalive_time_ms": KEEPALIVE_PING_MS,
            "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
            "grpc.http2.ping_timeout_ms": KEEPALIVE_TIMEOUT_MS,
            "grpc.keepalive_permit_without_calls": 0,
            "grpc.http2.max_pings_without_data": 0,
            "grpc.initial_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[0],
            "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MS[1],
            "grpc.dns_min_time_between_resolutions_ms": DNS_RESOLUTION_MIN_MS,
            # Larger HTTP/2 frames and socket reads for multi-MiB chunks: fewer, bigger copies
            # in gRPC's receive path (docs/performance.md: -12 % client CPU per GB).
            "grpc.http2.max_frame_size": 16 * 1024 * 1024 - 1,
            "grpc.experimental.tcp_min_read_chunk_size": 4 * 1024 * 1024,
            "grpc.experimental.tcp_max_read_chunk_size": 8 * 1024 * 1024,
        }
        options.update(dict(channel_options))  # the caller's options win
        return cls(
            target=target,
            token=token,
            metadata=(("authorization", f"Bearer {token}"),) if token else None,
            credentials=credentials,
            options=tuple(options.items()),
            interceptors=tuple(interceptors),
            max_chunk_bytes=max_chunk_bytes,
        )

    @property
    def tls_server_name(self) -> str | None:
        """The name the channel checks the producer's certificate against instead of the
        target's host (`grpc.ssl_target_name_override`, e.g. one certificate shared by
        producers dialled by pod IP); the TCP data connection checks the same name."""
        for key, value in self.options:
            if key == "grpc.ssl_target_name_override" and value:
                return str(value)
        return None

    def open_sync(self) -> grpc.Channel:
        # A Fetch (server streaming) iterated on the caller's own thread. Without this option
        # grpc's sync API starts a thread to drive the channel whenever a streaming call begins
        # with no other one open, i.e. for nearly every load of a worker that loads one id at a
        # time: a late fetch cost the client 816 us of CPU with that thread, 523 us without,
        # and on a busy machine `Thread.start` also waits for that thread to be scheduled.
        # grpc turns it on whenever the key is present, so a caller's falsy value (for an
        # interceptor that wraps calls, whose cut-off loads the client cannot drain) drops it.
        single = ChannelOptions.SingleThreadedUnaryStream
        options = [(k, v) for k, v in self.options if k != single]
        if dict(self.options).get(single, 1):
            options.append((single, 1))
        if self.credentials is not None:
            channel = grpc.secure_channel(self.target, self.credentials, options)
        else:
            channel = grpc.insecure_channel(self.target, options)
        if self.interceptors:
            channel = grpc.intercept_channel(GuardedChannel(channel), *self.interceptors)
        return channel

    def open_aio(self) -> grpc.aio.Channel:
        kwargs: dict[str, Any] = {"options": list(self.options)}
        if self.interceptors:
            kwargs["interceptors"] = self.interceptors
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.target, self.credentials, **kwargs)
        return grpc.aio.insecure_channel(self.target, **kwargs)


# gRPC's own target schemes: a target that starts with one goes to gRPC as it is.
_GRPC_SCHEMES = (
    "dns", "ipv4", "ipv6", "unix", "unix-abstract", "vsock", "xds", "google-c2p", "passthrough",
)  # fmt: skip
_EXPECTED_TARGET = "expected 'host:port' or a gRPC target such as 'dns:///host:port' or 'unix:PATH'"


def target_problem(target: object) -> str | None:
    """What is wrong with a client's `target`, or None. Anything but a gRPC URI must be a
    dialable host:port: gRPC itself would take "localhost" as port 443, a stray space as part
    of the name, and "http://host:port" as a name, and each load would then fail UNAVAILABLE
    as if the producer were down."""
    if not isinstance(target, str) or not target:
        return f"{_EXPECTED_TARGET}, got {target!r}"
    scheme, colon, _ = target.partition(":")
    if colon and scheme.lower() in _GRPC_SCHEMES:
        return None
    if target != target.strip():
        return f"{target!r} has spaces around it"
    # Looser than kvpark.address on the host: gRPC's resolver takes names such as docker
    # compose v1's "my_service_1" or a fully qualified "svc.ns.svc.cluster.local.".
    host, colon, port = target.rpartition(":")
    if not colon or not host or "/" in host or any(c.isspace() for c in host):
        return f"{_EXPECTED_TARGET}, got {target!r}"
    if not (port.isascii() and port.isdigit()) or int(port) > 65535:
        return f"{_EXPECTED_TARGET}, got {target!r}"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # gRPC's resolver takes "::1:50051" for a name, and fails to resolve it.
        return f"{target!r}: put an IPv6 address in brackets, as in '[::1]:50051'"
    if int(port) == 0:
        return f"{target!r}: port 0 cannot be dialed"
    return None
