"""A loopback port that answers health and nothing else: the liveness probe's way in.

The gRPC server accepts at most `max_connections` connections, and grpc counts every
connection against that cap, a probe's included. A producer whose connections are all taken
(many decode workers, or clients that keep idle channels open) would refuse its own liveness
probe, and an orchestrator would restart it — losing every parked request — exactly when it is
busiest. `health_listen` is a second, small gRPC server on the same event loop, with the same
`grpc.health.v1` servicer (so it says NOT_SERVING the moment shutdown starts) and a cap of its
own. A probe through it still fails when the event loop stops answering, which is what liveness
is for.

It serves without TLS or tokens, so the configuration allows it on loopback only: only
processes on the producer's host (or in its pod) reach it, and health tells them nothing but
SERVING or NOT_SERVING.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from kvpark.address import Address

# Connections the health port serves at once: probes open one each and close it.
MAX_CONNECTIONS = 16
# Calls at once: a Check each, or a Watch a local monitor keeps open.
_MAX_CALLS = 16
# A connection that says nothing is dropped after this long.
_HANDSHAKE_TIMEOUT_MS = 5_000
_CONNECTION_IDLE_MS = 60_000


class HealthListener:
    """The health-only gRPC server on `address` (loopback)."""

    def __init__(self, address: Address, servicer: health.aio.HealthServicer) -> None:
        self._address = address
        self._servicer = servicer
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Binds and starts; returns the port taken. A failure to bind is an OSError naming
        `health_listen`, and leaves nothing bound."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_allowed_incoming_connections", MAX_CONNECTIONS),
                ("grpc.server_handshake_timeout_ms", _HANDSHAKE_TIMEOUT_MS),
                ("grpc.max_connection_idle_ms", _CONNECTION_IDLE_MS),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=_MAX_CALLS,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        value = str(self._address)
        try:
            port = server.add_insecure_port(value)
        except RuntimeError as exc:  # grpcio raises "Failed to bind"
            raise OSError(f"health_listen: cannot bind {value!r}: {exc}") from None
        if port == 0:
            raise OSError(f"health_listen: cannot bind {value!r}")
        await server.start()
        self._server = server
        return int(port)

    async def stop(self) -> None:
        """Stops at once: by now health has said NOT_SERVING for the whole drain."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
