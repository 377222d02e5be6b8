"""Container health probe for the producer.

Asks the producer's standard ``grpc.health.v1`` service whether it is SERVING and exits 0 if it
is, 1 otherwise (NOT_SERVING while shutting down, unreachable, timed out, ...), printing one line.
Used by the image's ``HEALTHCHECK`` and by compose::

    python -m producer_service.healthcheck [--target 127.0.0.1:50051] [--timeout 2] [--service NAME]

Without ``--target`` the address comes from ``KVPARK_LISTEN`` when that is set (a wildcard host
such as ``0.0.0.0`` or ``[::]`` is probed on loopback), else ``127.0.0.1:50051``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DEFAULT_TARGET = "127.0.0.1:50051"


def default_target(listen: str | None) -> str:
    """The address to probe for a producer listening on ``listen`` (``host:port``)."""
    if not listen:
        return DEFAULT_TARGET
    host, sep, port = listen.rpartition(":")
    if not sep or not port:
        return DEFAULT_TARGET
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def check(target: str, timeout: float, service: str = "") -> tuple[bool, str]:
    """Run one health Check; return (serving, one-line message)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    what = service or "server"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        name = code.name if code is not None else type(exc).__name__
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return False, f"unhealthy: {target} ({what}): {name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status == health_pb2.HealthCheckResponse.SERVING:
        return True, f"healthy: {target} ({what}): {status}"
    return False, f"unhealthy: {target} ({what}): {status}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m producer_service.healthcheck",
        description="Exit 0 if the producer's grpc.health.v1 service answers SERVING, else 1.",
    )
    parser.add_argument(
        "--target",
        default=None,
        help=f"host:port to probe (default: from KVPARK_LISTEN, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--timeout", type=float, default=2.0, help="deadline of the check in seconds (default 2)"
    )
    parser.add_argument(
        "--service", default="", help="service name to ask about (default: the whole server)"
    )
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    target = args.target or default_target(os.environ.get("KVPARK_LISTEN"))
    ok, message = check(target, args.timeout, args.service)
    print(message, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
